"""KV-event fan-out: the engine's prefix-cache changes, numbered and handed to asyncio subscribers.

    hub = KvEventHub(async_engine)                     # one per AsyncEngine (the gRPC service makes it)
    sub = await hub.subscribe()                        # snapshot + live registration, atomically
    while True:
        batch = await sub.get()                        # KvEventBatchData; raises SubscriberTooSlow / EngineDeadError
    sub.close()

Contract:

* The first batch of a subscription is the snapshot (`snapshot=True`): the cache's contents as "stored"
  events, taken on the engine thread in the same engine-thread call that registers the subscriber, so
  no change is lost or repeated between the snapshot and the live batches. Its `sequence` is the
  number of the last live event it already reflects.
* Live batches hold the events of one engine step (or one batch of engine commands), in order. Events
  are numbered engine-wide from 1 (`hub.last_sequence` is the last published number); a batch's
  `sequence` is the number of its last event, so consecutive batches satisfy
  `batch.sequence - len(batch.events) == previous.sequence`.
* Each subscriber has a bounded queue (`max_queued_batches`). A subscriber that falls that far behind
  is dropped: its queue is discarded and `get()` raises `SubscriberTooSlow`; it must re-subscribe and
  start again from a fresh snapshot.
* If the engine thread ends, or the hub is shut down (`end_all`, e.g. when the worker stops), `get()`
  raises `EngineDeadError` once the queued batches are consumed.
* Threads: the engine's listener and the fan-out run on the engine thread; batches reach each
  subscriber's event loop with `loop.call_soon_threadsafe`. The hub listens to the engine only while
  it has subscribers.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import uuid
from dataclasses import dataclass

from k3serve.workers.async_engine import AsyncEngine, EngineDeadError

log = logging.getLogger(__name__)

DEFAULT_MAX_QUEUED_BATCHES = 1024


class SubscriberTooSlow(RuntimeError):
    """The subscriber's queue overflowed; it was dropped and must re-subscribe."""


@dataclass
class KvEventBatchData:
    """One step's cache changes (or the snapshot). `events`: the engine's KVEvent objects (read-only)."""

    sequence: int
    snapshot: bool
    events: list


def _deliver(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the subscriber's loop is closed
        pass


class KvEventSubscription:
    """One subscriber's bounded queue of batches; consumed on the loop that subscribed."""

    def __init__(self, hub: KvEventHub, loop: asyncio.AbstractEventLoop, max_queued_batches: int):
        if max_queued_batches < 1:
            raise ValueError("max_queued_batches must be at least 1")
        self._hub = hub
        self._loop = loop
        self.max_queued_batches = max_queued_batches
        self._items: collections.deque[KvEventBatchData] = collections.deque()
        self._wake = asyncio.Event()
        self._error: BaseException | None = None
        self.dropped = False  # overflowed (loop thread)
        self.closed = False  # read by the engine thread: no more deliveries wanted

    # --- engine thread ----------------------------------------------------------------------------
    def _offer(self, batch: KvEventBatchData) -> None:
        if not self.closed:
            _deliver(self._loop, self._put, batch)

    def _fail(self, exc: BaseException) -> None:
        _deliver(self._loop, self._set_error, exc)

    # --- loop thread -------------------------------------------------------------------------------
    def _put(self, batch: KvEventBatchData) -> None:
        if self.closed or self.dropped:
            return
        if len(self._items) >= self.max_queued_batches:
            self.dropped = True
            self._items.clear()
            self._hub._detach_soon(self)
        else:
            self._items.append(batch)
        self._wake.set()

    def _set_error(self, exc: BaseException) -> None:
        self._error = exc
        self._wake.set()

    @property
    def queued(self) -> int:
        return len(self._items)

    async def get(self) -> KvEventBatchData:
        """The next batch; raises SubscriberTooSlow once dropped, EngineDeadError after the engine ended."""
        while True:
            if self.dropped:
                raise SubscriberTooSlow(
                    f"KV-event subscriber fell more than {self.max_queued_batches} batches behind; re-subscribe")
            if self._items:
                return self._items.popleft()
            if self._error is not None:
                raise self._error
            if self.closed:
                raise RuntimeError("subscription is closed")
            self._wake.clear()
            await self._wake.wait()

    def close(self) -> None:
        """Stop deliveries and unregister from the hub (idempotent; any thread)."""
        if not self.closed:
            self.closed = True
            self._hub._live.discard(self)
            self._hub._detach_soon(self)


class KvEventHub:
    """Numbers the engine's KV events and fans them out to subscriptions (see the module docstring)."""

    def __init__(self, engine: AsyncEngine, *, max_queued_batches: int = DEFAULT_MAX_QUEUED_BATCHES):
        self.engine = engine
        self.max_queued_batches = max_queued_batches
        self.instance_id = uuid.uuid4().hex
        self.last_sequence = 0  # written on the engine thread only
        self._subs: list[KvEventSubscription] = []  # engine thread only
        self._pending: list = []  # engine thread only
        self._unlisten = None  # engine thread only
        self._live: set[KvEventSubscription] = set()  # open subscriptions (their loops' side)
        self._remove_hook = engine.add_engine_hook(self._flush, self._on_stop)

    @property
    def num_subscribers(self) -> int:
        return len(self._subs)

    async def subscribe(self, max_queued_batches: int | None = None) -> KvEventSubscription:
        """Register a subscriber on the running loop; its first batch is the snapshot.
        Raises EngineDeadError if the engine is not running."""
        sub = KvEventSubscription(self, asyncio.get_running_loop(), max_queued_batches or self.max_queued_batches)
        try:
            await self.engine.run_on_engine_thread(lambda eng: self._attach(eng, sub))
        except BaseException:
            sub.close()
            raise
        if not sub.closed:
            self._live.add(sub)
        return sub

    def end_all(self, reason: str = "the worker is shutting down") -> None:
        """End every open subscription with EngineDeadError(reason) (after its queued batches; any thread)."""
        for sub in list(self._live):
            sub._fail(EngineDeadError(reason))

    def close(self) -> None:
        """Detach from the AsyncEngine (the engine's listener goes with the last subscriber)."""
        self._remove_hook()

    # --- engine thread ------------------------------------------------------------------------------
    def _attach(self, eng, sub: KvEventSubscription) -> None:
        self._flush()  # everything before the snapshot is published under earlier numbers
        if sub.closed:
            return
        if self._unlisten is None:
            self._unlisten = eng.subscribe_kv_events(self._on_event)
        sub._offer(KvEventBatchData(self.last_sequence, True, list(eng.kv_cache_snapshot())))
        self._subs.append(sub)

    def _on_event(self, ev) -> None:
        self._pending.append(ev)

    def _detach_soon(self, sub: KvEventSubscription) -> None:
        self.engine.call_soon_on_engine_thread(lambda _eng: self._detach(sub))

    def _detach(self, sub: KvEventSubscription) -> None:
        if sub in self._subs:
            self._subs.remove(sub)
        if not self._subs and self._unlisten is not None:
            self._flush()
            self._unlisten()
            self._unlisten = None

    def _flush(self) -> None:
        if not self._pending:
            return
        events, self._pending = self._pending, []
        self.last_sequence += len(events)
        batch = KvEventBatchData(self.last_sequence, False, events)
        for sub in self._subs:
            sub._offer(batch)

    def _on_stop(self, exc: BaseException) -> None:
        self._flush()
        for sub in self._subs:
            sub._fail(exc)
        self._subs.clear()


__all__ = ["KvEventHub", "KvEventSubscription", "KvEventBatchData", "SubscriberTooSlow", "EngineDeadError",
           "DEFAULT_MAX_QUEUED_BATCHES"]
