"""SubscribeKvEvents over real gRPC: the real engine on the tiny model (prefix caching, a small KV budget,
KDA retention) under a randomized Generate workload, rebuilt by a subscriber and compared with the
engine's cache; and, on a scripted cache, the slow-subscriber drop (RESOURCE_EXHAUSTED), unsubscribe on
cancel and engine death (UNAVAILABLE)."""

import argparse
import asyncio
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import _serve_fakes as fakes  # tests/ is on sys.path (conftest)
import grpc
import pytest
import torch
from _kv_event_fakes import CacheFake

from k3serve.kv_events.index import KvEventIndex
from k3serve.proto import worker_pb2 as pb
from k3serve.proto import worker_pb2_grpc as pb_grpc
from k3serve.proto.convert import load_to_dict, sampling_to_proto
from k3serve.workers import worker as worker_cli
from k3serve.workers.async_engine import AsyncEngine
from k3serve.workers.engine.cache_layout import plan_cache_layout
from k3serve.workers.engine_cli import start_engine
from k3serve.workers.grpc_service import start_grpc_server
from k3serve.workers.model.config import K3Config

MAX_LEN, BLOCK, UNIT = 128, 16, 8


class Loop:
    """An asyncio loop on a thread, for the grpc.aio server."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def __call__(self, coro, timeout=30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def loop():
    lp = Loop()
    yield lp
    lp.close()


class Subscriber:
    """A thread reading SubscribeKvEvents into a KvEventIndex (what the router does)."""

    def __init__(self, stub):
        self.index, self.error, self.lock = KvEventIndex(), None, threading.Lock()
        self.call = stub.SubscribeKvEvents(pb.KvEventsRequest(), timeout=120)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            for msg in self.call:
                with self.lock:
                    self.index.apply(msg)
        except Exception as e:  # noqa: BLE001 - an RpcError, or KvEventGap from the index
            self.error = e

    def last_sequence(self):
        with self.lock:
            return self.index.last_sequence

    def wait_for(self, seq, timeout=15.0):
        deadline = time.monotonic() + timeout
        while self.last_sequence() != seq:
            assert self.error is None, f"subscriber failed: {self.error!r}"
            if time.monotonic() > deadline:
                raise AssertionError(f"subscriber stuck at {self.last_sequence()}, engine published {seq}")
            time.sleep(0.01)


def _kv_budget(model_dir, extra_blocks):
    layout = plan_cache_layout(K3Config.from_pretrained(str(model_dir)), torch.float32, BLOCK)
    return (layout.min_blocks_for(MAX_LEN, True) + extra_blocks) * layout.bytes_per_block


def test_subscriber_index_equals_engine_cache(tiny_model_dir, loop):
    torch.set_num_threads(1)
    p = argparse.ArgumentParser()
    worker_cli.configure(p)
    args = p.parse_args([
        "--model", str(tiny_model_dir), "--grpc-port", "0", "--metrics-port", "0", "--enable-prefix-caching",
        "--block-size", str(BLOCK), "--prefix-match-unit", str(UNIT), "--prefix-cache-retention-interval", "16",
        "--max-model-len", str(MAX_LEN), "--kv-cache-memory", str(_kv_budget(tiny_model_dir, 10)),
        "--max-num-batched-tokens", "32", "--dtype", "float32"])
    served = start_engine(args, args.model)
    aeng = served.async_engine
    server = loop(start_grpc_server(aeng, port=0, model_name="tiny"))
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = pb_grpc.WorkerStub(channel)
    rng = random.Random(11)
    base = [rng.randrange(576) for _ in range(40)]

    def generate(i):
        prompt = base[: rng.randint(4, 40)] + [rng.randrange(576) for _ in range(rng.randint(3, 50))]
        sp = dict(max_tokens=rng.randint(1, 6), ignore_eos=True, temperature=rng.choice([0.0, 1.0]), seed=i)
        resps = list(stub.Generate(pb.GenerateRequest(request_id=f"w{i}", prompt_token_ids=prompt,
                                                      sampling_params=sampling_to_proto(sp)), timeout=120))
        return resps[-1].finished, sum(r.cached_tokens > 0 for r in resps[-1:])

    subs = [Subscriber(stub)]
    try:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(generate, range(12)))
            subs.append(Subscriber(stub))  # joins mid-workload: snapshot + live must still line up
            results += list(pool.map(generate, range(12, 24)))
        assert all(done for done, _ in results) and sum(hit for _, hit in results) > 0

        def contents(eng):
            assert not eng.has_unfinished_requests()
            return server.service.kv_events.last_sequence, {
                key: (b.key_tokens[key], b.key_parent.get(key), eng.layout.groups[key[1]].kind)
                for key, b in eng.pool.cached.items()}

        seq, actual = loop(aeng.run_on_engine_thread(contents))
        assert load_to_dict(stub.GetLoad(pb.LoadRequest(), timeout=10))["kv_event_sequence"] == seq
        for s in subs:
            s.wait_for(seq)
        stats = aeng.engine.stats()
    finally:
        for s in subs:
            s.call.cancel()
        channel.close()
        loop(server.stop(0))
        aeng.shutdown()
    for s in subs:
        got = {k: (e["num_tokens"], e["parent_hash"], e["group_kind"]) for k, e in s.index.entries.items()}
        assert got == actual
        assert all(e["block_size"] == BLOCK and len(e["block_hash"]) == 32 for e in s.index.entries.values())
    first = subs[0].index
    assert first.num_removed > 0, "the small KV budget was meant to evict"
    assert {kind for _, _, kind in actual.values()} == {"mla", "kda"}
    assert stats["kda_snapshots_stored"] > 0 and stats["kda_snapshots_evicted"] > 0
    kda_tokens = {n for n, _, kind in actual.values() if kind == "kda"}
    assert kda_tokens and all(n % UNIT == 0 for n in kda_tokens)


class FakeWorker:
    def __init__(self, loop, engine, channel_options=(), **server_kw):
        self.loop, self.engine = loop, engine
        # a failed step is fatal (engine death is what these tests use; containment: test_serve_async_engine)
        self.aeng = AsyncEngine(engine, model_name="fake", idle_wait_s=0.02, max_consecutive_step_failures=0)
        self.aeng.start()

        async def up():
            server = await start_grpc_server(self.aeng, port=0, model_name="fake", **server_kw)
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=list(channel_options))
            return server, channel, pb_grpc.WorkerStub(channel)

        self.server, self.channel, self.stub = loop(up())
        self.hub = self.server.service.kv_events

    def close(self):
        async def down():
            await self.channel.close()
            await self.server.stop(0)

        self.loop(down())
        self.aeng.shutdown()


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return fakes.make_tokenizer(tmp_path_factory.mktemp("tok"))


async def _until(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_slow_subscriber_gets_resource_exhausted(loop, tok):
    # without BDP probing the client's flow-control window stays small, so an unread stream soon blocks
    w = FakeWorker(loop, CacheFake(tok, changes_per_step=(0, 0)), channel_options=[("grpc.http2.bdp_probe", 0)],
                   max_queued_batches=3)

    async def scenario():
        call = w.stub.SubscribeKvEvents(pb.KvEventsRequest())
        snap = await call.read()
        assert snap.snapshot and snap.snapshot_complete and snap.sequence == 0
        batches = 0
        while w.hub.num_subscribers and batches < 400:  # big batches the client does not read: the transport
            await w.aeng.run_on_engine_thread(lambda e: e.mutate(3000))  # buffers fill, then the queue
            batches += 1
            await asyncio.sleep(0)
        await _until(lambda: w.hub.num_subscribers == 0)
        seen = []
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            while (msg := await call.read()) is not grpc.aio.EOF:
                seen.append(msg.sequence)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "re-subscribe" in ei.value.details()
        assert seen == sorted(seen) and seen[-1] < batches * 3000  # dropped before the end
        again = w.stub.SubscribeKvEvents(pb.KvEventsRequest())  # a fresh snapshot of the whole cache
        idx = KvEventIndex()
        while not idx.snapshot_complete:
            idx.apply(await again.read())
        assert idx.tokens() == w.engine.cache_tokens() and idx.last_sequence == w.hub.last_sequence
        again.cancel()

    try:
        loop(scenario(), timeout=60)
    finally:
        w.close()


def test_cancel_unsubscribes_and_dead_engine_is_unavailable(loop, tok):
    w = FakeWorker(loop, CacheFake(tok, fail_on_step=3, changes_per_step=(2, 2)))

    async def scenario():
        calls = [w.stub.SubscribeKvEvents(pb.KvEventsRequest()) for _ in range(2)]
        for c in calls:
            assert (await c.read()).snapshot
        assert w.hub.num_subscribers == 2
        calls[0].cancel()
        await _until(lambda: w.hub.num_subscribers == 1)
        with pytest.raises(grpc.aio.AioRpcError):  # the engine fails on its third step
            async for _ in w.stub.Generate(pb.GenerateRequest(request_id="x", prompt_token_ids=[1],
                                                              sampling_params=sampling_to_proto({"max_tokens": 9}))):
                pass
        live = []
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            while (msg := await calls[1].read()) is not grpc.aio.EOF:
                live.append(msg)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "simulated engine failure" in ei.value.details()
        assert [m.sequence for m in live] == [2, 4]
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await w.stub.SubscribeKvEvents(pb.KvEventsRequest()).read()
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE

    try:
        loop(scenario())
    finally:
        w.close()
