"""`k3serve up --store`: the Mooncake master and 2 workers in one private network namespace, the router in
the host namespace reaching them over Unix-domain sockets (k3serve/up.py).

A prompt served by one worker lands in the store; the same long prefix routed to the OTHER worker (which
never saw it) is predicted from the store (StoreLookup, router/dispatch.py), loaded from it (the worker's
cached_tokens), and the greedy output equals the offline engine's (float64). Killing the master mid-run:
the next requests still succeed with the same outputs.
"""

import os
import re
import signal
import time

import httpx
import pytest
from _up import running_up

MAX_LEN = 1024
PREFIX = "You are a helpful assistant. " * 30  # ~750 tokens: several 240-token blocks

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="--store needs root (a private network namespace)")


@pytest.fixture(scope="module")
def platform(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("up-store-logs")
    with running_up(tiny_model_dir, logs, "--store", "--workers", "2", max_model_len=MAX_LEN,
                    start_timeout=120) as up:
        yield up


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    import torch

    from k3serve.workers.llm import LLM

    torch.set_num_threads(1)
    return LLM(str(tiny_model_dir), dtype="float64", max_model_len=MAX_LEN)


def _complete(url, prompt, max_tokens=3):
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r


def _ref(offline, prompt, max_tokens=3):
    from k3serve.sampling_params import SamplingParams

    return offline.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))[0].outputs[0].text


def _store_lookup(addr, prompt_ids):
    import grpc

    from k3serve.proto import worker_pb2 as pb
    from k3serve.proto import worker_pb2_grpc as pb_grpc

    with grpc.insecure_channel(addr) as ch:
        return pb_grpc.WorkerStub(ch).StoreLookup(pb.StoreLookupRequest(prompt_token_ids=prompt_ids), timeout=5)


@needs_root
def test_store_hit_on_the_other_worker_equals_offline(platform, offline):
    url, state = platform["url"], platform["state"]
    assert "store" in state and all(w["cmd"][0] == "nsenter" for w in state["workers"])
    first = _complete(url, PREFIX + "first")
    served = first.headers["x-k3serve-worker"]
    assert served.startswith("unix:")
    assert first.json()["choices"][0]["text"] == _ref(offline, PREFIX + "first")
    other = next(w for w in ["unix:" + s for s in _socks(state)] if w != served)
    ids = offline.engine.tokenizer.encode(PREFIX + "second")
    deadline = time.monotonic() + 20  # the store write of the first request completes asynchronously
    while True:
        resp = _store_lookup(other, ids)
        if resp.num_tokens > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert resp.status == 1 and resp.num_tokens >= 480, resp  # OK: the store has the prefix's blocks
    for i in range(4):  # equal usable hits on both workers: ties alternate, so the other worker gets one soon
        prompt = PREFIX + f"second {i}"
        r = _complete(url, prompt)
        if r.headers["x-k3serve-worker"] == other:
            break
    else:
        pytest.fail("no request with the shared prefix went to the other worker")
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert int(r.headers["x-k3serve-predicted-store-tokens"]) >= 480
    assert int(r.headers["x-k3serve-predicted-cached-tokens"]) == cached >= 480  # loaded from the store
    assert r.json()["choices"][0]["text"] == _ref(offline, prompt)
    metrics = httpx.get(_router_metrics(state), timeout=10).text
    assert re.search(r'k3serve_router_hit_tokens_total\{[^}]*source="store"[^}]*\} [1-9]', metrics), metrics


@needs_root
def test_master_killed_requests_still_succeed(platform, offline):
    url, state = platform["url"], platform["state"]
    os.killpg(state["store"]["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    for i in range(3):
        prompt = PREFIX + f"after the store died {i}"
        r = _complete(url, prompt)
        assert r.json()["choices"][0]["text"] == _ref(offline, prompt)
    assert time.monotonic() - t0 < 60


def _socks(state):
    return [re.search(r"--grpc-uds (\S+)", " ".join(w["cmd"])).group(1) for w in state["workers"]]


def _router_metrics(state):
    m = state["router"]["metrics"]
    return (m if m.startswith("http") else "http://" + m).rstrip("/") + ("" if m.endswith("/metrics") else "/metrics")


def test_store_lookup_is_bounded_and_no_store_stops_asking():
    """The router's one StoreLookup per request: a worker that answers too slowly counts as 0 within the
    timeout; NO_STORE marks the worker storeless (no further lookups); OK gives the store's tokens."""
    import asyncio

    import grpc

    from k3serve.proto import worker_pb2 as pb
    from k3serve.proto import worker_pb2_grpc as pb_grpc
    from k3serve.router.dispatch import Dispatcher
    from k3serve.router.policy import make_policy
    from k3serve.router.registry import Worker

    class Svc(pb_grpc.WorkerServicer):
        def __init__(self):
            self.mode, self.calls = "slow", 0

        async def StoreLookup(self, request, context):
            self.calls += 1
            if self.mode == "slow":
                await asyncio.sleep(2.0)
            status = pb.StoreLookupResponse.NO_STORE if self.mode == "none" else pb.StoreLookupResponse.OK
            return pb.StoreLookupResponse(status=status, num_tokens=len(request.prompt_token_ids) // 2)

    class Reg:
        def __init__(self, w):
            self.workers = {w.address: w}

    async def main():
        svc = Svc()
        server = grpc.aio.server()
        pb_grpc.add_WorkerServicer_to_server(svc, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        w = Worker(f"127.0.0.1:{port}", "both", 0, ch, pb_grpc.WorkerStub(ch), healthy=True)
        d = Dispatcher(Reg(w), None, make_policy("hybrid-prefix"), fingerprint=b"x", unit=16, metrics=None,
                       model_name="m", store_timeout=0.2)
        try:
            t0 = time.perf_counter()
            assert await d.store_hit(list(range(64)), None) == 0
            assert time.perf_counter() - t0 < 0.6
            svc.mode = "ok"
            assert await d.store_hit(list(range(64)), None) == 32 and w.has_store is True
            svc.mode = "none"
            assert await d.store_hit(list(range(64)), None) == 0 and w.has_store is False
            calls = svc.calls
            assert await d.store_hit(list(range(64)), None) == 0 and svc.calls == calls
        finally:
            await ch.close()
            await server.stop(None)

    asyncio.run(main())
