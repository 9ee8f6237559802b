"""HybridKVCacheManager: per-request MLA block tables, KDA state slots, and the prefix cache.

Per request and cache group:
* MLA groups: an append-only block table covering every computed token (full attention).
* KDA groups: one private *running* state block (conv + recurrent state after `num_computed`
  tokens). Snapshots for the prefix cache are never the running block: the state at a retained
  boundary p is exported during the forward pass that crosses p (the KDA ops' checkpoint
  arguments) into a fresh block keyed at exactly p. So a retained snapshot is never extended in
  place (copy-before-extend), and a chunk is never split at a cacheable boundary.

Prefix-cache lookup (design doc §3.2): MLA left to right over full blocks, plus a mid-block probe
of the first missing block when the hash unit is smaller than the block; then the deepest KDA
snapshot at or below the MLA hit, present in every KDA group. Hit = min of the two. A hit that
ends mid-block copies the shared tail page into a private page (copy-on-write); a KDA hit copies
the snapshot into the request's running block. A snapshot (or a CoW source) registered in the
current step has not been computed yet, so such a request is deferred a step (the same-step rule).

Retention (which boundaries get KDA snapshots; MLA pages are always cached densely):
* `0`: the prompt's replay boundary floor((prefill_end - 1) / unit) · unit, plus the Marconi
  junction when `selective` is on;
* `N`: also every multiple of N tokens;
* `"dense"`: also every block boundary.
With `selective` (Marconi, "cache on second hit"), a request whose MLA hit exceeds its KDA hit by
at least a unit records the junction (the MLA-reached boundary) and snapshots there, so the next
request sharing that prefix hits it fully.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from _engine_before.block_pool import Block, BlockPool
from _engine_before.request import Request
from k3serve.common.block_hash import chain_hashes, root_hash
from k3serve.workers.engine.cache_layout import CacheLayout


@dataclass
class PrefixHit:
    tokens: int = 0
    mla_tokens: int = 0  # longest MLA-only hit
    kda_tokens: int = 0  # deepest KDA snapshot at or below the MLA hit
    full_blocks: list[list[Block]] = field(default_factory=list)  # per MLA group
    cow_sources: list[Block] | None = None  # per MLA group, when the hit ends mid-block
    kda_blocks: list[Block] | None = None  # per KDA group
    defer: bool = False
    junction: int = 0


@dataclass
class SlotPlan:
    """What the model runner needs for one request this step (plain data)."""

    mla_block_ids: list[list[int]]  # per MLA group: the whole block table
    kda_slots: list[int]  # per KDA group: the running state block
    has_initial_state: bool
    checkpoints: list[tuple[int, list[int]]]  # (tokens into this chunk, snapshot block per KDA group)
    copies: list[tuple[int, int]]  # page copies (src, dst) to run before the forward pass


@dataclass
class _ReqState:
    mla: list[list[Block]]
    kda: list[Block]
    registered_full: int = 0  # MLA blocks already keyed at their full end
    registered_units: int = 0  # hash units already keyed (fine-grained MLA keys)


class HybridKVCacheManager:
    def __init__(self, layout: CacheLayout, pool: BlockPool, *, enable_caching: bool = False,
                 hash_unit: int | None = None, retention: int | str = 0, selective: bool = False,
                 model_fingerprint: bytes = b"\0" * 32):
        self.layout = layout
        self.pool = pool
        self.B = layout.block_size
        self.enable_caching = enable_caching
        self.unit = hash_unit or self.B
        if self.B % self.unit:
            raise ValueError(f"prefix_match_unit: must divide the block size {self.B} (got {self.unit})")
        if retention == "dense" or retention is None:
            self.retention: int | str = "dense"
        else:
            retention = int(retention)
            if retention < 0 or retention % self.unit:
                raise ValueError("prefix_cache_retention_interval: must be 0, 'dense' or a positive multiple "
                                 f"of the hash unit {self.unit} (got {retention})")
            self.retention = retention
        self.selective = selective
        self.fingerprint = model_fingerprint
        self.mla_groups = layout.mla_groups
        self.kda_groups = layout.kda_groups
        self.reqs: dict[str, _ReqState] = {}
        self.step = 0
        self._step_refs: list[Block] = []
        # counters for metrics
        self.stats = dict(queries=0, hits=0, mla_hits=0, kda_hits=0, snapshots_stored=0)

    # -- hashing -------------------------------------------------------------------------------
    def update_hashes(self, req: Request) -> None:
        if not self.enable_caching:
            return
        have = len(req.unit_hashes)
        if (have + 1) * self.unit > req.num_tokens:
            return
        parent = req.unit_hashes[-1] if have else root_hash(self.fingerprint, req.cache_salt)
        req.unit_hashes.extend(chain_hashes(parent, req.all_token_ids, self.unit, start_parent=parent,
                                            start_unit=have))

    def _hash_at(self, req: Request, p: int) -> bytes | None:
        i = p // self.unit - 1
        return req.unit_hashes[i] if 0 <= i < len(req.unit_hashes) and p % self.unit == 0 else None

    # -- lookup --------------------------------------------------------------------------------
    def find_hit(self, req: Request) -> PrefixHit:
        hit = PrefixHit(full_blocks=[[] for _ in self.mla_groups])
        if not self.enable_caching:
            return hit
        self.update_hashes(req)
        B, u = self.B, self.unit
        max_len = req.num_tokens - 1
        pool = self.pool
        full: list[list[Block]] = []
        partial: tuple[int, list[Block]] | None = None
        if self.mla_groups:
            while (len(full) + 1) * B <= max_len:
                h = self._hash_at(req, (len(full) + 1) * B)
                blks = [pool.lookup((h, g.group_id)) for g in self.mla_groups] if h else [None]
                if any(b is None for b in blks):
                    break
                full.append(blks)
            mla_hit = len(full) * B
            if u < B:
                for k in range(B // u - 1, 0, -1):
                    p = len(full) * B + k * u
                    h = self._hash_at(req, p) if p <= max_len else None
                    if h is None:
                        continue
                    blks = [pool.lookup((h, g.group_id)) for g in self.mla_groups]
                    if all(b is not None for b in blks):
                        partial, mla_hit = (p, blks), p
                        break
        else:
            mla_hit = min(max_len // u, len(req.unit_hashes)) * u
        kda_hit, kda_blocks = mla_hit, None
        if self.kda_groups:
            kda_hit = 0
            p = (mla_hit // u) * u
            while p >= u:
                h = self._hash_at(req, p)
                blks = [pool.lookup((h, g.group_id)) for g in self.kda_groups] if h else [None]
                if all(b is not None and b.key_tokens.get((h, g.group_id)) == p
                       for b, g in zip(blks, self.kda_groups)):
                    kda_hit, kda_blocks = p, blks
                    break
                p -= u
        tokens = min(mla_hit, kda_hit)
        hit.tokens, hit.mla_tokens, hit.kda_tokens = tokens, mla_hit, kda_hit
        nfull, rem = divmod(tokens, B)
        hit.full_blocks = [[full[i][gi] for i in range(nfull)] for gi in range(len(self.mla_groups))]
        if rem and self.mla_groups:
            src = full[nfull] if nfull < len(full) else partial[1]
            hit.cow_sources = list(src)
        hit.kda_blocks = kda_blocks if tokens > 0 else None
        copy_sources = (hit.cow_sources or []) + (hit.kda_blocks or [])
        hit.defer = any(b.cached_step == self.step for b in copy_sources)
        if self.selective and self.kda_groups and mla_hit - tokens >= u:
            hit.junction = min(mla_hit, max_len) // u * u
        return hit

    # -- retention -----------------------------------------------------------------------------
    def set_retained_boundaries(self, req: Request, hit: PrefixHit) -> None:
        req.retained_boundaries = set()
        if not self.enable_caching or not self.kda_groups:
            return
        u = self.unit
        replay = (req.prefill_end - 1) // u * u
        if replay > 0:
            req.retained_boundaries.add(replay)
        if hit.junction > 0:
            req.shared_prefix_boundary = hit.junction
            req.retained_boundaries.add(hit.junction)

    def _checkpoint_positions(self, req: Request, start: int, end: int) -> list[int]:
        if not self.enable_caching or not self.kda_groups:
            return []
        ps = {p for p in req.retained_boundaries if start < p <= end}
        step = self.B if self.retention == "dense" else self.retention
        if step:
            first = (start // step + 1) * step
            ps.update(range(first, end + 1, step))
        out = []
        for p in sorted(ps):
            h = self._hash_at(req, p)
            if h is None:
                continue
            if all(self.pool.lookup((h, g.group_id)) is not None for g in self.kda_groups):
                continue  # someone already holds this snapshot
            out.append(p)
        return out

    # -- allocation ----------------------------------------------------------------------------
    def admit(self, req: Request, hit: PrefixHit, num_new: int) -> SlotPlan | None:
        """Allocate for a request starting at `hit.tokens`; None if the pool cannot hold it now."""
        assert req.request_id not in self.reqs
        B = self.B
        start, end = hit.tokens, hit.tokens + num_new
        nfull = start // B
        reuse = {b.block_id: b for blks in hit.full_blocks for b in blks}
        for b in (hit.cow_sources or []) + (hit.kda_blocks or []):
            reuse[b.block_id] = b
        available = self.pool.num_free - sum(1 for b in reuse.values() if b.ref_cnt == 0)
        mla_new = math.ceil(end / B) - nfull
        ckpts = self._checkpoint_positions(req, start, end)
        need = len(self.mla_groups) * mla_new + len(self.kda_groups)
        if need + len(self.kda_groups) * len(ckpts) > available:
            ckpts = []
            if need > available:
                return None
        for blks in hit.full_blocks:
            self.pool.touch(blks)
        step_refs = (hit.cow_sources or []) + (hit.kda_blocks or [])
        self.pool.touch(step_refs)
        self._step_refs.extend(step_refs)
        copies: list[tuple[int, int]] = []
        mla: list[list[Block]] = []
        for gi in range(len(self.mla_groups)):
            new = self.pool.allocate(mla_new)
            if hit.cow_sources:
                copies.append((hit.cow_sources[gi].block_id, new[0].block_id))
            mla.append(list(hit.full_blocks[gi]) + new)
        kda = self.pool.allocate(len(self.kda_groups))
        if hit.kda_blocks:
            copies.extend((s.block_id, d.block_id) for s, d in zip(hit.kda_blocks, kda))
        st = _ReqState(mla=mla, kda=kda, registered_full=nfull)
        self.reqs[req.request_id] = st
        return self._finish_plan(req, st, start, end, ckpts, copies, has_init=start > 0)

    def extend(self, req: Request, num_new: int) -> SlotPlan | None:
        """Grow a running request by `num_new` tokens; None if the pool cannot hold them now."""
        st = self.reqs[req.request_id]
        start, end = req.num_computed_tokens, req.num_computed_tokens + num_new
        mla_new = max(0, math.ceil(end / self.B) - (len(st.mla[0]) if st.mla else 0))
        ckpts = self._checkpoint_positions(req, start, end)
        need = len(self.mla_groups) * mla_new
        if need + len(self.kda_groups) * len(ckpts) > self.pool.num_free:
            ckpts = []
            if need > self.pool.num_free:
                return None
        for blks in st.mla:
            blks.extend(self.pool.allocate(mla_new))
        return self._finish_plan(req, st, start, end, ckpts, [], has_init=start > 0)

    def _finish_plan(self, req: Request, st: _ReqState, start: int, end: int, ckpts: list[int],
                     copies: list[tuple[int, int]], has_init: bool) -> SlotPlan:
        checkpoints: list[tuple[int, list[int]]] = []
        for p in ckpts:
            snap = self.pool.allocate(len(self.kda_groups))
            self._step_refs.extend(snap)
            h = self._hash_at(req, p)
            kda_parent = self._hash_at(req, p - self.unit)
            for b, g in zip(snap, self.kda_groups):
                self.pool.register(b, (h, g.group_id), p, "kda", self.step, kda_parent)
            self.stats["snapshots_stored"] += 1
            if p % self.B and self.mla_groups:
                # the MLA pages must reach p too: key the tail page at the mid-block boundary
                mla_parent = self._hash_at(req, (p - 1) // self.B * self.B)
                for blks, g in zip(st.mla, self.mla_groups):
                    self.pool.register(blks[(p - 1) // self.B], (h, g.group_id), p, "mla", self.step, mla_parent)
            checkpoints.append((p - start, [b.block_id for b in snap]))
        if self.enable_caching and self.mla_groups and self.unit < self.B:
            # fine-grained MLA keys: every computed hash unit inside a block is findable, so a hit
            # (and a Marconi junction) can end at any unit, not only at block ends
            u = self.unit
            st.registered_units = max(st.registered_units, start // u)
            while (st.registered_units + 1) * u <= end:
                q = (st.registered_units + 1) * u
                st.registered_units += 1
                if q % self.B == 0:
                    continue  # the full-block key below covers it
                h = self._hash_at(req, q)
                if h is None:
                    break
                parent = self._hash_at(req, (q - 1) // self.B * self.B)
                for blks, g in zip(st.mla, self.mla_groups):
                    self.pool.register(blks[(q - 1) // self.B], (h, g.group_id), q, "mla", self.step, parent)
        if self.enable_caching and self.mla_groups:
            while (st.registered_full + 1) * self.B <= end:
                i = st.registered_full
                h = self._hash_at(req, (i + 1) * self.B)
                if h is None:
                    break
                parent = self._hash_at(req, i * self.B)
                for blks, g in zip(st.mla, self.mla_groups):
                    self.pool.register(blks[i], (h, g.group_id), (i + 1) * self.B, "mla", self.step, parent)
                st.registered_full += 1
        return SlotPlan(
            mla_block_ids=[[b.block_id for b in blks] for blks in st.mla],
            kda_slots=[b.block_id for b in st.kda],
            has_initial_state=has_init,
            checkpoints=checkpoints,
            copies=copies,
        )

    def free(self, req: Request) -> None:
        st = self.reqs.pop(req.request_id, None)
        if st is None:
            return
        for blks in st.mla:
            self.pool.free_blocks(list(reversed(blks)))
        self.pool.free_blocks(st.kda)

    def begin_step(self, step: int) -> None:
        self.step = step

    def end_step(self) -> None:
        refs, self._step_refs = self._step_refs, []
        self.pool.free_blocks(refs)

    def num_kda_blocks_in_use(self) -> int:
        return sum(len(st.kda) for st in self.reqs.values())

    def cached_snapshot_lengths(self) -> dict[int, list[int]]:
        """KDA group id -> sorted prefix lengths that hold a cached snapshot (tests, metrics)."""
        out: dict[int, list[int]] = {g.group_id: [] for g in self.kda_groups}
        for (_h, gid), b in self.pool.cached.items():
            if gid in out:
                out[gid].append(b.key_tokens[(_h, gid)])
        return {g: sorted(v) for g, v in out.items()}
