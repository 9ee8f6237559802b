"""`k3serve worker` as a real process on the tiny checkpoint: gRPC Generate/Abort/Health/GetLoad and the
metrics port (/metrics, /health, /ready). Greedy tokens over gRPC equal the offline LLM's."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest

from k3serve.proto import worker_pb2 as pb
from k3serve.proto import worker_pb2_grpc as pb_grpc
from k3serve.proto.convert import load_to_dict, sampling_to_proto

MAX_LEN = 512


def _cmd(model_dir, *extra):
    return [sys.executable, "-m", "k3serve.cli", "worker", "--model", str(model_dir), "--grpc-port", "0",
            "--metrics-port", "0", "--max-model-len", str(MAX_LEN), "--num-threads", "1", "--log-level", "warning",
            *extra]


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    env = dict(os.environ, PYTHONSAFEPATH="1")
    proc = subprocess.Popen(_cmd(tiny_model_dir, "--role", "both", "--served-model-name", "tiny"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines, found = [], None
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        found = re.search(r"ready grpc=(\S+) metrics=(\S+)", line)
        if found:
            break
    if not found:
        proc.kill()
        pytest.fail("worker did not start:\n" + "".join(lines))
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    channel = grpc.insecure_channel(found.group(1))
    yield proc, pb_grpc.WorkerStub(channel), found.group(2)
    channel.close()
    if proc.poll() is None:
        proc.kill()


def test_health_load_and_metrics_port(worker):
    _, stub, murl = worker
    h = stub.Health(pb.HealthRequest(), timeout=10)
    assert (h.status, h.role, h.model) == (pb.HealthResponse.SERVING, "both", "tiny")
    load = load_to_dict(stub.GetLoad(pb.LoadRequest(), timeout=10))
    assert load["running"] == 0 and load["waiting"] == 0 and load["max_model_len"] == MAX_LEN
    assert 0 < load["free_pages"] <= load["total_pages"] and load["kda_slots_total"] > 0
    assert httpx.get(murl + "/health").status_code == 200 and httpx.get(murl + "/ready").status_code == 200
    assert "# TYPE vllm:num_requests_running gauge" in httpx.get(murl + "/metrics").text


def test_generate_greedy_matches_offline_llm(worker, tiny_model_dir):
    _, stub, murl = worker
    import torch

    from k3serve.workers.llm import LLM

    torch.set_num_threads(1)
    from k3serve.sampling_params import SamplingParams

    prompt = [5, 17, 42, 99, 7]
    sp = dict(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    resps = list(stub.Generate(pb.GenerateRequest(request_id="greedy-1", prompt_token_ids=prompt,
                                                  sampling_params=sampling_to_proto(sp)), timeout=60))
    ids = [t for r in resps for o in r.outputs for t in o.token_ids]
    assert resps[-1].finished and resps[-1].outputs[-1].finish_reason == "length"
    assert all(r.prompt_tokens == len(prompt) for r in resps)
    assert len([lp for r in resps for o in r.outputs for lp in o.logprobs]) == 6
    ref = LLM(str(tiny_model_dir), max_model_len=MAX_LEN).generate(prompt, SamplingParams(**sp))[0]
    assert ids == ref.outputs[0].token_ids
    assert "".join(o.text for r in resps for o in r.outputs) == ref.outputs[0].text
    m = re.search(r'^vllm:prompt_tokens_total\{model_name="tiny"\} (\S+)$', httpx.get(murl + "/metrics").text, re.M)
    assert m and float(m.group(1)) >= len(prompt)


def test_abort_in_flight(worker):
    _, stub, _ = worker
    call = stub.Generate(pb.GenerateRequest(request_id="long-1", prompt_token_ids=[1, 2, 3],
                                            sampling_params=sampling_to_proto(dict(max_tokens=400, ignore_eos=True))),
                         timeout=60)
    first = next(call)
    assert first.request_id == "long-1"
    assert stub.Abort(pb.AbortRequest(request_id="long-1"), timeout=10).found
    rest = list(call)
    assert rest[-1].finished and rest[-1].outputs[-1].finish_reason == "abort"
    assert sum(len(o.token_ids) for r in [first, *rest] for o in r.outputs) < 400
    deadline = time.monotonic() + 5  # the load snapshot follows the engine's next stats refresh
    while load_to_dict(stub.GetLoad(pb.LoadRequest(), timeout=10))["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert load_to_dict(stub.GetLoad(pb.LoadRequest(), timeout=10))["running"] == 0


def test_invalid_argument(worker):
    _, stub, _ = worker
    with pytest.raises(grpc.RpcError) as ei:
        list(stub.Generate(pb.GenerateRequest(request_id="bad", prompt_token_ids=list(range(MAX_LEN))), timeout=10))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_sigterm_exits_cleanly(worker):
    proc, stub, _ = worker
    events = stub.SubscribeKvEvents(pb.KvEventsRequest(), timeout=60)
    snap = next(events)  # caching is off here: an empty, complete snapshot
    assert snap.snapshot and snap.snapshot_complete and snap.sequence == 0 and not snap.events
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    with pytest.raises(grpc.RpcError) as ei:  # an open event stream ends at once, it does not hold the exit
        next(events)
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in ei.value.details()
    assert proc.wait(timeout=30) == 0
    assert time.monotonic() - t0 < 10


def test_unsplittable_layout_is_refused(tiny_model_dir):
    """Every layout the flags can name is served now (P/D with TP, DEP prefill/decode, groups over nodes:
    tests/test_pd_hetero_tp.py, tests/test_dep_prefill.py, tests/test_dep_multinode.py); one that cannot be laid
    out (ranks that do not split evenly over the nodes) is one line and exit 2 before any rank starts."""
    r = subprocess.run(_cmd(tiny_model_dir, "--tensor-parallel-size", "3", "--nnodes", "2"), capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, PYTHONSAFEPATH="1"))
    out = r.stdout + r.stderr
    assert r.returncode == 2 and "--tensor-parallel-size=3 does not split over --nnodes=2" in out, (r.stdout, r.stderr)
    assert "Traceback" not in out
