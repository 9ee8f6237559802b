"""The worker's gRPC service (worker.proto) over AsyncEngine with a scripted fake engine, and the
proto conversions. The real `k3serve worker` process is tested in test_worker_grpc_e2e.py."""

import asyncio
import itertools
import threading
import time

import _serve_fakes as fakes  # tests/ is on sys.path (conftest)
import grpc
import pytest

from k3serve.openai_api import protocol as P
from k3serve.openai_api.deltas import SeqDelta
from k3serve.outputs import Logprob
from k3serve.proto import worker_pb2 as pb
from k3serve.proto import worker_pb2_grpc as pb_grpc
from k3serve.proto.convert import (
    deltas_from_proto,
    deltas_to_proto,
    load_to_dict,
    sampling_kwargs_from_proto,
    sampling_to_proto,
)
from k3serve.sampling_params import SamplingParams
from k3serve.workers.async_engine import AsyncEngine
from k3serve.workers.grpc_service import start_grpc_server


class Loop:
    """An asyncio loop on a thread (grpc.aio objects stay on one loop for the whole module)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def __call__(self, awaitable, timeout=20):
        """Run a coroutine, or a callable making an awaitable (gRPC calls must be created on the loop)."""

        async def wrap():
            return await (awaitable() if callable(awaitable) else awaitable)

        return asyncio.run_coroutine_threadsafe(wrap(), self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Worker:
    def __init__(self, loop: Loop, engine):
        self.loop, self.engine = loop, engine
        self.aeng = AsyncEngine(engine, model_name="fake-k3", idle_wait_s=0.02)
        self.aeng.start()

        async def up():
            server = await start_grpc_server(self.aeng, port=0, role="both", model_name="fake-k3")
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
            return server, channel, pb_grpc.WorkerStub(channel)

        self.server, self.channel, self.stub = loop(up())

    def generate(self, req: pb.GenerateRequest, timeout=20):
        async def go():
            return [r async for r in self.stub.Generate(req, timeout=timeout)]

        return self.loop(go(), timeout + 5)

    def close(self):
        async def down():
            await self.channel.close()
            await self.server.stop(0)

        self.loop(down())
        self.aeng.shutdown()


@pytest.fixture(scope="module")
def loop():
    lp = Loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return fakes.make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture()
def worker(loop, tok):
    w = Worker(loop, fakes.FakeEngine(tok, max_model_len=64))
    yield w
    w.close()


def req(rid, prompt, **sampling):
    return pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=sampling_to_proto(sampling))


def test_generate_streams_deltas(worker, tok):
    worker.engine.script = lambda p, params, i: tok.encode(f" reply {i}")
    resps = worker.generate(req("g1", [3, 4, 5], n=2, max_tokens=20, logprobs=1, stop=["zzz"]))
    assert all(r.request_id == "g1" and r.prompt_tokens == 3 for r in resps)
    assert [r.finished for r in resps] == [False] * (len(resps) - 1) + [True]
    for i in range(2):
        outs = [o for r in resps for o in r.outputs if o.index == i]
        assert "".join(o.text for o in outs) == f" reply {i}"
        ids = [t for o in outs for t in o.token_ids]
        assert ids == tok.encode(f" reply {i}") + [tok.eos_token_id]
        assert [o.finish_reason for o in outs if o.HasField("finish_reason")] == ["stop"]
        lps = [lp for o in outs for lp in o.logprobs]
        assert [lp.token_id for lp in lps] == ids and all(lp.entries[0].token_id == lp.token_id for lp in lps)
    (_, prompt, params, salt) = worker.engine.added[-1]
    assert prompt == [3, 4, 5] and params.n == 2 and params.stop == ["zzz"] and params.logprobs == 1 and salt is None


def test_stop_reason_and_cache_salt(worker, tok):
    worker.engine.script = lambda p, params, i: tok.encode("one two three")
    r = pb.GenerateRequest(request_id="s1", prompt_token_ids=[1], cache_salt="tenant-a",
                           sampling_params=sampling_to_proto({"stop": [" two"], "max_tokens": 30}))
    resps = worker.generate(r)
    last = resps[-1].outputs[-1]
    assert last.finish_reason == "stop" and last.WhichOneof("stop_reason") == "stop_string"
    assert last.stop_string == " two"
    assert "".join(o.text for x in resps for o in x.outputs) == "one"
    assert worker.engine.added[-1][3] == "tenant-a"


@pytest.mark.parametrize("request_, code, needle", [
    (req("", [1]), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    (req("e1", []), grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
    (req("e2", [1], temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (req("e3", list(range(64))), grpc.StatusCode.INVALID_ARGUMENT, "max_model_len"),
    (req("e4", [1], logit_bias={10 ** 6: 1.0}), grpc.StatusCode.INVALID_ARGUMENT, "logit_bias"),
])
def test_invalid_requests(worker, request_, code, needle):
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        worker.generate(request_)
    assert ei.value.code() == code and needle in ei.value.details()
    assert worker.aeng.num_in_flight() == 0


def test_abort_rpc_duplicate_id_and_cancel(worker, loop, tok):
    worker.engine.script = lambda p, params, i: itertools.cycle(tok.encode("la"))
    worker.engine.step_delay = 0.01
    long = dict(max_tokens=10_000, ignore_eos=True)

    async def scenario():
        stream = worker.stub.Generate(req("long", [1], **long))
        first = await stream.read()
        assert first.request_id == "long"
        with pytest.raises(grpc.aio.AioRpcError) as ei:  # same id while in flight
            async for _ in worker.stub.Generate(req("long", [2], **long)):
                pass
        assert ei.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert (await worker.stub.Abort(pb.AbortRequest(request_id="long"))).found
        assert not (await worker.stub.Abort(pb.AbortRequest(request_id="nope"))).found
        rest = []
        while (msg := await stream.read()) is not grpc.aio.EOF:
            rest.append(msg)
        assert rest[-1].finished and rest[-1].outputs[-1].finish_reason == "abort"
        # a client that cancels its call aborts the request in the engine
        call = worker.stub.Generate(req("cancelled", [1], **long))
        await call.read()
        call.cancel()

    loop(scenario())
    deadline = time.monotonic() + 10
    while "cancelled" not in worker.engine.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert worker.engine.aborted[:1] == ["long"] and "cancelled" in worker.engine.aborted
    worker.engine.step_delay = 0.0


def test_health_and_load(worker, loop):
    h = loop(lambda: worker.stub.Health(pb.HealthRequest()))
    assert (h.status, h.role, h.model) == (pb.HealthResponse.SERVING, "both", "fake-k3")
    load = load_to_dict(loop(lambda: worker.stub.GetLoad(pb.LoadRequest())))
    assert load == dict(running=0, waiting=0, free_pages=100, total_pages=100, kv_usage=0.0, kda_slots_used=0,
                        kda_slots_total=50, max_model_len=64, model="fake-k3", role="both",
                        kv_event_sequence=0)


def test_dead_engine(loop, tok):
    w = Worker(loop, fakes.FakeEngine(tok, max_model_len=64, fail_on_step=1))
    try:
        for i in range(4):  # three failed steps are contained (the request fails alone), the fourth is fatal
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                w.generate(req(f"d1-{i}", [1], max_tokens=3))
            assert ei.value.code() == grpc.StatusCode.INTERNAL and "simulated engine failure" in ei.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            w.generate(req("d2", [1], max_tokens=3))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        h = loop(lambda: w.stub.Health(pb.HealthRequest()))
        assert h.status == pb.HealthResponse.NOT_SERVING and "simulated" in h.message
    finally:
        w.close()


def test_sampling_roundtrip_through_proto():
    chat = P.parse_request(P.ChatCompletionRequest, {
        "model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0.7, "top_p": 0.95,
        "top_k": 20, "seed": 5, "n": 2, "stop": ["a", "b"], "stop_token_ids": [3], "logit_bias": {"7": -1.5},
        "presence_penalty": 0.3, "logprobs": True, "top_logprobs": 4, "min_tokens": 1, "ignore_eos": True})
    kw = P.sampling_kwargs(chat, max_tokens=33, chat=True)
    back = sampling_kwargs_from_proto(pb.SamplingParams.FromString(sampling_to_proto(kw).SerializeToString()))
    assert SamplingParams(**back) == SamplingParams(**kw)
    assert sampling_kwargs_from_proto(pb.SamplingParams()) == {"max_tokens": None}
    assert SamplingParams(**sampling_kwargs_from_proto(pb.SamplingParams())).max_tokens is None


def test_deltas_roundtrip_through_proto():
    ds = [SeqDelta(0, [5, 6], "ab", [{5: Logprob(-0.5, 1, "a"), 9: Logprob(-1.0, 2, "z")},
                                     {6: Logprob(-0.25, 1, None)}], "stop", 6),
          SeqDelta(1, [], "", None, "length", None), SeqDelta(2, [4], "c", None, "stop", "STOP")]
    msgs = [pb.SequenceDelta.FromString(m.SerializeToString()) for m in deltas_to_proto(ds)]
    back = deltas_from_proto(msgs, with_logprobs=True)
    assert back[0] == ds[0]
    assert [(d.index, d.finish_reason, d.stop_reason) for d in back[1:]] == [(1, "length", None), (2, "stop", "STOP")]
    assert deltas_from_proto(msgs, with_logprobs=False)[0].logprobs is None
