"""The worker registry: which workers exist (static list or Kubernetes discovery), which take requests.

    reg = Registry(index, health_interval=1.0)
    await reg.set_workers({"127.0.0.1:50051": "both"})       # discovery calls this with every change
    reg.candidates("decode")                                  # healthy workers that may take a request
    reg.eject(w, "stream failed")                             # after a failure seen on a request

Per worker, two background tasks on the router's event loop:
* health: `Health` + `GetLoad` every `health_interval` seconds. `eject_after` failures in a row (or one
  failure seen by a request) eject it; a worker that answers SERVING again is reinstated.
* KV events: `SubscribeKvEvents` into the shared `PrefixIndex`; on a gap, a new `instance_id`, a
  RESOURCE_EXHAUSTED or a broken stream, its view is reset and it re-subscribes (a fresh snapshot).
A worker's role comes from discovery (the selector it matched) and is checked against `Health().role`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import grpc

from k3serve.proto import worker_pb2 as pb
from k3serve.proto import worker_pb2_grpc as pb_grpc
from k3serve.router.prefix_index import KvEventGap, PrefixIndex

log = logging.getLogger("k3serve.router.registry")

# gRPC messages of a large snapshot can approach 4 MiB; allow more than the default on the router side
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.enable_retries", 0)]


@dataclass
class Worker:
    address: str
    role: str  # both | prefill | decode
    slot: int
    channel: grpc.aio.Channel
    stub: pb_grpc.WorkerStub
    healthy: bool = False
    ejected_reason: str = "not checked yet"
    failures: int = 0
    load: dict = field(default_factory=dict)
    inflight: int = 0  # requests this router has running on it
    inflight_tokens: int = 0  # uncached prompt tokens of those (prefill work still ahead or under way)
    max_model_len: int = 0
    model: str = ""
    tasks: list[asyncio.Task] = field(default_factory=list)
    last_ok: float = 0.0
    resubscribes: int = 0
    has_store: bool | None = None  # StoreLookup answered NO_STORE: False (no more lookups); None: not asked yet

    @property
    def name(self) -> str:
        return self.address

    def takes(self, role: str) -> bool:
        return self.role == role or self.role == "both"


class Registry:
    def __init__(self, index: PrefixIndex, *, health_interval: float = 1.0, eject_after: int = 2,
                 rpc_timeout: float = 5.0, on_change=None):
        self.index = index
        self.health_interval = health_interval
        self.eject_after = eject_after
        self.rpc_timeout = rpc_timeout
        self.workers: dict[str, Worker] = {}
        self.on_change = on_change or (lambda: None)
        self._closed = False

    # -- membership ----------------------------------------------------------------------------
    async def set_workers(self, wanted: dict[str, str]) -> None:
        """Make the registry hold exactly `wanted` ({address: role}); new ones start unhealthy until checked."""
        for addr in [a for a in self.workers if a not in wanted or self.workers[a].role != wanted[a]]:
            await self._remove(addr)
        for addr, role in wanted.items():
            if addr not in self.workers:
                self._add(addr, role)
        self.on_change()

    def _add(self, addr: str, role: str) -> None:
        channel = grpc.aio.insecure_channel(addr, options=_CHANNEL_OPTIONS)
        w = Worker(addr, role, self.index.add_worker(addr), channel, pb_grpc.WorkerStub(channel))
        self.workers[addr] = w
        w.tasks = [asyncio.ensure_future(self._health_loop(w)), asyncio.ensure_future(self._events_loop(w))]
        log.info("worker %s (%s) added", addr, role)

    async def _remove(self, addr: str) -> None:
        w = self.workers.pop(addr)
        for t in w.tasks:
            t.cancel()
        for t in w.tasks:
            with contextlib.suppress(BaseException):
                await t
        self.index.remove_worker(w.slot)
        await w.channel.close(None)
        log.info("worker %s removed", addr)

    async def close(self) -> None:
        self._closed = True
        for addr in list(self.workers):
            await self._remove(addr)

    # -- selection -----------------------------------------------------------------------------
    def candidates(self, role: str, exclude: set[str] = frozenset()) -> list[Worker]:
        return [w for w in self.workers.values() if w.healthy and w.takes(role) and w.address not in exclude]

    def counts(self) -> dict[str, int]:
        out = {"prefill": 0, "decode": 0, "both": 0}
        for w in self.workers.values():
            if w.healthy:
                out[w.role] = out.get(w.role, 0) + 1
        return out

    def max_model_len(self) -> int:
        lens = [w.max_model_len for w in self.workers.values() if w.max_model_len]
        return min(lens) if lens else 0

    def eject(self, w: Worker, reason: str) -> None:
        if w.healthy:
            log.warning("ejecting worker %s: %s", w.address, reason)
        w.healthy = False
        w.ejected_reason = reason
        self.on_change()

    # -- background loops ----------------------------------------------------------------------
    async def check(self, w: Worker) -> bool:
        """One health check: Health must say SERVING with the expected role, GetLoad must answer."""
        try:
            h = await w.stub.Health(pb.HealthRequest(), timeout=self.rpc_timeout)
            if h.status != pb.HealthResponse.SERVING:
                raise RuntimeError(f"not serving: {h.message}")
            if h.role and w.role != "both" and h.role not in (w.role, "both"):
                raise RuntimeError(f"role {h.role!r}, expected {w.role!r}")
            load = await w.stub.GetLoad(pb.LoadRequest(), timeout=self.rpc_timeout)
        except (grpc.aio.AioRpcError, RuntimeError) as e:
            w.failures += 1
            reason = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
            if w.failures >= self.eject_after or not w.healthy:
                self.eject(w, reason or "health check failed")
            return False
        w.failures = 0
        w.last_ok = time.monotonic()
        w.model, w.max_model_len = load.model or h.model, load.max_model_len
        w.load = {"running": load.running, "waiting": load.waiting, "free_pages": load.free_pages,
                  "total_pages": load.total_pages, "kv_usage": load.kv_usage}
        if not w.healthy:
            w.healthy = True
            w.ejected_reason = ""
            log.info("worker %s (%s) is healthy", w.address, w.role)
            self.on_change()
        return True

    async def _health_loop(self, w: Worker) -> None:
        while True:
            await self.check(w)
            await asyncio.sleep(self.health_interval)

    async def _events_loop(self, w: Worker) -> None:
        backoff = 0.05
        while True:
            call = w.stub.SubscribeKvEvents(pb.KvEventsRequest())
            try:
                async for msg in call:
                    self.index.apply(w.slot, msg)
                    backoff = 0.05
                reason = "stream ended"
            except KvEventGap as e:
                reason = f"gap: {e}"
            except grpc.aio.AioRpcError as e:
                reason = f"{e.code().name}: {e.details()}"
            except asyncio.CancelledError:
                call.cancel()
                raise
            except Exception as e:  # a malformed message: resync rather than die
                reason = f"{type(e).__name__}: {e}"
            call.cancel()
            self.index.reset(w.slot)
            w.resubscribes += 1
            log.info("KV events of %s: %s; re-subscribing", w.address, reason)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)
