"""KvEventHub over AsyncEngine with a scripted cache (no gRPC): snapshot + live consistency under load,
sequence numbering, slow-subscriber drop, unsubscribe, engine death; engine-thread calls and hooks;
the proto conversions and KvEventIndex. The real engine over gRPC is in test_kv_events_grpc.py."""

import asyncio
import threading
import time

import _serve_fakes as fakes  # tests/ is on sys.path (conftest)
import pytest
from _kv_event_fakes import CacheFake

from k3serve.kv_events.index import KvEventGap, KvEventIndex
from k3serve.kv_events.types import KVEvent
from k3serve.proto import worker_pb2 as pb
from k3serve.proto.convert import kv_batch_to_proto, kv_event_from_proto, kv_event_to_proto
from k3serve.sampling_params import SamplingParams
from k3serve.workers.async_engine import AsyncEngine, EngineDeadError
from k3serve.workers.kv_events import KvEventHub, SubscriberTooSlow


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return fakes.make_tokenizer(tmp_path_factory.mktemp("tok"))


def run(coro, timeout=30):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def started(engine):
    # any failed step is fatal here: these tests are about engine death (containment: test_serve_async_engine)
    aeng = AsyncEngine(engine, model_name="m", idle_wait_s=0.02, max_consecutive_step_failures=0)
    aeng.start()
    return aeng


async def wait_until(pred, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


class Consumer:
    """Reads a subscription into a KvEventIndex through the proto conversion (as a gRPC client would)."""

    def __init__(self, sub, instance_id, max_events=3):
        self.sub, self.index, self.batches = sub, KvEventIndex(), []
        self.task = asyncio.ensure_future(self._run(instance_id, max_events))

    async def _run(self, instance_id, max_events):
        while True:
            b = await self.sub.get()
            self.batches.append(b)
            for msg in kv_batch_to_proto(b.sequence, b.snapshot, b.events, instance_id, max_events):
                self.index.apply(msg)


async def settle(aeng, hub, consumers):
    """Wait for the engine to go idle, then until every consumer has the last published event; returns the
    engine's cache contents read on the engine thread."""
    while True:
        busy, seq, cache = await aeng.run_on_engine_thread(
            lambda e: (e.has_unfinished_requests(), hub.last_sequence, e.cache_tokens()))
        if not busy:
            break
        await asyncio.sleep(0.01)
    def caught_up():
        for c in consumers:
            if c.task.done():  # a consumer only ends on an error, e.g. KvEventGap
                c.task.result()
        return all(c.index.last_sequence == seq for c in consumers)

    await wait_until(caught_up, what="the last event")
    return seq, cache


def test_snapshot_and_live_stream_match_the_cache_under_load(tok):
    engine = CacheFake(tok, seed=3, step_delay=0.004)
    aeng = started(engine)
    hub = KvEventHub(aeng)

    async def go():
        gens = []
        sp = SamplingParams(max_tokens=20, ignore_eos=True)

        async def drive(rid):
            return [o async for o in aeng.generate(rid, [1, 2, 3], sp)]

        consumers = []
        for k in range(3):  # subscribers join while steps are changing the cache
            gens += [asyncio.ensure_future(drive(f"r{k}-{j}")) for j in range(3)]
            await wait_until(lambda n=engine.steps: engine.steps >= n + 3, what="engine steps")
            consumers.append(Consumer(await hub.subscribe(), hub.instance_id))
        await asyncio.gather(*gens)
        seq, cache = await settle(aeng, hub, consumers)
        for c in consumers:
            c.task.cancel()
        return seq, cache, consumers

    try:
        seq, cache, consumers = run(go())
    finally:
        aeng.shutdown()
    assert 0 < seq < engine.num_events  # counted from the first subscription on
    assert consumers[0].batches[0].sequence == 0 and sum(len(b.events) for b in consumers[0].batches[1:]) == seq
    assert consumers[-1].batches[0].snapshot and consumers[-1].batches[0].events, "late joiner gets a snapshot"
    for c in consumers:
        assert c.index.tokens() == cache
        assert c.batches[0].snapshot and not any(b.snapshot for b in c.batches[1:])
        live = [b.sequence for b in c.batches[1:]]
        assert live == sorted(set(live)) and live[-1] == seq
    assert consumers[0].index.num_removed > 0 and consumers[0].index.group_kinds_seen == {"mla", "kda"}


def test_slow_subscriber_is_dropped_and_others_continue(tok):
    engine = CacheFake(tok, seed=1)
    aeng = started(engine)
    hub = KvEventHub(aeng, max_queued_batches=64)

    async def go():
        slow = await hub.subscribe(max_queued_batches=2)  # never read until it overflows
        fast = Consumer(await hub.subscribe(), hub.instance_id)
        # mutate until the slow subscriber overflows: calls that the engine thread runs back to back may share
        # one batch, so how many calls overflow a queue of 2 depends on the machine's load
        calls = 0
        deadline = time.monotonic() + 10
        while not slow.dropped and time.monotonic() < deadline:
            await aeng.run_on_engine_thread(lambda e: e.mutate(2))
            calls += 1
            await asyncio.sleep(0.01)  # the loop thread takes the delivered batches
        await wait_until(lambda: slow.dropped, what="the drop")
        assert calls >= 2  # the snapshot plus at least two batches fill a queue of 2 and overflow it
        with pytest.raises(SubscriberTooSlow, match="re-subscribe"):
            await slow.get()
        await wait_until(lambda: hub.num_subscribers == 1, what="the slow subscriber's removal")
        seq, cache = await settle(aeng, hub, [fast])
        again = Consumer(await hub.subscribe(max_queued_batches=2), hub.instance_id)  # fresh snapshot
        await wait_until(lambda: again.index.snapshot_complete, what="the new snapshot")
        fast.task.cancel()
        again.task.cancel()
        return seq, cache, fast, again, calls

    try:
        seq, cache, fast, again, calls = run(go())
    finally:
        aeng.shutdown()
    assert seq == 2 * calls and fast.index.tokens() == cache
    assert again.index.tokens() == cache and again.index.last_sequence == seq


def test_close_unsubscribes_from_the_engine(tok):
    engine = CacheFake(tok)
    aeng = started(engine)
    hub = KvEventHub(aeng)

    async def go():
        a, b = await hub.subscribe(), await hub.subscribe()
        assert hub.num_subscribers == 2 and len(engine.listeners) == 1  # one engine listener per hub
        a.close()
        await wait_until(lambda: hub.num_subscribers == 1, what="unsubscribe")
        await aeng.run_on_engine_thread(lambda e: e.mutate(3))
        first = await b.get()
        assert first.snapshot and first.sequence == 0 and first.events == []
        live = await b.get()
        assert live.sequence == 3 and len(live.events) == 3 and live.events[0].kind == "stored"
        b.close()
        await wait_until(lambda: hub.num_subscribers == 0, what="unsubscribe")
        assert await aeng.run_on_engine_thread(lambda e: len(e.listeners)) == 0

    try:
        run(go())
    finally:
        aeng.shutdown()


def test_end_all_ends_open_subscriptions_after_their_queue(tok):
    engine = CacheFake(tok)
    aeng = started(engine)
    hub = KvEventHub(aeng)

    async def go():
        sub = await hub.subscribe()
        await aeng.run_on_engine_thread(lambda e: e.mutate(2))
        await wait_until(lambda: sub.queued == 2, what="two batches")
        hub.end_all("worker stopping")
        assert (await sub.get()).snapshot and (await sub.get()).sequence == 2
        with pytest.raises(EngineDeadError, match="worker stopping"):
            await sub.get()

    try:
        run(go())
    finally:
        aeng.shutdown()


def test_engine_death_ends_the_subscription(tok):
    engine = CacheFake(tok, fail_on_step=4, changes_per_step=(1, 1))
    aeng = started(engine)
    hub = KvEventHub(aeng)

    async def go():
        sub = await hub.subscribe()
        with pytest.raises(EngineDeadError):
            async for _ in aeng.generate("x", [1], SamplingParams(max_tokens=50, ignore_eos=True)):
                pass
        got = []
        with pytest.raises(EngineDeadError, match="simulated engine failure"):
            while True:
                got.append(await sub.get())
        assert got[0].snapshot and got[-1].sequence == 3  # three steps changed the cache before the failure
        with pytest.raises(EngineDeadError):
            await hub.subscribe()

    try:
        run(go())
    finally:
        aeng.shutdown()


def test_engine_thread_calls_and_hooks(tok):
    engine = fakes.FakeEngine(tok)
    aeng = started(engine)
    seen, stopped = [], []
    remove = aeng.add_engine_hook(lambda: seen.append(threading.get_ident()), stopped.append)

    async def go():
        tid = await aeng.run_on_engine_thread(lambda e: (threading.get_ident(), e is engine))
        assert tid == (aeng._thread.ident, True) and tid[0] != threading.get_ident()
        with pytest.raises(ZeroDivisionError):
            await aeng.run_on_engine_thread(lambda e: 1 / 0)
        assert aeng.is_healthy()  # a failing call does not hurt the engine
        await wait_until(lambda: seen, what="a hook run")
        assert set(seen) == {aeng._thread.ident}
        remove()
        n = len(seen)
        await aeng.run_on_engine_thread(lambda e: None)
        assert len(seen) == n
        aeng.shutdown()
        with pytest.raises(EngineDeadError):
            await aeng.run_on_engine_thread(lambda e: None)

    run(go())
    assert stopped == []  # removed before the engine stopped
    aeng2 = started(fakes.FakeEngine(tok))
    aeng2.add_engine_hook(lambda: None, stopped.append)
    aeng2.shutdown()
    assert len(stopped) == 1 and isinstance(stopped[0], EngineDeadError)


def _ev(i, kind="stored", parent=True, group=0):
    return KVEvent(kind, bytes([i]) * 32, bytes([i - 1]) * 32 if parent else None, group,
                   "mla" if group == 0 else "kda", 16 * i, 16)


def test_event_proto_roundtrip_and_chunking():
    for ev in (_ev(3), _ev(1, "removed", parent=False, group=1)):
        back = kv_event_from_proto(pb.KvEvent.FromString(kv_event_to_proto(ev).SerializeToString()))
        assert back == ev.__dict__
    with pytest.raises(ValueError, match="kind"):
        kv_event_to_proto(KVEvent("evicted", b"x" * 32, None, 0, "mla", 1, 16))
    live = kv_batch_to_proto(17, False, [_ev(i) for i in range(1, 6)], "inst", max_events=2)
    assert [(m.sequence, len(m.events), m.snapshot) for m in live] == [(14, 2, False), (16, 2, False), (17, 1, False)]
    snap = kv_batch_to_proto(9, True, [_ev(i) for i in range(1, 4)], "inst", max_events=2)
    assert [(m.sequence, len(m.events), m.snapshot, m.snapshot_complete) for m in snap] == \
        [(9, 2, True, False), (9, 1, True, True)]
    (empty,) = kv_batch_to_proto(0, True, [], "inst")
    assert empty.snapshot and empty.snapshot_complete and not empty.events


def test_index_detects_gaps_and_restarts():
    idx = KvEventIndex()
    with pytest.raises(KvEventGap):
        idx.apply(kv_batch_to_proto(1, False, [_ev(1)], "a")[0])
    for m in kv_batch_to_proto(2, True, [_ev(1), _ev(2)], "a", max_events=1):
        idx.apply(m)
    for m in kv_batch_to_proto(4, False, [_ev(3), _ev(1, "removed")], "a", max_events=1):
        idx.apply(m)
    assert set(idx.tokens()) == {(bytes([2]) * 32, 0), (bytes([3]) * 32, 0)} and idx.last_sequence == 4
    with pytest.raises(KvEventGap, match="after 4"):
        idx.apply(kv_batch_to_proto(6, False, [_ev(5)], "a")[0])  # event 5 was lost
    with pytest.raises(KvEventGap, match="instance"):
        idx.apply(kv_batch_to_proto(5, False, [_ev(5)], "b")[0])
    idx.apply(kv_batch_to_proto(0, True, [_ev(7)], "b")[0])  # a fresh subscription resets the index
    assert list(idx.tokens()) == [(bytes([7]) * 32, 0)] and idx.instance_id == "b"
