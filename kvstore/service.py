"""StoreService: the store as a cache that never slows the engine.

Owns one StoreClient (kvstore/client.py) and runs every store call off the caller's thread, in one
of two *lanes* (a thread each): `lookup` (existence probes, loads into staging; callers wait at
most the deadline) and `save` (puts; callers never wait). A lane whose job overran its deadline is
*busy* until that job returns (a call into a dead master blocks ~4.3 s): new work for it is refused
at once instead of queueing behind it.

Health: a prober thread attaches the client (a worker started while the master is down attaches
when it comes up: a TCP probe first, then one bounded `setup()`), then calls the cheap
`health_check()` every `probe_interval_s`. Any call that returns −900 (RPC failed) marks the store
down at once; the prober marks it up again when `health_check()` answers 0. While it is down or not
attached, `available` is False and callers skip the store (lookups miss, saves are dropped), so a
dead store costs one deadline at most, then nothing, and reuse resumes by itself when it is back
(after a master restart every key is gone: the first requests miss and re-save).

Counters (`stats`, cumulative, plain numbers) feed the worker's metrics (kvstore/connector.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from k3serve.kvstore.client import RPC_FAILED, StoreClient, StoreClosed, StoreNotConnected, code_name

log = logging.getLogger(__name__)


class StoreUnavailable(RuntimeError):
    """The store is down, not attached, or the lane is still busy with an overdue call."""


class DeadlineMissed(RuntimeError):
    pass


class Lane:
    """One worker thread running jobs in order; `submit` returns a Future."""

    def __init__(self, name: str):
        self.name = name
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._running_since: float | None = None
        self.overdue = False  # a waiter gave up on the running job
        self._t = threading.Thread(target=self._loop, name=f"kvstore-{name}", daemon=True)
        self._t.start()

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fut, fn = item
            if not fut.set_running_or_notify_cancel():
                continue
            self._running_since = time.monotonic()
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                fut.set_exception(e)
            finally:
                self._running_since = None
                self.overdue = False

    @property
    def busy(self) -> bool:
        return self.overdue and self._running_since is not None

    def submit(self, fn: Callable) -> Future:
        fut: Future = Future()
        self._q.put((fut, fn))
        return fut

    def stop(self, timeout: float | None = None) -> None:
        self._q.put(None)
        self._t.join(timeout)


class StoreService:
    def __init__(self, client: StoreClient, *, deadline_s: float = 0.05, probe_interval_s: float = 0.5):
        if deadline_s <= 0:
            raise ValueError("kv_store_deadline_ms: must be positive")
        self.client = client
        self.deadline_s = deadline_s
        self.probe_interval_s = probe_interval_s
        self.lookup_lane = Lane("lookup")
        self.save_lane = Lane("save")
        self._healthy = False
        self._stop = threading.Event()
        self._prober: threading.Thread | None = None
        self.on_attach: list[Callable[[], None]] = []  # called (prober thread) after each (re)attach
        self.on_down: list[Callable[[], None]] = []  # called when the store is marked down
        self.attached_once = threading.Event()
        self._lock = threading.Lock()
        self.stats: dict[str, float] = {"deadline_misses_lookup": 0, "deadline_misses_load": 0,
                                        "unavailable": 0, "healthy": 0, "attaches": 0,
                                        "wait_max_s": 0.0}  # longest a caller waited on one call
        self.failures: dict[tuple[str, str], int] = {}  # (op, code name) -> count

    # -- lifetime -------------------------------------------------------------------------------
    def start(self) -> StoreService:
        self._prober = threading.Thread(target=self._probe_loop, name="kvstore-probe", daemon=True)
        self._prober.start()
        return self

    def close(self) -> None:
        """Stop probing and the lanes, then close the client (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._prober is not None:
            self._prober.join(10)
        self.lookup_lane.stop(10)
        self.save_lane.stop(10)
        self.client.close()  # waits for calls still in flight, then closes the native client

    def _probe_loop(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.client.connected:
                    if self.client.connect():
                        self.stats["attaches"] += 1
                        log.info("kv store: attached to %s", self.client.master)
                        for fn in self.on_attach:
                            fn()
                        self._set_healthy(True)
                        self.attached_once.set()
                else:
                    self._set_healthy(self.client.health() == 0)
            except StoreClosed:
                return
            except Exception as e:  # noqa: BLE001 - the prober must never die
                log.warning("kv store: probe failed: %s", e)
                self._set_healthy(False)
            self._stop.wait(self.probe_interval_s)

    def _set_healthy(self, ok: bool) -> None:
        with self._lock:
            was, self._healthy = self._healthy, ok
            self.stats["healthy"] = 1.0 if ok else 0.0
        if was and not ok:
            log.warning("kv store: %s is down; requests recompute until it is back", self.client.master)
            for fn in self.on_down:
                fn()
        elif ok and not was:
            log.info("kv store: %s is healthy", self.client.master)

    @property
    def available(self) -> bool:
        return self._healthy and self.client.connected

    def wait_available(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.available:
                return True
            time.sleep(0.02)
        return self.available

    # -- calls ----------------------------------------------------------------------------------
    def note_codes(self, op: str, codes: list[int]) -> None:
        """Count failures by code; an RPC failure marks the store down at once."""
        down = False
        for c in codes:
            if c < 0:
                key = (op, code_name(c))
                self.failures[key] = self.failures.get(key, 0) + 1
                down = down or c == RPC_FAILED
        if down:
            self._set_healthy(False)

    def call(self, fn: Callable, *, op: str, deadline_s: float | None = None):
        """Run `fn()` on the lookup lane; wait at most the deadline. Raises StoreUnavailable (skipped
        at once) or DeadlineMissed (the job keeps running; the lane stays busy until it returns)."""
        lane = self.lookup_lane
        if not self.available or lane.busy:
            self.stats["unavailable"] += 1
            raise StoreUnavailable("kv store unavailable")
        fut = lane.submit(lambda: self._guarded(fn, op))
        t0 = time.monotonic()
        try:
            return fut.result(timeout=self.deadline_s if deadline_s is None else deadline_s)
        except FutureTimeout:
            lane.overdue = True
            self.stats[f"deadline_misses_{op}"] = self.stats.get(f"deadline_misses_{op}", 0) + 1
            raise DeadlineMissed(f"kv store {op}: no answer within the deadline") from None
        finally:
            waited = time.monotonic() - t0
            if waited > self.stats["wait_max_s"]:
                self.stats["wait_max_s"] = waited

    def submit_save(self, fn: Callable[[], None]) -> bool:
        """Queue a put job (never waits). False (dropped) when the store is unavailable."""
        if not self.available or self.save_lane.busy:
            self.stats["unavailable"] += 1
            return False
        self.save_lane.submit(lambda: self._guarded(fn, "put"))
        return True

    def _guarded(self, fn: Callable, op: str):
        try:
            return fn()
        except (StoreClosed, StoreNotConnected) as e:
            raise StoreUnavailable(str(e)) from None
