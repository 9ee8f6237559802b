"""`k3serve worker --tensor-parallel-size 2` as a real process on the tiny checkpoint: it serves over gRPC
with greedy tokens equal to the single-rank offline engine's; SIGKILL of its rank 1 makes /health answer
503 and the worker exit non-zero within 10 s, with no rank process left behind."""

import os
import signal
import subprocess
import sys
import time

import grpc
import httpx

from k3serve.proto import worker_pb2 as pb
from k3serve.proto import worker_pb2_grpc as pb_grpc
from k3serve.proto.convert import sampling_to_proto
from k3serve.sampling_params import SamplingParams
from k3serve.workers.llm import LLM
from tests._proc_tree import _alive, _children
from tests._workers import _wait_ready

PROMPT = [5, 17, 33, 2, 91, 40, 7]


def test_tp2_worker_serves_then_dies_cleanly_when_a_rank_is_killed(tiny_model_dir):
    cmd = [sys.executable, "-m", "k3serve.cli", "worker", "--model", str(tiny_model_dir), "--grpc-port", "0",
           "--metrics-port", "0", "--max-model-len", "256", "--num-threads", "1", "--log-level", "warning",
           "--tensor-parallel-size", "2", "--expert-parallel", "--dtype", "float64"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONSAFEPATH="1"))
    lines = []
    try:
        addr, murl = _wait_ready(proc, 180, lines)
        with grpc.insecure_channel(addr) as ch:
            stub = pb_grpc.WorkerStub(ch)
            sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            req = pb.GenerateRequest(request_id="r1", prompt_token_ids=PROMPT,
                                     sampling_params=sampling_to_proto(dict(temperature=0.0, max_tokens=4,
                                                                            ignore_eos=True)))
            toks = [t for r in stub.Generate(req, timeout=60) for o in r.outputs for t in o.token_ids]
        single = LLM(str(tiny_model_dir), dtype="float64", max_model_len=256)
        assert toks == single.generate([PROMPT], sp)[0].outputs[0].token_ids
        assert httpx.get(murl + "/health", timeout=5).status_code == 200
        ranks = _children(proc.pid)
        # the spawned rank: the child that is not multiprocessing's resource tracker
        victims = [p for p in ranks if "resource_tracker" not in open(f"/proc/{p}/cmdline").read()]
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10 and proc.poll() is None:  # unhealthy until the process is gone
            try:
                assert httpx.get(murl + "/health", timeout=1).status_code in (200, 503)
            except httpx.HTTPError:
                pass  # the metrics server has stopped: the worker is exiting
            time.sleep(0.1)
        rc = proc.wait(timeout=max(0.1, 10 - (time.monotonic() - t0)))
        assert rc != 0, "".join(lines)
        assert time.monotonic() - t0 < 10
        assert "rank 1 exited" in "".join(lines)
        gone = time.monotonic() + 5  # multiprocessing's resource tracker follows its parent out
        while time.monotonic() < gone and [p for p in ranks if _alive(p)]:
            time.sleep(0.1)
        assert not [p for p in ranks if _alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
