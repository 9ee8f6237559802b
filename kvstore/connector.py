"""The Mooncake store tier: a KV connector (workers/engine/kv_connector/base.py) after the host tier.

What it does, per the contract in docs/architecture.md ("KV connector API"):

* **Lookup** (`get_num_new_matched_tokens`, engine thread): the longest *joint* usable hit past the
  block-aligned local hit (kvstore/lookup.py: MLA pages present up to a KDA snapshot present in
  every KDA group, hash-unit precision), as batched existence probes on the lookup lane, bounded by
  the deadline (`deadline_ms`, default 50). Store down, lane busy, or deadline passed → 0 (the
  request recomputes; admission never waits longer than the deadline).
* **Load** (`start_load_kv`, synchronous): every object of the hit is read with one
  `batch_get_into` into registered staging slots, bounded by the deadline, checked (each key must
  return exactly its byte count), then copied into the freshly allocated pages of the LoadSpec.
  Any failure → `failed_recving` (the request recomputes; a late read lands in staging only, never
  in pages the engine has moved on with).
* **Save** (`save_kv`, after the forward pass that computed them): MLA pages as they are keyed in
  the prefix cache (`on_blocks_stored`: every full block under the hash at its end; a mid-block key
  only where the request also retains a KDA snapshot at that boundary), and KDA snapshots only from
  the exact boundary hand-offs (`on_boundary_snapshot`), keyed at that boundary, never positionally.
  The step's pages are copied into registered staging slots on the engine thread (so a page reused
  later can never tear a put), then one `batch_put_from` per step runs on the save lane; the engine
  never waits for it.

One `StoreService` (kvstore/service.py: client lifetime, lanes, health) is shared by both halves of
the connector: one Mooncake client per process. Keys: kvstore/keys.py. Options (`extra_config`):
`master` (HOST:PORT, required), `deadline_ms`, `segment_bytes` (what this worker contributes to the
store), `staging_bytes` (registered staging for loads and for saves, each), `local_buffer_bytes`.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

from k3serve.common.block_hash import chain_hashes, root_hash
from k3serve.kvstore.client import StoreClient
from k3serve.kvstore.keys import KeySpace
from k3serve.kvstore.lookup import StoreHit, find_joint_hit
from k3serve.kvstore.service import DeadlineMissed, StoreService, StoreUnavailable
from k3serve.workers.engine.kv_connector.base import (
    NO_MATCH,
    BoundarySnapshot,
    ConnectorContext,
    KVConnector,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
    LoadSpec,
    MatchResult,
)

log = logging.getLogger(__name__)

NAME = "mooncake-store"
DEFAULTS = dict(deadline_ms=50, segment_bytes=256 << 20, staging_bytes=64 << 20, local_buffer_bytes=16 << 20,
                probe_interval_ms=500)


@dataclass
class _Load:
    request_id: str
    tokens: int  # tokens this load supplies
    keys: list[str]
    blocks: list[tuple[int, int]]  # (group id, destination block) per key


@dataclass
class StoreMeta(KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)
    saves: list[tuple[str, int, str, int]] = field(default_factory=list)  # (key, group, kind, block)


class Slots:
    """Registered staging memory cut into equal slots, one per store object (all objects of one
    engine have the same size: a page at every layer position of a group)."""

    def __init__(self, nbytes: int, slot_bytes: int):
        self.slot_bytes = slot_bytes
        self.n = max(0, nbytes // slot_bytes)
        self.buf = torch.zeros(max(1, self.n) * slot_bytes, dtype=torch.uint8)
        self._free = list(range(self.n - 1, -1, -1))
        self._lock = threading.Lock()

    def alloc(self, k: int) -> list[int] | None:
        with self._lock:
            if k > len(self._free):
                return None
            return [self._free.pop() for _ in range(k)]

    def free(self, slots: list[int]) -> None:
        with self._lock:
            self._free.extend(slots)

    def ptr(self, slot: int) -> int:
        return self.buf.data_ptr() + slot * self.slot_bytes

    def rows(self, group_size: int) -> torch.Tensor:
        return self.buf[: self.n * self.slot_bytes].view(self.n, group_size, -1)


class StoreConnectorScheduler(KVConnectorScheduler):
    name = NAME
    stats_prefix = "kv_store_"
    wants_blocks_stored = True

    def __init__(self, ctx: ConnectorContext, service: StoreService, space: KeySpace):
        super().__init__(ctx)
        self.service = service
        self.space = space
        L = ctx.layout
        self.B, self.unit = L.block_size, ctx.hash_unit
        self.mla_groups = [g.group_id for g in L.mla_groups]
        self.kda_groups = [g.group_id for g in L.kda_groups]
        self.kinds = {g.group_id: g.kind for g in L.groups}
        self._lookups: dict[str, tuple[int, int, StoreHit]] = {}  # rid -> (aligned, num_tokens, hit)
        self._loads: list[_Load] = []
        self._stored: dict[str, list[tuple[int, int, bytes]]] = {}  # rid -> full MLA blocks (group, block, hash)
        self._mid: dict[str, list[tuple[int, int, bytes, int]]] = {}  # rid -> mid-block MLA keys (.., p)
        self._boundaries: dict[str, set[int]] = {}
        self._snapshots: list[tuple[str, int, int, bytes]] = []
        self._salts: dict[str, str | None] = {}
        self._saved: OrderedDict[str, None] = OrderedDict()  # keys put recently (skip repeats)
        self.counters: dict[str, float] = dict(lookups=0, lookup_hits=0, lookups_skipped=0, probed_keys=0,
                                               puts_mla=0, puts_kda=0, saves_dropped=0)
        self.worker_counters: dict[str, float] = {}  # the worker half's (same process), for stats()
        # a restarted master holds nothing: forget what was put (read and cleared on the engine thread)
        self._forget_saved = threading.Event()
        service.on_attach.append(self._forget_saved.set)
        service.on_down.append(self._forget_saved.set)
        self.failed_puts: deque[str] = deque()  # keys the save lane could not put (thread-safe appends)

    # -- hashing --------------------------------------------------------------------------------
    def _hashes(self, token_ids, salt, have: list[bytes]) -> list[bytes]:
        n = len(token_ids) // self.unit
        if len(have) >= n:
            return have
        parent = have[-1] if have else root_hash(self.ctx.model_fingerprint, salt)
        return list(have) + chain_hashes(parent, token_ids, self.unit, start_parent=parent, start_unit=len(have))

    def _probe(self, salt):
        def probe(pairs):
            keys = [self.space.key(salt, g, h) for g, h in pairs]
            codes = self.service.client.batch_exists(keys)
            self.service.note_codes("exists", codes)
            return [c == 1 for c in codes]
        return probe

    def lookup(self, token_ids, salt: str | None, start: int = 0, hashes: list[bytes] | None = None,
               deadline_s: float | None = None) -> StoreHit:
        """Longest joint hit of `token_ids` past `start` (any thread). Raises StoreUnavailable or
        DeadlineMissed when the store cannot answer in time."""
        hs = self._hashes(token_ids, salt, hashes or [])
        return self.service.call(
            lambda: find_joint_hit(hs, block_size=self.B, unit=self.unit, max_len=len(token_ids) - 1,
                                   start=start, mla_groups=self.mla_groups, kda_groups=self.kda_groups,
                                   probe=self._probe(salt)),
            op="lookup", deadline_s=deadline_s)

    # -- admission ------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> MatchResult:
        if not self.ctx.enable_prefix_caching or getattr(request, "kv_load_failed", False):
            return NO_MATCH
        rid = request.request_id
        cached = self._lookups.get(rid)
        if cached and cached[0] == num_computed_tokens and cached[1] == request.num_tokens:
            hit = cached[2]
        else:
            self.counters["lookups"] += 1
            try:
                hit = self.lookup(request.all_token_ids, request.cache_salt, num_computed_tokens,
                                  request.unit_hashes)
            except (StoreUnavailable, DeadlineMissed):
                self.counters["lookups_skipped"] += 1
                return NO_MATCH
            self.counters["probed_keys"] += hit.probed
            self._lookups[rid] = (num_computed_tokens, request.num_tokens, hit)
        if hit.tokens <= num_computed_tokens:
            return NO_MATCH
        return MatchResult(hit.tokens - num_computed_tokens, False)

    def update_state_after_alloc(self, request, spec: LoadSpec) -> None:
        cached = self._lookups.pop(request.request_id, None)
        if spec.num_external_tokens <= 0 or cached is None:
            return
        aligned, _n, hit = cached
        if aligned != spec.num_local_tokens or hit.tokens != spec.num_local_tokens + spec.num_external_tokens:
            raise AssertionError(f"kv store: load spec {spec.num_local_tokens}+{spec.num_external_tokens} does "
                                 f"not match the lookup {aligned} -> {hit.tokens}")
        salt = request.cache_salt
        keys, blocks = [], []
        for g, bi, h in hit.mla_pages:
            keys.append(self.space.key(salt, g, h))
            blocks.append((g, spec.block_ids[g][bi]))
        for g, h in hit.kda_snapshots:
            keys.append(self.space.key(salt, g, h))
            blocks.append((g, spec.block_ids[g][0]))
        self._loads.append(_Load(request.request_id, spec.num_external_tokens, keys, blocks))
        for k in keys:  # loaded pages get keyed locally: never put them back
            self._saved[k] = None
        self.counters["lookup_hits"] += 1

    # -- saves ----------------------------------------------------------------------------------
    def on_blocks_stored(self, request, keys) -> None:
        rid = request.request_id
        self._salts[rid] = request.cache_salt
        for block_id, ck in keys:
            if self.kinds.get(ck.group_id) != "mla":
                continue  # KDA state is saved only from the boundary hand-offs
            if ck.num_tokens % self.B == 0:
                self._stored.setdefault(rid, []).append((ck.group_id, block_id, ck.block_hash))
            else:
                self._mid.setdefault(rid, []).append((ck.group_id, block_id, ck.block_hash, ck.num_tokens))

    def on_boundary_snapshot(self, snap: BoundarySnapshot, request) -> None:
        self._salts[request.request_id] = request.cache_salt
        if snap.boundary > request.num_tokens:
            return
        self._boundaries.setdefault(request.request_id, set()).add(snap.boundary)
        self._snapshots.append((request.request_id, snap.group_id, snap.block_id, snap.block_hash))

    def build_connector_meta(self, step: int) -> KVConnectorMetadata:
        meta = StoreMeta(step=step, loads=self._loads)
        self._loads = []
        if self._forget_saved.is_set():
            self._forget_saved.clear()
            self._saved.clear()
        while self.failed_puts:  # a failed put may be tried again by a later request
            self._saved.pop(self.failed_puts.popleft(), None)
        saves: list[tuple[str, int, str, int]] = []
        for rid, items in self._stored.items():
            salt = self._salts.get(rid)
            saves += [(self.space.key(salt, g, h), g, "mla", b) for g, b, h in items]
        for rid, items in self._mid.items():
            salt, bset = self._salts.get(rid), self._boundaries.get(rid, set())
            saves += [(self.space.key(salt, g, h), g, "mla", b) for g, b, h, p in items if p in bset]
        for rid, g, b, h in self._snapshots:
            saves.append((self.space.key(self._salts.get(rid), g, h), g, "kda", b))
        self._stored, self._mid, self._snapshots = {}, {}, []
        for rid in list(self._boundaries):
            if rid not in self._salts:
                self._boundaries.pop(rid, None)
        self._salts = {}
        if saves and not self.service.available:
            self.counters["saves_dropped"] += len(saves)
            saves = []
        for key, _g, kind, _b in saves:
            if key in self._saved:
                continue
            self._saved[key] = None
            meta.saves.append((key, _g, kind, _b))
            self.counters["puts_" + kind] += 1
        while len(self._saved) > 65536:
            self._saved.popitem(last=False)
        return meta

    def request_finished(self, request, block_ids):
        self._lookups.pop(request.request_id, None)
        self._boundaries.pop(request.request_id, None)
        return super().request_finished(request, block_ids)

    def stats(self) -> dict[str, float]:
        out = dict(self.counters)
        out.update(self.worker_counters)
        out.update(self.service.stats)
        for (op, code), n in self.service.failures.items():
            out[f"failures:{op}:{code}"] = n
        return out


class StoreConnectorWorker(KVConnectorWorker):
    def __init__(self, ctx: ConnectorContext, service: StoreService, staging_bytes: int):
        super().__init__(ctx)
        self.service = service
        L = ctx.layout
        self.group_size, self.page_bytes = L.group_size, L.page_bytes
        obj = L.group_size * L.page_bytes
        self.load_slots = Slots(staging_bytes, obj)
        self.save_slots = Slots(staging_bytes, obj)
        for s in (self.load_slots, self.save_slots):
            service.client.register(s.buf.data_ptr(), s.buf.numel())
        self._failed: set[str] = set()
        self.failed_puts: deque[str] = deque()  # drained by the scheduler half (same process)
        self.counters: dict[str, float] = dict(bytes_got=0, bytes_put=0, loads=0, loads_failed=0, hit_tokens=0,
                                               mla_hit_tokens=0, kda_hit_tokens=0, saves_dropped_staging=0,
                                               put_failures=0)
        L = ctx.layout
        self._has = {"mla": bool(L.mla_groups), "kda": bool(L.kda_groups)}

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        for ld in getattr(meta, "loads", []):
            if not self._load(ld):
                self._failed.add(ld.request_id)
                self.counters["loads_failed"] += 1

    def _load(self, ld: _Load) -> bool:
        kv = self.kv
        slots = self.load_slots.alloc(len(ld.keys))
        if slots is None:
            return False
        size = self.load_slots.slot_bytes
        state = {"abandoned": False, "done": False}
        lock = threading.Lock()

        def job():
            try:
                return self.service.client.batch_get_into(ld.keys, [self.load_slots.ptr(s) for s in slots],
                                                          [size] * len(slots))
            finally:
                with lock:
                    state["done"] = True
                    if state["abandoned"]:
                        self.load_slots.free(slots)

        try:
            codes = self.service.call(job, op="load")
        except (StoreUnavailable, DeadlineMissed):
            with lock:
                state["abandoned"] = True
                if state["done"]:
                    self.load_slots.free(slots)
            return False
        except Exception:
            self.load_slots.free(slots)
            raise
        try:
            self.service.note_codes("get", [c for c in codes if c != size])
            if any(c != size for c in codes):
                return False
            rows = self.load_slots.rows(self.group_size)
            idx = torch.tensor(slots, dtype=torch.long)
            dst = torch.tensor([b for _g, b in ld.blocks], dtype=torch.long, device=kv.pages[0].device)
            src = rows[idx]
            for j, t in enumerate(kv.pages):
                t[dst] = src[:, j].to(t.device)
            self.counters["bytes_got"] += size * len(slots)
            self.counters["loads"] += 1
            self.counters["hit_tokens"] += ld.tokens
            for kind, present in self._has.items():
                if present:
                    self.counters[f"{kind}_hit_tokens"] += ld.tokens
            return True
        finally:
            self.load_slots.free(slots)

    def save_kv(self, meta: KVConnectorMetadata) -> None:
        saves = getattr(meta, "saves", [])
        if not saves:
            return
        slots = self.save_slots.alloc(len(saves))
        if slots is None:
            self.counters["saves_dropped_staging"] += len(saves)
            return
        rows = self.save_slots.rows(self.group_size)
        idx = torch.tensor(slots, dtype=torch.long)
        src = torch.tensor([b for _k, _g, _kind, b in saves], dtype=torch.long, device=self.kv.pages[0].device)
        for j, t in enumerate(self.kv.pages):
            rows[idx, j] = t[src].to("cpu")
        keys = [k for k, _g, _kind, _b in saves]
        size = self.save_slots.slot_bytes

        def job():
            try:
                codes = self.service.client.batch_put_from(keys, [self.save_slots.ptr(s) for s in slots],
                                                           [size] * len(slots))
                self.service.note_codes("put", codes)
                ok = sum(1 for c in codes if c == 0)
                self.counters["bytes_put"] += ok * size
                self.counters["put_failures"] += len(codes) - ok
                self.failed_puts.extend(k for k, c in zip(keys, codes) if c != 0)
            except Exception:
                self.failed_puts.extend(keys)
                raise
            finally:
                self.save_slots.free(slots)

        if not self.service.submit_save(job):
            self.save_slots.free(slots)
            self.counters["saves_dropped_staging"] += len(saves)

    def get_finished(self) -> KVConnectorOutput:
        failed, self._failed = self._failed, set()
        return KVConnectorOutput(failed_recving=failed)

    def shutdown(self) -> None:
        self.service.close()


def store_options(ctx: ConnectorContext) -> dict:
    """Options from the EngineArgs `kv_store*` fields (ctx.args), overridden by ctx.extra_config."""
    a = ctx.args
    from_args = {}
    if a is not None:
        from_args = dict(master=getattr(a, "kv_store", None), deadline_ms=getattr(a, "kv_store_deadline_ms", None),
                         segment_bytes=getattr(a, "kv_store_segment_bytes", None),
                         staging_bytes=getattr(a, "kv_store_staging_bytes", None))
    env_segment = os.environ.get("K3SERVE_KV_STORE_SEGMENT_BYTES")  # the operator's pods set it
    defaults = {**DEFAULTS, **({"segment_bytes": int(env_segment)} if env_segment else {})}
    opts = {**defaults, **{k: v for k, v in {**from_args, **ctx.extra_config}.items() if v is not None}}
    if not opts.get("master"):
        raise ValueError("kv store: no master address (EngineArgs.kv_store, --kv-store HOST:PORT)")
    if int(opts["deadline_ms"]) <= 0:
        raise ValueError("kv_store_deadline_ms: must be positive")
    return opts


def make_store_connector(ctx: ConnectorContext) -> KVConnector:
    opts = store_options(ctx)
    if not ctx.enable_prefix_caching:
        raise ValueError("kv store: needs enable_prefix_caching (the store holds prefix-cache entries)")
    obj = ctx.layout.group_size * ctx.layout.page_bytes
    if int(opts["staging_bytes"]) < obj:
        raise ValueError(f"kv_store_staging_bytes: {opts['staging_bytes']} is smaller than one store object "
                         f"({obj} bytes: {ctx.layout.group_size} layers x {ctx.layout.page_bytes}-byte pages)")
    client = StoreClient(opts["master"], segment_bytes=int(opts["segment_bytes"]),
                         local_buffer_bytes=int(opts["local_buffer_bytes"]))
    service = StoreService(client, deadline_s=int(opts["deadline_ms"]) / 1000.0,
                           probe_interval_s=int(opts["probe_interval_ms"]) / 1000.0)
    tp = ctx.extra_config.get("tp_rank", 0), ctx.extra_config.get("tp_size", 1)
    space = KeySpace.for_engine(ctx.model_fingerprint, ctx.layout, ctx.hash_unit, *tp)
    sched = StoreConnectorScheduler(ctx, service, space)
    worker = StoreConnectorWorker(ctx, service, int(opts["staging_bytes"]))
    sched.worker_counters = worker.counters
    sched.failed_puts = worker.failed_puts
    service.start()
    atexit.register(service.close)  # close the native client before interpreter teardown
    return KVConnector(sched, worker)


def find_store(engine) -> StoreConnectorScheduler | None:
    """The store tier's scheduler half inside an LLMEngine (or an AsyncEngine wrapping one), if any."""
    eng = getattr(engine, "engine", engine)
    stack = [getattr(getattr(eng, "scheduler", None), "connector", None)]
    while stack:
        c = stack.pop()
        if isinstance(c, StoreConnectorScheduler):
            return c
        stack.extend(getattr(c, "children", None) or [])
    return None


def store_lookup(engine, token_ids: list[int], cache_salt: str | None) -> tuple[str, int, int, int]:
    """(status, tokens, block size, hash unit): how much of `token_ids` the store can supply
    (joint usable). Status: "ok" | "no_store" | "unavailable" | "deadline". Any thread; waits at
    most the store deadline. Used by the worker's StoreLookup gRPC call (the router's question)."""
    s = find_store(engine)
    if s is None:
        return "no_store", 0, 0, 0
    B, u = s.B, s.unit
    if len(token_ids) < 2:
        return "ok", 0, B, u
    try:
        hit = s.lookup(list(token_ids), cache_salt)
    except StoreUnavailable:
        return "unavailable", 0, B, u
    except DeadlineMissed:
        return "deadline", 0, B, u
    return "ok", hit.tokens, B, u
