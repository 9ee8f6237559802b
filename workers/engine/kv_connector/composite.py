"""Composition of connectors: ordered cache tiers plus at most one transfer (P/D) connector.

Lookup for a new request: the transfer connector is asked first; when it supplies tokens (the
request carries its `kv_transfer_params`) or asks to be asked later, it decides alone. Otherwise
every tier reports its usable hit past the block-aligned local hit and the longest wins; ties go
to the earlier (cheaper) tier. Any tier answering "ask again later" makes the whole answer "ask
again later" (a tier bounds its own wait with a deadline). Only the chosen connector gets a
nonzero `num_external_tokens` in `update_state_after_alloc`.

Delayed frees: a request's pages are released once every child that delayed its free has listed
it in `finished_sending` (the composite rewrites the aggregated output accordingly).
"""

from __future__ import annotations

from dataclasses import replace

from k3serve.workers.engine.kv_connector.base import (
    NO_MATCH,
    BlockIds,
    BoundarySnapshot,
    ConnectorContext,
    ConnectorKind,
    EvictedBlock,
    FinishResult,
    KVConnector,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
    LoadSpec,
    MatchResult,
)


class CompositeScheduler(KVConnectorScheduler):
    name = "composite"

    def __init__(self, ctx: ConnectorContext, children: list[KVConnectorScheduler]):
        self._device_cache = None
        super().__init__(ctx)
        transfers = [c for c in children if c.kind is ConnectorKind.TRANSFER]
        if len(transfers) > 1:
            raise ValueError("kv_connectors: at most one transfer (P/D) connector per engine, got "
                             + ", ".join(c.name for c in transfers))
        self.transfer = transfers[0] if transfers else None
        self.tiers = [c for c in children if c.kind is ConnectorKind.TIER]
        self.children = ([self.transfer] if self.transfer else []) + self.tiers
        self.device_cache = self._device_cache  # hand a view bound earlier to the children
        self.wants_blocks_stored = any(c.wants_blocks_stored for c in self.children)
        self._chosen: dict[str, int] = {}  # request id -> index into children (last lookup)
        self._pending_free: dict[str, set[int]] = {}  # request id -> children still sending
        self._worker_stats: dict[str, float] = {}  # the worker halves' latest counters, prefixed

    @property
    def device_cache(self):
        return self._device_cache

    @device_cache.setter
    def device_cache(self, view) -> None:
        self._device_cache = view
        for c in getattr(self, "children", ()):
            c.device_cache = view

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> MatchResult:
        self._chosen.pop(request.request_id, None)
        if self.transfer is not None:
            m = self.transfer.get_num_new_matched_tokens(request, num_computed_tokens)
            if m.num_tokens is None or m.num_tokens > 0:
                self._chosen[request.request_id] = 0
                return m
        off = 1 if self.transfer is not None else 0
        best, best_i = NO_MATCH, -1
        for i, tier in enumerate(self.tiers):
            m = tier.get_num_new_matched_tokens(request, num_computed_tokens)
            if m.num_tokens is None:
                return m
            if m.num_tokens > (best.num_tokens or 0):
                best, best_i = m, i + off
        if best_i >= 0:
            self._chosen[request.request_id] = best_i
        return best

    def update_state_after_alloc(self, request, spec: LoadSpec) -> None:
        chosen = self._chosen.pop(request.request_id, -1) if spec.num_external_tokens else -1
        for i, c in enumerate(self.children):
            c.update_state_after_alloc(request, spec if i == chosen else replace(spec, num_external_tokens=0))

    def build_connector_meta(self, step: int) -> KVConnectorMetadata:
        return KVConnectorMetadata(step=step, data=[c.build_connector_meta(step) for c in self.children])

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        parts = output.parts or [KVConnectorOutput() for _ in self.children]
        done: set[str] = set()
        for i, (c, part) in enumerate(zip(self.children, parts)):
            c.update_connector_output(part)
            for k, v in part.stats.items():
                self._worker_stats[c.stats_prefix + k] = v
            for rid in part.finished_sending:
                waiting = self._pending_free.get(rid)
                if waiting is not None:
                    waiting.discard(i)
                    if not waiting:
                        done.add(rid)
        for rid in done:
            self._pending_free.pop(rid, None)
        output.finished_sending = done

    def on_block_evicted(self, block: EvictedBlock) -> None:
        for c in self.children:
            c.on_block_evicted(block)

    def on_boundary_snapshot(self, snap: BoundarySnapshot, request) -> None:
        for c in self.children:
            c.on_boundary_snapshot(snap, request)

    def on_blocks_stored(self, request, keys) -> None:
        for c in self.children:
            if c.wants_blocks_stored:
                c.on_blocks_stored(request, keys)

    def request_finished(self, request, block_ids: BlockIds) -> FinishResult:
        delayed: set[int] = set()
        params: dict | None = None
        expiry = 0.0
        for i, c in enumerate(self.children):
            r = c.request_finished(request, block_ids)
            if r.delay_free:
                delayed.add(i)
                expiry = max(expiry, r.expiry_s)
            if r.transfer_params:
                params = {**(params or {}), **r.transfer_params}
        self._chosen.pop(request.request_id, None)
        if delayed:
            self._pending_free[request.request_id] = delayed
            return FinishResult(True, params, expiry)
        return FinishResult(False, params)

    def forget(self, request_id: str) -> None:
        """The scheduler freed `request_id` (confirmation or expiry): drop its pending state."""
        self._pending_free.pop(request_id, None)

    def take_hold_requests(self) -> list[int]:
        return [b for c in self.children for b in c.take_hold_requests()]

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = dict(self._worker_stats)
        for c in self.children:
            out.update({c.stats_prefix + k: v for k, v in c.stats().items()})
        return out


class CompositeWorker(KVConnectorWorker):
    def __init__(self, ctx: ConnectorContext, children: list[KVConnectorWorker]):
        super().__init__(ctx)
        self.children = children

    def register_kv_caches(self, kv) -> None:
        super().register_kv_caches(kv)
        for c in self.children:
            c.register_kv_caches(kv)

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        for c, m in zip(self.children, meta.data):
            c.start_load_kv(m)

    def wait_for_layer_load(self, layer_id: int) -> None:
        for c in self.children:
            c.wait_for_layer_load(layer_id)

    def wait_for_load(self) -> None:
        for c in self.children:
            c.wait_for_load()

    def save_kv(self, meta: KVConnectorMetadata) -> None:
        for c, m in zip(self.children, meta.data):
            c.save_kv(m)

    def get_finished(self) -> KVConnectorOutput:
        out = KVConnectorOutput()
        for c in self.children:
            part = c.get_finished()
            out.parts.append(part)
            out.finished_recving |= part.finished_recving
            out.failed_recving |= part.failed_recving
            out.released_blocks.extend(part.released_blocks)
        return out

    def shutdown(self) -> None:
        for c in self.children:
            c.shutdown()


def compose(ctx: ConnectorContext, connectors: list[KVConnector]) -> KVConnector:
    """One connector the engine drives, from the ordered list (transfer connector moved first)."""
    sched = CompositeScheduler(ctx, [c.scheduler for c in connectors])
    by_sched = {id(c.scheduler): c.worker for c in connectors}
    worker = CompositeWorker(ctx, [by_sched[id(s)] for s in sched.children])
    return KVConnector(sched, worker)
