"""KVCacheCoordinator: the hybrid cache over one manager per cache-group kind on one block pool.

* `MLAManager` (mla_manager.py): paged block tables and their prefix keys.
* `KDAManager` (kda_manager.py): running state blocks, retained boundary snapshots.
* `BlockPool` (block_pool.py): kind-free ids, refcounts, keys, eviction (eviction.py), events.

Prefix-cache lookup (design doc §3.2): the MLA hit (full blocks, then a unit-precision probe of
the first missing block), then the deepest KDA snapshot at or below it present in every KDA
group. Hit = min of the two. A hit that ends mid-block copies the shared tail page into a private
page (copy-on-write); a KDA hit copies the snapshot into the request's running block. A snapshot
(or a CoW source) registered in the current step has not been computed yet, so such a request is
deferred a step (the same-step rule).

Every allocation returns a `StepPlan` delta: only the blocks allocated by this call (the model
runner keeps the block tables), the snapshot exports and the page copies of the step.
Connector loads (workers/engine/kv_connector/base.py): `admit(..., num_external=E)` allocates for
the loaded tokens too and holds back the full-block prefix keys of the request until
`confirm_load` (a load that fails is undone by `discard`, which drops every key the request's
fresh pages received).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from k3serve.common.block_hash import chain_hashes, root_hash
from k3serve.workers.engine.cache_layout import CacheLayout
from k3serve.workers.engine.kv_cache.block_pool import Block, BlockPool
from k3serve.workers.engine.kv_cache.eviction import ComputePerByteScorer
from k3serve.workers.engine.kv_cache.kda_manager import KDAManager
from k3serve.workers.engine.kv_cache.mla_manager import MLAManager
from k3serve.workers.engine.kv_connector.base import BoundarySnapshot, CachedKey, EvictedBlock
from k3serve.workers.engine.request import Request


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
class StepPlan:
    """What one allocation adds for a request this step (plain data, a delta)."""

    new_block_ids: list[list[int]]  # per MLA group: blocks appended to the table by this call
    checkpoints: list[tuple[int, list[int]]]  # (tokens into this chunk, snapshot block per KDA group)
    copies: list[tuple[int, int]]  # page copies (src, dst) to run before the forward pass


@dataclass
class PrefixCacheStats:
    """Counted by the coordinator at each request's first admission (tokens)."""

    queries: int = 0
    hits: int = 0
    mla_hits: int = 0
    kda_hits: int = 0


@dataclass
class _ReqState:
    mla: list[list[Block]]
    kda: list[Block]
    registered_full: int = 0  # MLA blocks already keyed at their full end
    registered_units: int = 0  # hash units already keyed (fine-grained MLA keys)
    loading: bool = False  # a connector load is unconfirmed: full-block keys held back
    num_local: int = 0  # tokens of the local hit at admission (pages before it are shared)
    step_snaps: list[Block] = field(default_factory=list)  # snapshots exported this step
    spec: list[list[Block]] = field(default_factory=list)  # per KDA group: speculative decoding's extra blocks


_NO_BLOCKS: list[list[int]] = []


_DECODE_PLAN = StepPlan([], [], [])  # shared, never mutated: the plan of a trivial decode step


class KVCacheCoordinator:
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
        self.kda_gids = {g.group_id for g in self.kda_groups}
        self.mla = MLAManager(self.mla_groups, pool, self.B, self.unit, self._hash_at, enable_caching)
        self.kda = KDAManager(self.kda_groups, pool, self.B, self.unit, self._hash_at, enable_caching,
                              self.retention, selective)
        if isinstance(pool.scorer, ComputePerByteScorer):
            pool.scorer.set_state_groups(self.kda_gids)
        self.reqs: dict[str, _ReqState] = {}
        self.step = 0
        self._step_refs: list[Block] = []
        self._snap_states: list[_ReqState] = []
        self.stats = PrefixCacheStats()
        self.on_snapshot: Callable[[BoundarySnapshot, Request], None] | None = None

    # -- connectors ----------------------------------------------------------------------------
    def attach_connector(self, conn) -> None:
        """Route evictions, boundary snapshots (and, if overridden, stored keys) to a connector's
        scheduler half."""
        groups = self.layout.groups

        def evicted(b: Block) -> None:
            gid = b.keys[0][1]
            keys = tuple(CachedKey(k[0], k[1], b.key_tokens[k], b.key_parent.get(k)) for k in b.keys)
            conn.on_block_evicted(EvictedBlock(b.block_id, gid, groups[gid].kind, keys))

        self.pool.on_evict = evicted
        conn.device_cache = self.pool.cached
        self.on_snapshot = conn.on_boundary_snapshot
        if conn.wants_blocks_stored:
            self.mla.on_stored = lambda req, stored: conn.on_blocks_stored(
                req, [(bid, CachedKey(k[0], k[1], n, parent)) for bid, k, n, parent in stored])

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
        full: list[list[Block]] = []
        partial = None
        if self.mla_groups:
            mla_hit, full, partial = self.mla.find_hit(req, max_len)
        else:
            mla_hit = min(max_len // u, len(req.unit_hashes)) * u
        kda_hit, kda_blocks = mla_hit, None
        if self.kda_groups:
            kda_hit, kda_blocks = self.kda.find_hit(req, mla_hit)
        tokens = min(mla_hit, kda_hit)
        hit.tokens, hit.mla_tokens, hit.kda_tokens = tokens, mla_hit, kda_hit
        nfull, rem = divmod(tokens, B)
        hit.full_blocks = [[full[i][gi] for i in range(nfull)] for gi in range(len(self.mla_groups))]
        if rem and self.mla_groups:
            src = full[nfull] if nfull < len(full) else partial
            hit.cow_sources = list(src)
        hit.kda_blocks = kda_blocks if tokens > 0 else None
        copy_sources = (hit.cow_sources or []) + (hit.kda_blocks or [])
        hit.defer = any(b.cached_step == self.step for b in copy_sources)
        if self.selective and self.kda_groups and mla_hit - tokens >= u:
            hit.junction = min(mla_hit, max_len) // u * u
        return hit

    def truncate_hit(self, hit: PrefixHit, tokens: int) -> PrefixHit:
        """The hit cut to `tokens` (block-aligned, ≤ hit.tokens) for a longer connector load from
        there (design doc §4.2): pure slicing; no tail page is adopted and no KDA snapshot copied
        (the connector writes the state at the load's end)."""
        assert tokens % self.B == 0 and tokens <= hit.tokens
        n = tokens // self.B
        return PrefixHit(tokens=tokens, mla_tokens=hit.mla_tokens, kda_tokens=hit.kda_tokens,
                         full_blocks=[blks[:n] for blks in hit.full_blocks], junction=hit.junction)

    # -- retention -----------------------------------------------------------------------------
    def set_retained_boundaries(self, req: Request, hit: PrefixHit) -> None:
        if not self.kda_groups:
            req.retained_boundaries = set()
            return
        self.kda.set_retained_boundaries(req, hit.junction)

    # -- allocation ----------------------------------------------------------------------------
    def admit(self, req: Request, hit: PrefixHit, num_new: int, num_external: int = 0,
              first: bool = False) -> StepPlan | None:
        """Allocate for a request whose pages hold `hit.tokens` tokens, then `num_external` tokens a
        connector loads, then `num_new` computed this step; None if the pool cannot hold it now.
        `first`: the request's first admission (counted in the prefix-cache stats)."""
        assert req.request_id not in self.reqs
        B = self.B
        start = hit.tokens + num_external
        end = start + num_new
        nfull = hit.tokens // B
        reuse = {b.block_id: b for blks in hit.full_blocks for b in blks}
        for b in (hit.cow_sources or []) + (hit.kda_blocks or []):
            reuse[b.block_id] = b
        available = self.pool.num_free - sum(1 for b in reuse.values() if b.ref_cnt == 0)
        mla_new = -(-end // B) - nfull
        ckpts = self.kda.checkpoint_positions(req, start, end) if self.kda_groups else []
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
        st = _ReqState(mla=mla, kda=kda, registered_full=nfull, loading=num_external > 0,
                       num_local=hit.tokens)
        self.reqs[req.request_id] = st
        if first:
            s = self.stats
            s.queries += req.num_tokens
            s.hits += hit.tokens
            s.mla_hits += hit.mla_tokens
            s.kda_hits += hit.kda_tokens
        plan = self._finish_plan(req, st, start, end, ckpts, copies)
        plan.new_block_ids = [[b.block_id for b in blks] for blks in mla]
        return plan

    def extend(self, req: Request, num_new: int) -> StepPlan | None:
        """Grow a running request by `num_new` tokens; None if the pool cannot hold them now."""
        st = self.reqs[req.request_id]
        start = req.num_computed_tokens
        end = start + num_new
        if num_new == 1 and self._decode_is_trivial(req, st, end):
            return _DECODE_PLAN
        have = len(st.mla[0]) if st.mla else 0
        mla_new = max(0, -(-end // self.B) - have)
        ckpts = self.kda.checkpoint_positions(req, start, end) if self.kda_groups else []
        need = len(self.mla_groups) * mla_new
        free = self.pool.num_free
        if need + len(self.kda_groups) * len(ckpts) > free:
            ckpts = []
            if need > free:
                return None
        new_ids = _NO_BLOCKS
        if mla_new:
            new_ids = []
            for blks in st.mla:
                new = self.pool.allocate(mla_new)
                blks.extend(new)
                new_ids.append([b.block_id for b in new])
        plan = self._finish_plan(req, st, start, end, ckpts, [])
        plan.new_block_ids = new_ids
        return plan

    def _decode_is_trivial(self, req: Request, st: _ReqState, end: int) -> bool:
        """One token that needs no new page, crosses no retained boundary and keys nothing (the common
        decode step: no allocation, an empty plan)."""
        B = self.B
        if st.mla and end > len(st.mla[0]) * B:
            return False  # a new page
        if not self.enable_caching:
            return True
        if end % self.unit == 0 or end % B == 0:
            return False  # a unit or block end to key
        if self.kda_groups:
            step = self.kda._step
            if end in req.retained_boundaries or (step and end % step == 0):
                return False
        return True

    def _finish_plan(self, req: Request, st: _ReqState, start: int, end: int, ckpts: list[int],
                     copies: list[tuple[int, int]]) -> StepPlan:
        checkpoints: list[tuple[int, list[int]]] = []
        for p in ckpts:
            snap, h, parent = self.kda.export(req, p, self.step)
            self._step_refs.extend(snap)
            if not st.step_snaps:
                self._snap_states.append(st)
            st.step_snaps.extend(snap)
            if p % self.B and self.mla_groups:
                # the MLA pages must reach p too: key the tail page at the mid-block boundary
                self.mla.register_boundary(req, st.mla, p, h, self.step)
            checkpoints.append((p - start, [b.block_id for b in snap]))
            if self.on_snapshot is not None:
                for b, g in zip(snap, self.kda_groups):
                    self.on_snapshot(BoundarySnapshot(req.request_id, g.group_id, b.block_id, p, h, parent), req)
        if self.mla_groups and self.enable_caching:
            B = self.B
            # decode fast path: nothing to key unless `end` reaches a unit or block end
            if end - start != 1 or end % self.unit == 0 or end % B == 0:
                # a verify chunk runs past the known tokens (its drafts): key only what is known;
                # `commit_spec` keys the accepted rest
                self.mla.register(req, st.mla, st, start, min(end, req.num_tokens), self.step)
        return StepPlan(_NO_BLOCKS, checkpoints, copies)

    def confirm_load(self, req: Request) -> None:
        """The connector's load for `req` is in its pages: key them (and what was computed since)."""
        st = self.reqs.get(req.request_id)
        if st is None or not st.loading:
            return
        st.loading = False
        self.mla.register(req, st.mla, st, req.num_computed_tokens, req.num_computed_tokens, self.step)

    def discard(self, req: Request) -> None:
        """Undo a failed load: drop every key the request's fresh pages and this step's snapshots
        got, then free them."""
        st = self.reqs.get(req.request_id)
        if st is None:
            return
        first_fresh = st.num_local // self.B
        for blks in st.mla:
            for b in blks[first_fresh:]:
                if b.ref_cnt == 1:
                    self.pool.drop_block(b)
        for b in st.step_snaps:
            self.pool.drop_block(b)
        self.free(req)

    def free(self, req: Request) -> None:
        st = self.reqs.pop(req.request_id, None)
        if st is None:
            return
        for blks in st.mla:
            self.pool.free_blocks(list(reversed(blks)))
        self.pool.free_blocks(st.kda)
        for blks in st.spec:
            self.pool.free_blocks(blks)

    # -- speculative decoding (workers/engine/spec/) --------------------------------------------
    def spec_slots(self, req: Request, n: int) -> list[list[int]] | None:
        """The request's `n` extra KDA blocks per KDA group for its rollback scheme (allocated on first
        use, kept until it is freed or preempted; private, never keyed, never exchanged: `block_ids`
        does not list them). None if the pool cannot hold them now."""
        st = self.reqs[req.request_id]
        if not st.spec and n and self.kda_groups:
            if self.pool.num_free < n * len(self.kda_groups):
                return None
            st.spec = [self.pool.allocate(n) for _ in self.kda_groups]
        return [[b.block_id for b in blks] for blks in st.spec] if st.spec else [[] for _ in self.kda_groups]

    def commit_spec(self, req: Request, start: int, verified: int) -> list[tuple[int, list[int]]]:
        """After a verify chunk at `start` kept `verified` tokens (its hashes already updated): key the
        accepted MLA pages and units, and allocate + key a snapshot block per KDA group for each retained
        boundary p with start + 1 < p <= start + verified (start + 1 was exported at schedule time).
        Returns [(p - start, [block per KDA group])]: the rollback scheme writes the state there now
        (workers/engine/spec/rollback.py `commit`), before any later step can read it."""
        st = self.reqs.get(req.request_id)
        end = start + verified
        if st is None or not self.enable_caching:
            return []
        if self.mla_groups:
            self.mla.register(req, st.mla, st, start, end, self.step)
        if not self.kda_groups:
            return []
        out = []
        for p in self.kda.checkpoint_positions(req, start + 1, end):
            if self.pool.num_free < len(self.kda_groups):
                break
            snap, h, _parent = self.kda.export(req, p, self.step)
            self._step_refs.extend(snap)  # held until the next step ends (written right after this call)
            if p % self.B and self.mla_groups:
                self.mla.register_boundary(req, st.mla, p, h, self.step)
            out.append((p - start, [b.block_id for b in snap]))
        return out

    def block_ids(self, req: Request) -> tuple[list[int], ...]:
        """The request's pages per cache group, indexed by group id (connector `BlockIds`)."""
        st = self.reqs.get(req.request_id)
        out: list[list[int]] = [[] for _ in self.layout.groups]
        if st is None:
            return tuple(out)
        for blks, g in zip(st.mla, self.mla_groups):
            out[g.group_id] = [b.block_id for b in blks]
        for b, g in zip(st.kda, self.kda_groups):
            out[g.group_id] = [b.block_id]
        return tuple(out)

    def kda_slots(self, req: Request) -> list[int]:
        return [b.block_id for b in self.reqs[req.request_id].kda]

    def begin_step(self, step: int) -> None:
        self.step = step

    def end_step(self) -> None:
        refs, self._step_refs = self._step_refs, []
        self.pool.free_blocks(refs)
        for st in self._snap_states:
            st.step_snaps = []
        self._snap_states = []

    # -- introspection -------------------------------------------------------------------------
    def num_kda_blocks_in_use(self) -> int:
        return sum(len(st.kda) for st in self.reqs.values())

    def num_cached_kda_blocks(self) -> int:
        return sum(1 for (_h, g) in self.pool.cached if g in self.kda_gids)

    def num_evicted_kda(self) -> int:
        return sum(n for g, n in self.pool.stats.evicted_by_group.items() if g in self.kda_gids)

    def cached_snapshot_lengths(self) -> dict[int, list[int]]:
        """KDA group id -> sorted prefix lengths that hold a cached snapshot (tests, metrics)."""
        out: dict[int, list[int]] = {g.group_id: [] for g in self.kda_groups}
        for (_h, gid), b in self.pool.cached.items():
            if gid in out:
                out[gid].append(b.key_tokens[(_h, gid)])
        return {g: sorted(v) for g, v in out.items()}
