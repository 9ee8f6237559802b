"""`k3serve worker --tensor-parallel-size 2 --enable-expert-parallel --enable-sequence-parallel` as a real
process on the tiny checkpoint: over gRPC its greedy tokens (a 7-token prefill: ragged shards; then
one-token decode steps: the replicated path) equal the single-rank offline engine's; SIGKILL of rank 1
makes the worker exit non-zero within 10 s naming the rank, with no rank process left behind."""

import os
import signal
import subprocess
import sys
import time

import grpc
from test_parallel_worker import PROMPT

from k3serve.proto import worker_pb2 as pb
from k3serve.proto import worker_pb2_grpc as pb_grpc
from k3serve.proto.convert import sampling_to_proto
from k3serve.sampling_params import SamplingParams
from k3serve.workers.llm import LLM
from tests._proc_tree import _alive, _children
from tests._workers import _wait_ready


def test_sp_worker_serves_the_single_rank_tokens_and_dies_cleanly(tiny_model_dir):
    cmd = [sys.executable, "-m", "k3serve.cli", "worker", "--model", str(tiny_model_dir), "--grpc-port", "0",
           "--metrics-port", "0", "--max-model-len", "256", "--num-threads", "1", "--log-level", "warning",
           "--tensor-parallel-size", "2", "--enable-expert-parallel", "--enable-sequence-parallel",
           "--dtype", "float64"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONSAFEPATH="1", OMP_NUM_THREADS="1"))
    lines = []
    try:
        addr, _murl = _wait_ready(proc, 180, lines)
        with grpc.insecure_channel(addr) as ch:
            stub = pb_grpc.WorkerStub(ch)
            req = pb.GenerateRequest(request_id="r1", prompt_token_ids=PROMPT,
                                     sampling_params=sampling_to_proto(dict(temperature=0.0, max_tokens=6,
                                                                            ignore_eos=True)))
            toks = [t for r in stub.Generate(req, timeout=60) for o in r.outputs for t in o.token_ids]
        single = LLM(str(tiny_model_dir), dtype="float64", max_model_len=256)
        sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        assert toks == single.generate([PROMPT], sp)[0].outputs[0].token_ids
        ranks = _children(proc.pid)
        victims = [p for p in ranks if "resource_tracker" not in open(f"/proc/{p}/cmdline").read()]
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        t0 = time.monotonic()
        rc = proc.wait(timeout=10)
        assert rc != 0 and time.monotonic() - t0 < 10, "".join(lines)
        assert "rank 1 exited" in "".join(lines)
        gone = time.monotonic() + 5
        while time.monotonic() < gone and [p for p in ranks if _alive(p)]:
            time.sleep(0.1)
        assert not [p for p in ranks if _alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sp_worker_without_expert_parallel_is_refused_in_one_line(tiny_model_dir):
    """The flag reaches the layout check: without expert parallelism it is one line, before any rank starts."""
    cmd = [sys.executable, "-m", "k3serve.cli", "worker", "--model", str(tiny_model_dir), "--grpc-port", "0",
           "--metrics-port", "0", "--tensor-parallel-size", "2", "--enable-sequence-parallel"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONSAFEPATH="1"))
    assert proc.returncode != 0
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "enable_sequence_parallel needs enable_expert_parallel" in err[0], proc.stderr
