"""The host-memory offload tier: a second cache level in host RAM, through the connector API.

`--kv-offload-memory SIZE` (EngineArgs.kv_offload_memory; needs prefix caching). Copy-on-evict:
when the device pool reuses a cached page (an MLA page or a KDA snapshot), the scheduler half
(`HostOffloadScheduler.on_block_evicted`) gives it a host slot in a host pool — a `BlockPool` with
the same keys and the same eviction policy as the device pool — and the worker half copies the page
out before the step's forward pass overwrites it. On admission the tier reports its joint hit at
hash-unit precision past the block-aligned local hit: host MLA pages for every block from there,
plus a KDA snapshot present in every KDA group at the hit's end. If that is longer than the local
hit (reconciled by the scheduler, design doc §4.2), only the tokens past the aligned local hit are
loaded, synchronously, into fresh device pages (MLA) and the running state block (KDA), before the
step's page copies and forward pass.

On CUDA the host pool is pinned memory and both directions run as non-blocking copies on a side
stream; the compute stream waits on an event only before the forward pass that needs them. On CPU
the copies are plain tensor copies (the same code path apart from streams), so CI tests it.

Counters (LLMEngine.stats() keys, `k3serve_kv_offload_*` metrics): kv_offload_hit_tokens,
kv_offload_stored_blocks, kv_offload_stored_bytes, kv_offload_loaded_bytes, kv_offload_evictions,
kv_offload_failed_loads, kv_offload_usage (fraction of host slots holding cached pages).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from k3serve.common.sizes import format_size
from k3serve.workers.engine.kv_cache.block_pool import Block, BlockPool
from k3serve.workers.engine.kv_cache.eviction import ComputePerByteScorer, make_scorer
from k3serve.workers.engine.kv_connector.base import (
    NO_MATCH,
    ConnectorContext,
    ConnectorKind,
    EvictedBlock,
    KVConnector,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
    LoadSpec,
    MatchResult,
)

log = logging.getLogger(__name__)


def host_slots_for(budget: int, layout) -> int:
    """Host slots a budget of `budget` bytes holds (one slot = one block at every layer position);
    ValueError naming the minimum when it holds none."""
    per = layout.bytes_per_block
    n = int(budget) // per
    if n < 1:
        raise ValueError(f"kv_offload_memory: {format_size(int(budget))} is smaller than one page; the minimum is "
                         f"{per} bytes ({format_size(per)}: {layout.page_bytes} bytes x {layout.group_size} layers)")
    return n


@dataclass
class _Lookup:
    tokens: int  # the tier's hit (absolute tokens)
    start: int  # block-aligned start of the load
    mla_slots: list[list[tuple[bool, Block]]]  # [block index from start][MLA group]: (on device, block)
    kda_slots: list[tuple[bool, Block]] | None  # per KDA group
    mla_hashes: list[bytes]  # the key hash of each loaded block (its end, clipped to the hit)
    kda_hash: bytes | None


@dataclass
class HostOffloadMeta(KVConnectorMetadata):
    saves: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot), pre-step
    loads: list[tuple[str, int, int]] = field(default_factory=list)  # ("h" slot | "d" device block, id, dst)
    load_requests: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)  # loads that could not be planned


class HostOffloadScheduler(KVConnectorScheduler):
    kind = ConnectorKind.TIER
    name = "host-offload"
    stats_prefix = "kv_offload_"

    def __init__(self, ctx: ConnectorContext, num_slots: int, eviction: str = "lru"):
        super().__init__(ctx)
        if not ctx.enable_prefix_caching:
            raise ValueError("kv_offload_memory: the host tier keeps evicted prefix-cache pages; it needs "
                             "enable_prefix_caching")
        lay = ctx.layout
        scorer = make_scorer(eviction)
        if isinstance(scorer, ComputePerByteScorer):
            scorer.set_state_groups({g.group_id for g in lay.kda_groups})
        self.host = BlockPool(num_slots + 1, eviction=scorer, block_size=lay.block_size)  # slot 0 unused
        self.num_slots = num_slots
        self.B = lay.block_size
        self.unit = ctx.hash_unit
        self.mla_gids = [g.group_id for g in lay.mla_groups]
        self.kda_gids = [g.group_id for g in lay.kda_groups]
        self._lookups: dict[str, _Lookup] = {}
        self._saves: list[tuple[int, int]] = []
        self._loads: list[tuple[int, int]] = []
        self._load_reqs: list[str] = []
        self._failed_reqs: list[str] = []
        self._pinned: list[Block] = []  # host slots referenced until this step's copies ran
        self.hit_tokens = 0
        self.stored_blocks = 0
        self.skipped_saves = 0
        self.failed_loads = 0

    # -- copy-on-evict -------------------------------------------------------------------------
    def on_block_evicted(self, block: EvictedBlock) -> None:
        host = self.host
        if all((k.block_hash, k.group_id) in host.cached for k in block.keys):
            return  # the host tier holds this content already
        if host.num_free == 0:
            self.skipped_saves += 1  # every slot is being loaded from or saved to this step
            return
        slot = host.allocate(1)[0]
        for k in block.keys:
            host.register(slot, (k.block_hash, k.group_id), k.num_tokens, 0, k.parent_hash)
        self._saves.append((block.block_id, slot.block_id))
        self._pinned.append(slot)
        self.stored_blocks += 1

    # -- lookup --------------------------------------------------------------------------------
    def _hash_at(self, req, p: int) -> bytes | None:
        i = p // self.unit - 1
        hs = req.unit_hashes
        return hs[i] if 0 <= i < len(hs) and p % self.unit == 0 else None

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> MatchResult:
        self._drop_lookup(request.request_id)
        found = self._find(request, num_computed_tokens)
        if found is None or found.tokens <= num_computed_tokens:
            return NO_MATCH
        # pin the slots until the allocation decision (the allocation itself may evict device pages
        # into this host pool, which must not take these slots)
        self.host.touch(self._host_blocks(found))
        self._lookups[request.request_id] = found
        return MatchResult(found.tokens - num_computed_tokens, is_async=False)

    def _get(self, key) -> tuple[bool, Block] | None:
        """(on_device, block) holding `key`: a device-resident page first, else a host slot."""
        dev = self.device_cache
        b = dev.get(key) if dev is not None else None
        if b is not None:
            return True, b
        b = self.host.cached.get(key)
        return (False, b) if b is not None else None

    def _find(self, req, start: int) -> _Lookup | None:
        B, u = self.B, self.unit
        max_len = req.num_tokens - 1
        full: list[list] = []
        mla_hit = start
        partial = None
        if self.mla_gids:
            while start + (len(full) + 1) * B <= max_len:
                h = self._hash_at(req, start + (len(full) + 1) * B)
                blks = [self._get((h, g)) for g in self.mla_gids] if h else [None]
                if any(b is None for b in blks):
                    break
                full.append(blks)
            mla_hit = start + len(full) * B
            if u < B:
                for k in range(B // u - 1, 0, -1):
                    p = mla_hit + k * u
                    h = self._hash_at(req, p) if p <= max_len else None
                    if h is None:
                        continue
                    blks = [self._get((h, g)) for g in self.mla_gids]
                    if all(b is not None for b in blks):
                        partial, mla_hit = blks, p
                        break
        else:
            mla_hit = min(max_len // u, len(req.unit_hashes)) * u
        hit, kda = mla_hit, None
        if self.kda_gids:
            hit = 0
            p = mla_hit // u * u
            while p > start:
                h = self._hash_at(req, p)
                if h is not None:
                    blks = [self._get((h, g)) for g in self.kda_gids]
                    if all(b is not None and b[1].key_tokens.get((h, g)) == p for b, g in zip(blks, self.kda_gids)):
                        hit, kda = p, blks
                        break
                p -= u
        if hit <= start:
            return None
        nblk = -(-(hit - start) // B) if self.mla_gids else 0
        hashes = [self._hash_at(req, start + (j + 1) * B) if j < len(full) else self._hash_at(req, mla_hit)
                  for j in range(nblk)]
        mla = full[:nblk]
        if len(mla) < nblk:
            mla.append(partial)
        if all(on_dev for blks in mla for on_dev, _b in blks) and all(on_dev for on_dev, _b in (kda or [])):
            return None  # nothing from the host: the device's own lookup covers it
        return _Lookup(hit, start, mla, kda, hashes, self._hash_at(req, hit))

    def _host_blocks(self, found: _Lookup) -> list[Block]:
        return [b for blks in found.mla_slots for on_dev, b in blks if not on_dev] + [
            b for on_dev, b in (found.kda_slots or []) if not on_dev]

    def _drop_lookup(self, rid: str) -> None:
        old = self._lookups.pop(rid, None)
        if old is not None:
            self.host.free_blocks(self._host_blocks(old))

    def update_state_after_alloc(self, request, spec: LoadSpec) -> None:
        found = self._lookups.pop(request.request_id, None)
        if found is None:
            return
        slots = self._host_blocks(found)
        if spec.num_external_tokens == 0:
            self.host.free_blocks(slots)
            return
        assert spec.num_local_tokens == found.start and spec.num_local_tokens + spec.num_external_tokens == found.tokens
        lay = self.ctx.layout
        ok = True

        def source(entry, key):
            nonlocal ok
            on_dev, b = entry
            if not on_dev:
                return ("h", b.block_id)
            if self.device_cache.get(key) is b:
                return ("d", b.block_id)  # still cached on the device (its bytes are intact this step)
            hb = self.host.cached.get(key)  # evicted by this very admission: copied to the host first
            if hb is None:
                ok = False
                return ("h", 0)
            return ("h", hb.block_id)

        loads: list[tuple[str, int, int]] = []
        for gi, gid in enumerate(self.mla_gids):
            dst = spec.load_block_ids(lay, gid)
            for j, d in enumerate(dst):
                loads.append((*source(found.mla_slots[j][gi], (found.mla_hashes[j], gid)), d))
        for gi, gid in enumerate(self.kda_gids):
            loads.append((*source(found.kda_slots[gi], (found.kda_hash, gid)), spec.block_ids[gid][0]))
        if ok:
            self._loads.extend(loads)
            self._load_reqs.append(request.request_id)
        else:
            self._failed_reqs.append(request.request_id)
        self._pinned.extend(slots)  # already referenced by the lookup; released after the step
        self.hit_tokens += spec.num_external_tokens

    # -- per step ------------------------------------------------------------------------------
    def build_connector_meta(self, step: int) -> KVConnectorMetadata:
        for rid in list(self._lookups):  # lookups the scheduler did not act on this step
            self._drop_lookup(rid)
        meta = HostOffloadMeta(step=step, saves=self._saves, loads=self._loads, load_requests=self._load_reqs,
                               failed_requests=self._failed_reqs)
        self._saves, self._loads, self._load_reqs, self._failed_reqs = [], [], [], []
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        pinned, self._pinned = self._pinned, []
        self.host.free_blocks(pinned)
        self.failed_loads += len(output.failed_recving)

    def stats(self) -> dict[str, float]:
        h = self.host
        return dict(hit_tokens=self.hit_tokens, stored_blocks=self.stored_blocks, evictions=h.stats.evicted,
                    usage=len({id(b) for b in h.cached.values()}) / self.num_slots, failed_loads=self.failed_loads)


class HostOffloadWorker(KVConnectorWorker):
    def __init__(self, ctx: ConnectorContext, num_slots: int):
        super().__init__(ctx)
        lay = ctx.layout
        self.num_slots = num_slots
        self.device = torch.device(ctx.device)
        self.cuda = self.device.type == "cuda"
        self.host = torch.zeros(num_slots + 1, lay.group_size, lay.page_bytes, dtype=torch.uint8,
                                pin_memory=self.cuda)
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.page_bytes = lay.bytes_per_block
        self.bytes_stored = 0
        self.bytes_loaded = 0
        self.bytes_copied_on_device = 0  # device-resident pages a tier hit reused (copied d2d)
        self.fail_next_loads = 0  # fault injection (tests): the next that many steps' loads fail
        self._failed: set[str] = set()
        self._staged: list = []  # CUDA: (host slots, pinned buffers per layer position) not yet committed

    def start_load_kv(self, meta: HostOffloadMeta) -> None:
        self._failed.update(meta.failed_requests)
        if not meta.saves and not meta.loads:
            return
        if self.cuda:
            self._start_cuda(meta)
            return
        pages_list = self.kv.pages
        if meta.saves:  # first: the step may overwrite these pages (and may load from these slots)
            dev = torch.tensor([d for d, _s in meta.saves], dtype=torch.long)
            slots = torch.tensor([s for _d, s in meta.saves], dtype=torch.long)
            for j, pages in enumerate(pages_list):
                self.host[slots, j] = pages.index_select(0, dev)
            self.bytes_stored += len(meta.saves) * self.page_bytes
        if meta.loads and not self._fail(meta):
            self._load(meta.loads, non_blocking=False)

    def _load(self, loads: list[tuple[str, int, int]], non_blocking: bool) -> None:
        """Every source is read (gathered) before any destination is written, so a device page that
        is both a source and, after an eviction in the same step, a destination is read intact."""
        dev_t = self.device
        hs = [(i, src) for i, (k, src, _d) in enumerate(loads) if k == "h"]
        ds = [(i, src) for i, (k, src, _d) in enumerate(loads) if k == "d"]
        order = [i for i, _ in hs] + [i for i, _ in ds]
        dst = torch.tensor([loads[i][2] for i in order], dtype=torch.long).to(dev_t, non_blocking=non_blocking)
        h_idx = torch.tensor([s for _i, s in hs], dtype=torch.long)
        d_idx = torch.tensor([s for _i, s in ds], dtype=torch.long).to(dev_t, non_blocking=non_blocking)
        for j, pages in enumerate(self.kv.pages):
            parts = []
            if hs:
                src = self.host[h_idx, j]
                if non_blocking:
                    src = src.pin_memory()
                parts.append(src.to(dev_t, non_blocking=non_blocking))
            if ds:
                parts.append(pages.index_select(0, d_idx))
            pages.index_copy_(0, dst, parts[0] if len(parts) == 1 else torch.cat(parts))
        self.bytes_loaded += len(hs) * self.page_bytes
        self.bytes_copied_on_device += len(ds) * self.page_bytes

    def _fail(self, meta: HostOffloadMeta) -> bool:
        if self.fail_next_loads > 0:
            self.fail_next_loads -= 1
            self._failed.update(meta.load_requests)
            return True
        return False

    def _start_cuda(self, meta: HostOffloadMeta) -> None:
        """Side stream, pinned staging, non-blocking copies; the compute stream waits in wait_for_load."""
        stream, dev_t = self.stream, self.device
        stream.wait_stream(torch.cuda.current_stream(dev_t))  # pages written by earlier steps
        with torch.cuda.stream(stream):
            if meta.saves:
                dev = torch.tensor([d for d, _s in meta.saves], dtype=torch.long).to(dev_t, non_blocking=True)
                slots = torch.tensor([s for _d, s in meta.saves], dtype=torch.long)
                staged = []
                for pages in self.kv.pages:
                    buf = torch.empty((len(meta.saves), pages.shape[1]), dtype=torch.uint8, pin_memory=True)
                    buf.copy_(pages.index_select(0, dev), non_blocking=True)
                    staged.append(buf)
                self._staged.append((slots, staged))
                self.bytes_stored += len(meta.saves) * self.page_bytes
                if meta.loads:
                    self._commit_staged()  # a load this step may read a slot saved this step
            if meta.loads and not self._fail(meta):
                self._load(meta.loads, non_blocking=True)

    def _commit_staged(self) -> None:
        if not self._staged:
            return
        self.stream.synchronize()
        for slots, staged in self._staged:
            for j, buf in enumerate(staged):
                self.host[slots, j] = buf
        self._staged = []

    def wait_for_load(self) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def get_finished(self) -> KVConnectorOutput:
        if self.cuda:
            self._commit_staged()  # host copies complete before their slots are reused
        failed, self._failed = self._failed, set()
        return KVConnectorOutput(failed_recving=failed,
                                 stats=dict(stored_bytes=self.bytes_stored, loaded_bytes=self.bytes_loaded,
                                            device_copied_bytes=self.bytes_copied_on_device))


def make_host_offload_connector(ctx: ConnectorContext) -> KVConnector:
    args = ctx.args
    budget = getattr(args, "kv_offload_memory", None) if args is not None else ctx.extra_config.get("bytes")
    if budget is None:
        raise ValueError("kv_offload_memory: not set")
    n = host_slots_for(budget, ctx.layout)
    eviction = getattr(args, "prefix_cache_eviction", "lru") if args is not None else "lru"
    return KVConnector(HostOffloadScheduler(ctx, n, eviction), HostOffloadWorker(ctx, n))
