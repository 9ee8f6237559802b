"""The NIXL P/D connector (design doc §5): both halves of a `ConnectorKind.TRANSFER` connector.

Prefill side (a request with `kv_transfer_params={"do_remote_decode": True}`, submitted by the gRPC
layer as the prompt one token short with max_tokens=1): at finish, `request_finished` pins the
request's pages (delayed free) and returns the transfer parameters; the worker half reports the
request in `finished_sending` when the decode side's READ notification arrives; the engine frees the
pages then, or at the expiry.

Decode side (`kv_transfer_params` from the prefill side, `do_remote_prefill: True`): the scheduler
half offers `remote_num_tokens - aligned` tokens as an async load (the decode side's own prefix hit
`aligned` trims the pull, §5.2); the worker half handshakes (gRPC, cached per peer), posts one NIXL READ
over the prepared descriptor lists (views.py), zero-fills what it did not receive (§5.5) and reports
`finished_recving`; the engine recomputes the last prompt token. Any fault — handshake, post, transfer
error, timeout, expired pages — is `failed_recving`: the engine recomputes, the request is not lost.

Heterogeneous TP (§5.4): a multi-rank prefill worker's ranks each register their own pages with their
own agent (workers/engine/parallel/launcher.py) and rank 0's handshake names them all; a decode rank
posts one READ per prefill rank it needs (k3serve/common/pd_geometry.py: MLA from one rank, each
rank's KDA head slices into their offsets of the local page). A multi-rank decode worker runs one
worker half per rank (ranks 1.. in their own processes, workers/engine/parallel/launcher.py): each pulls
its own share into its own pages and reports the outcome to rank 0, which settles the request only when
every rank's READs have ended (pulled if all succeeded, else recomputed). With one READ in all the
notification rides on it; otherwise rank 0 notifies the prefill side on its own once every READ of every
rank is DONE, so no prefill rank frees pages another READ is still reading.

A DEP prefill worker (workers/kv_transfer/dp_group.py): every data-parallel rank is its own engine with
its own connector; a request's `remote_engine_id` names the rank holding its pages, and the decode side
reads that rank's agent (handshake.py `Peer.ranks_of`), whose notification frees the pages there.

`TransferLedger` (shared by the halves, read by the gRPC layer) records each decode request's outcome
(KvTransferResult in worker.proto) and feeds the transfer metrics.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field

from k3serve.common.pd_geometry import PDGeometryError, plan_pd_mapping
from k3serve.workers.engine.kv_connector.base import (
    NO_MATCH,
    BlockIds,
    ConnectorContext,
    ConnectorKind,
    FinishResult,
    KVConnector,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
    LoadSpec,
    MatchResult,
)
from k3serve.workers.kv_transfer.compat import (
    IncompatiblePeer,
    compatibility_factors,
    compatibility_hash,
)

log = logging.getLogger(__name__)

DEFAULT_EXPIRY_S = 120.0
DEFAULT_TIMEOUT_S = 10.0
MAX_OUTCOMES = 10_000
REPORT_WAIT_S = 0.05  # rank 0 of a multi-rank decode worker: longest wait for the other ranks' reports per step
POISON_ENV = "K3SERVE_KV_POISON_FREE_PAGES"  # tests: fill every free page with 0xFF at start


def _opt(ctx: ConnectorContext, name: str, default):
    """An option: `extra_config[name]` (connectors built by hand), else the EngineArgs field, else default."""
    if name in ctx.extra_config:
        return ctx.extra_config[name]
    v = getattr(getattr(ctx, "args", None), name, None)
    return default if v is None else v


def _fingerprint(ctx: ConnectorContext) -> bytes:
    fp = ctx.model_fingerprint
    if fp and any(fp):
        return fp
    model = _opt(ctx, "model", None)
    if model:
        from k3serve.common.block_hash import model_fingerprint

        return model_fingerprint(model)
    raise ValueError("the NIXL connector needs the model fingerprint (the model directory)")


def prompt_hash(token_ids, cache_salt: str | None) -> bytes:
    """What the prefill side computed: the salt and the exact token ids (KvTransferParams.remote_prompt_hash)."""
    import hashlib
    import struct

    salt = (cache_salt or "").encode()
    h = hashlib.sha256(b"k3serve/pd-prompt/v1\0" + struct.pack("<I", len(salt)) + salt)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.digest()


# -- the ledger: per-request outcomes + metrics -------------------------------------------------

@dataclass
class Outcome:
    outcome: str = "recomputed"  # pulled | cached | recomputed
    reason: str = ""
    pulled_tokens: int = 0
    local_cached_tokens: int = 0
    bytes: int = 0

    def as_dict(self) -> dict:
        return dict(outcome=self.outcome, reason=self.reason, pulled_tokens=self.pulled_tokens,
                    local_cached_tokens=self.local_cached_tokens, bytes=self.bytes)


class TransferLedger:
    """Outcomes by request id (written on the engine thread, popped by the gRPC layer) and counters."""

    def __init__(self):
        self._lock = threading.Lock()
        self.outcomes: dict[str, Outcome] = {}
        self.metrics = None  # workers/kv_transfer/metrics.py TransferMetrics, attached by the worker
        self.counts: dict[str, float] = {}

    def _count(self, key: str, n: float = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def record(self, request_id: str, out: Outcome, *, seconds: float | None = None,
               bytes_by_view: dict | None = None) -> None:
        with self._lock:
            self.outcomes.pop(request_id, None)
            self.outcomes[request_id] = out
            while len(self.outcomes) > MAX_OUTCOMES:  # outcomes nobody collected (aborted calls)
                self.outcomes.pop(next(iter(self.outcomes)))
            self._count(f"outcome_{out.outcome}")
            if out.outcome == "recomputed":
                self._count(f"fallback_{out.reason}")
            for view, n in (bytes_by_view or {}).items():
                self._count(f"bytes_{view}", n)
        if self.metrics is not None:
            self.metrics.observe(out, seconds, bytes_by_view or {})

    def pop(self, request_id: str) -> dict | None:
        with self._lock:
            o = self.outcomes.pop(request_id, None)
        return o.as_dict() if o else None


# -- scheduler half -----------------------------------------------------------------------------

@dataclass
class PullJob:
    request_id: str
    params: dict
    spec: LoadSpec


@dataclass
class NixlMeta(KVConnectorMetadata):
    pulls: list[PullJob] = field(default_factory=list)


class NixlScheduler(KVConnectorScheduler):
    kind = ConnectorKind.TRANSFER
    name = "nixl"
    stats_prefix = "kv_transfer_"

    def __init__(self, ctx: ConnectorContext, ledger: TransferLedger, factors: dict):
        super().__init__(ctx)
        self.ledger = ledger
        self.factors = factors
        self.hash = compatibility_hash(factors)
        self.expiry_s = float(_opt(ctx, "kv_transfer_expiry", DEFAULT_EXPIRY_S))
        self.timeout_s = float(_opt(ctx, "kv_transfer_timeout", DEFAULT_TIMEOUT_S))
        self.tp_size = int(_opt(ctx, "tensor_parallel_size", 1))
        self._pulls: list[PullJob] = []
        self._pulled: dict[tuple, None] = {}  # (engine id, request id) of parameters already used (bounded)
        self.worker_half: NixlWorker | None = None  # set by make_nixl_connector (same process)

    def check_remote_geometry(self, remote_tp: int, remote_block: int) -> None:
        """PDGeometryError when a prefill pool of this TP size and block size cannot feed this rank."""
        import dataclasses

        g = self.worker_half.geometry.side()
        remote = dataclasses.replace(g, tp_size=remote_tp, block_size=remote_block)
        for rank in range(g.tp_size):  # every decode rank reads its own share
            plan_pd_mapping(remote, g, rank)

    # decode side -------------------------------------------------------------------------------
    def _refuse(self, req, reason: str, aligned: int) -> MatchResult:
        self.ledger.record(req.request_id, Outcome("recomputed", reason, local_cached_tokens=aligned))
        return NO_MATCH

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> MatchResult:
        p = request.kv_transfer_params
        if not p or not p.get("do_remote_prefill") or request.kv_load_failed:
            return NO_MATCH
        n = int(p.get("remote_num_tokens", 0))
        aligned = num_computed_tokens
        if n == 0:
            return self._refuse(request, "nothing_to_pull", aligned)
        # the pages must be this prompt's: a router that mixed requests up must not leak another's state
        if n > len(request.prompt_token_ids) - 1 or bytes(p.get("remote_prompt_hash", b"")) != prompt_hash(
                request.prompt_token_ids[:n], request.cache_salt):
            return self._refuse(request, "prompt_mismatch", aligned)
        if n <= aligned:
            self.ledger.record(request.request_id, Outcome("cached", "", 0, aligned))
            return NO_MATCH
        if bytes(p.get("compatibility_hash", b"")) != self.hash:
            return self._refuse(request, "incompatible", aligned)
        # transfer parameters are single-use: the first pull's notification releases the prefill's pages
        if (p.get("remote_engine_id"), p.get("remote_request_id")) in self._pulled:
            return self._refuse(request, "already_pulled", aligned)
        # never start a pull the prefill side may free while it runs
        if time.time() + self.timeout_s >= float(p.get("remote_blocks_expiry_time", 0)):
            return self._refuse(request, "expired", aligned)
        pb = int(p.get("block_size", 0))
        if pb <= 0 or self.ctx.layout.block_size % pb or aligned % pb:
            return self._refuse(request, "geometry", aligned)
        return MatchResult(n - aligned, is_async=True)

    def update_state_after_alloc(self, request, spec: LoadSpec) -> None:
        if spec.num_external_tokens > 0:
            p = request.kv_transfer_params
            self._pulled[(p.get("remote_engine_id"), p.get("remote_request_id"))] = None
            while len(self._pulled) > MAX_OUTCOMES:
                self._pulled.pop(next(iter(self._pulled)))
            self._pulls.append(PullJob(request.request_id, dict(p), spec))

    def build_connector_meta(self, step: int) -> NixlMeta:
        pulls, self._pulls = self._pulls, []
        return NixlMeta(step=step, pulls=pulls)

    # prefill side ------------------------------------------------------------------------------
    def request_finished(self, request, block_ids: BlockIds) -> FinishResult:
        p = request.kv_transfer_params
        if not p or not p.get("do_remote_decode") or request.status.value == "abort":
            return FinishResult()
        L = self.ctx.layout
        n = len(request.prompt_token_ids)
        if request.num_computed_tokens < n:
            return FinishResult()
        groups = []
        for g in L.groups:
            ids = list(block_ids[g.group_id])
            if g.kind == "mla":
                ids = ids[: math.ceil(n / L.block_size)]
            groups.append(dict(group_id=g.group_id, kind=g.kind, block_ids=ids))
        params = dict(remote_prompt_hash=prompt_hash(request.prompt_token_ids[:n], request.cache_salt),
                      remote_engine_id=self.ctx.engine_id, remote_request_id=request.request_id,
                      remote_block_ids=groups, remote_num_tokens=n,
                      remote_blocks_expiry_time=time.time() + self.expiry_s, tp_size=self.tp_size,
                      block_size=L.block_size, compatibility_hash=self.hash)
        return FinishResult(delay_free=True, transfer_params=params, expiry_s=self.expiry_s)

    def stats(self) -> dict[str, float]:
        return dict(self.ledger.counts)


# -- worker half --------------------------------------------------------------------------------

@dataclass
class _InFlight:
    job: PullJob
    xfer: object
    t0: float
    deadline: float
    plan: object  # RequestPlan of the first READ (bytes_by_view: all of them)
    zero: tuple  # (mla_loaded, received_tokens, kda_blocks, local sides)
    host: str
    port: int
    more: list = field(default_factory=list)  # the other READs (one per further prefill rank)
    notify: tuple | None = None  # (agent, message): sent once every READ is DONE

    def state(self) -> str:
        """PROC while any READ runs; else DONE if all are DONE, ERR otherwise."""
        states = [x.poll() for x in (self.xfer, *self.more)]
        if "PROC" in states:
            return "PROC"
        return "DONE" if all(st == "DONE" for st in states) else "ERR"

    def release(self) -> None:
        for x in (self.xfer, *self.more):
            x.release()


class NixlWorker(KVConnectorWorker):
    def __init__(self, ctx: ConnectorContext, ledger: TransferLedger, factors: dict):
        super().__init__(ctx)
        self.ledger = ledger
        self.factors = factors
        self.devices = _opt(ctx, "kv_transfer_devices", None) or None
        self.timeout_s = float(_opt(ctx, "kv_transfer_timeout", DEFAULT_TIMEOUT_S))
        self.tp_size, self.tp_rank = int(_opt(ctx, "tensor_parallel_size", 1)), int(_opt(ctx, "tp_rank", 0))
        self.agent = None
        self.peers = None
        self.geometry = None
        self.bases: list[int] = []
        self.other_ranks: list = []  # RankEndpoints of ranks 1.. (a multi-rank prefill worker)
        self.dp_ranks: list = []  # RankEndpoints of data-parallel ranks 1.. (a DEP worker's rank 0: dp_group.py)
        self._local: dict[tuple, object] = {}  # (ratio, parts, source) -> (DescriptorSide, prepped handle)
        self._inflight: list[_InFlight] = []
        self._failed: set[str] = set()
        self._handshakes: list = []  # (job, future of fetch_metadata, host, port)
        self._pool = None
        self._metadata = b""  # our agent's metadata, read once after registration (gRPC threads serve it)
        # rank 0 of a multi-rank decode worker: a request is settled once every rank's share has ended
        self._group = self.tp_size > 1 and self.tp_rank == 0
        self._reports = None  # () -> [(rank, {"done": [...], "failed": [...]})] from the other ranks
        self._own: dict[str, tuple] = {}  # rid -> (ok, Outcome, seconds, bytes_by_view, notify)
        self._others: dict[str, dict[int, bool]] = {}
        self._other_bytes: dict[str, dict[str, int]] = {}  # rid -> bytes by view the other ranks pulled
        self._done: set[str] = set()
        self.pulled_bytes: dict[str, dict[str, int]] = {}  # ranks 1..: bytes by view of each pull, until reported

    # setup -------------------------------------------------------------------------------------
    def register_kv_caches(self, kv) -> None:
        from k3serve.workers.kv_transfer.agent import TransferAgent
        from k3serve.workers.kv_transfer.handshake import PeerCache
        from k3serve.workers.kv_transfer.views import PageGeometry

        super().register_kv_caches(kv)
        if os.environ.get(POISON_ENV):
            for t in kv.pages:
                t[1:].fill_(0xFF)  # block 0 is the null block: every other page is free now
        self.agent = TransferAgent(f"k3serve-{self.ctx.engine_id}", devices=self.devices)
        self.bases = [t.data_ptr() for t in kv.pages]
        self.agent.register([(t.data_ptr(), t.numel() * t.element_size()) for t in kv.pages],
                            "VRAM" if str(self.ctx.device).startswith("cuda") else "DRAM")
        self.geometry = PageGeometry.of(self.ctx.layout, kv.num_blocks, self.tp_size, self.tp_rank)
        # the other ranks' agents over their own pages (workers/engine/parallel/launcher.py)
        self.other_ranks = list(getattr(kv, "transfer_ranks", ()))
        self._reports = getattr(kv, "transfer_reports", None)
        self.peers = PeerCache(self.agent, self.factors)
        self._metadata = self.agent.metadata()

    def transfer_metadata(self, pb, request):
        """Answer GetTransferMetadata (gRPC thread). Raises IncompatiblePeer on a hash mismatch."""
        import json

        from k3serve.workers.kv_transfer.compat import check_compatible
        from k3serve.workers.kv_transfer.handshake import metadata_response

        if self.agent is None:
            raise RuntimeError("the transfer agent is not started yet")
        theirs = json.loads(request.compatibility_factors) if request.compatibility_factors else None
        check_compatible(self.factors, request.compatibility_hash, theirs)
        return metadata_response(pb, engine_id=self.ctx.engine_id, factors=self.factors, agent_name=self.agent.name,
                                 agent_metadata=self._metadata, bases=self.bases, geometry=self.geometry,
                                 other_ranks=self.other_ranks, dp_ranks=self.dp_ranks)

    # decode side -------------------------------------------------------------------------------
    def _sides(self, peer, engine_id: str):
        """(mapping, [(source rank, (local side, handle), (remote side, handle))]): one per prefill rank
        this rank reads, the MLA source first (its READ also carries the MLA view); `engine_id`: the engine
        that pinned the pages (a DEP peer's data-parallel rank, handshake.py Peer.ranks_of)."""
        from k3serve.workers.kv_transfer.views import DescriptorSide

        mapping = plan_pd_mapping(peer.geometry.side(), self.geometry.side(), self.tp_rank)
        ranks = peer.ranks_of(engine_id)
        srcs = [mapping.mla_src_rank] + [r for r in mapping.kda_src_ranks if r != mapping.mla_src_rank]
        if not self.geometry.has_kda:
            srcs = srcs[:1]
        missing = [r for r in srcs if r not in ranks]
        if missing:
            raise PDGeometryError(f"this decode rank reads prefill ranks {srcs}; the peer's metadata lacks {missing}")
        sub = peer.geometry.block_size * peer.geometry.mla_token_bytes
        out = []
        for src in srcs:
            mla = src == mapping.mla_src_rank
            key = (mapping.block_ratio, sub, mapping.kda_reads, src)
            if key not in self._local:
                side = DescriptorSide(self.geometry, self.bases, mapping, sub, local=True, src_rank=src, with_mla=mla)
                self._local[key] = (side, self.agent.prep_local(side.descs) if len(side.descs) else None)
            rkey = ("remote", engine_id if peer.dp_ranks else "", src)
            if rkey not in peer.prepared:
                name, bases, geom = ranks[src]
                rside = DescriptorSide(geom, bases, mapping, sub, local=False, src_rank=src, with_mla=mla)
                peer.prepared[rkey] = self.agent.prep_remote(name, rside.descs)
                if peer.remote_side is None:
                    peer.remote_side = {}
                peer.remote_side[rkey] = rside
            out.append((src, self._local[key], (peer.remote_side[rkey], peer.prepared[rkey])))
        return mapping, out

    def pending(self) -> bool:
        """Whether a pull of this rank is still running (a handshake or a READ)."""
        return bool(self._inflight or self._handshakes)

    def _fail(self, job: PullJob, reason: str, detail: str = "") -> None:
        log.warning("KV pull for %s fell back to recompute (%s%s)", job.request_id, reason,
                    f": {detail}" if detail else "")
        self._result(job.request_id, False, Outcome("recomputed", reason, 0, job.spec.num_local_tokens))

    def _result(self, rid: str, ok: bool, outcome: Outcome, seconds=None, bytes_by_view=None, notify=None) -> None:
        """This rank's share of a pull ended; a single rank (or ranks 1..) settles it now, rank 0 of a group
        once every rank reported."""
        if not self._group:
            (self._done if ok else self._failed).add(rid)
            self.ledger.record(rid, outcome, seconds=seconds, bytes_by_view=bytes_by_view)
            if ok and self.tp_rank > 0:
                self.pulled_bytes[rid] = dict(bytes_by_view or {})
            return
        self._own[rid] = (ok, outcome, seconds, bytes_by_view, notify, time.monotonic())
        self._settle(rid)

    def _settle(self, rid: str) -> None:
        from k3serve.workers.kv_transfer.agent import TransferError

        others = self._others.get(rid, {})
        if rid not in self._own or len(others) < self.tp_size - 1:
            return
        ok, outcome, seconds, nbytes, notify, t_own = self._own.pop(rid)
        self._others.pop(rid, None)
        if seconds is not None:  # the pull lasts until the last rank's share is in
            seconds += time.monotonic() - t_own
        if ok and all(others.values()):
            for view, n in self._other_bytes.pop(rid, {}).items():  # the whole request's bytes, every rank's
                nbytes = dict(nbytes or {})
                nbytes[view] = nbytes.get(view, 0) + n
                outcome.bytes += n
            if notify is not None:
                try:
                    self.agent.notify(*notify)
                except TransferError as e:  # the pages were read; the prefill side frees them at expiry
                    log.warning("could not confirm the pull of %s to its prefill worker: %s", rid, e)
            self._done.add(rid)
            self.ledger.record(rid, outcome, seconds=seconds, bytes_by_view=nbytes)
            return
        if ok:  # another rank's share failed: the pages are not all there
            bad = sorted(r for r, good in others.items() if not good)
            log.warning("KV pull for %s fell back to recompute: rank(s) %s could not pull their share", rid, bad)
            outcome = Outcome("recomputed", "transfer_failed", 0, outcome.local_cached_tokens)
        self._other_bytes.pop(rid, None)
        self._failed.add(rid)
        self.ledger.record(rid, outcome)

    def _poll_reports(self) -> None:
        if not self._group or self._reports is None:
            return
        # ranks' shares that ended this step are reported right after it: wait a little for them rather
        # than a whole idle cycle of the engine (0.25 s) when this rank's own share is already in
        for rank, rep in self._reports(REPORT_WAIT_S if self._own else 0.0):
            for rid, views in rep.get("bytes", {}).items():
                acc = self._other_bytes.setdefault(rid, {})
                for view, n in views.items():
                    acc[view] = acc.get(view, 0) + int(n)
            for rid, good in [(r, True) for r in rep.get("done", ())] + [(r, False) for r in rep.get("failed", ())]:
                self._others.setdefault(rid, {})[rank] = good
                self._settle(rid)
        # a rank that never answers (its handshake ends within HANDSHAKE_TIMEOUT_S, its READs within 3
        # timeouts of their post: get_finished below): the request must not wait forever; its pages are
        # recomputed once no READ can still write them
        from k3serve.workers.kv_transfer.handshake import HANDSHAKE_TIMEOUT_S

        late = time.monotonic() - (4 * self.timeout_s + HANDSHAKE_TIMEOUT_S)
        for rid in [r for r, own in self._own.items() if own[-1] < late]:
            others = self._others.setdefault(rid, {})
            missing = [r for r in range(1, self.tp_size) if r not in others]
            log.warning("KV pull for %s: rank(s) %s never reported their share", rid, missing)
            for r in missing:
                others[r] = False
            self._settle(rid)

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Post each pull whose peer is known; fetch unknown peers' metadata off the engine thread."""
        from k3serve.workers.kv_transfer.handshake import fetch_metadata

        for job in getattr(meta, "pulls", []):
            p = job.params
            host, port = p.get("remote_host", ""), int(p.get("remote_port", 0))
            peer = self.peers.cached(host, port, p.get("remote_engine_id", ""))
            if peer is not None:
                self._post(job, peer, host, port)
                continue
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-handshake")
            fut = self._pool.submit(fetch_metadata, f"{host}:{port}", self.factors, self.peers.timeout_s)
            self._handshakes.append((job, fut, host, port))

    def _poll_handshakes(self) -> None:
        from k3serve.workers.kv_transfer.handshake import PeerUnreachable

        waiting = []
        for job, fut, host, port in self._handshakes:
            if not fut.done():
                waiting.append((job, fut, host, port))
                continue
            try:
                peer = self.peers.install(host, port, job.params.get("remote_engine_id", ""), fut.result())
            except IncompatiblePeer as e:
                self._fail(job, "incompatible", str(e))
                continue
            except PeerUnreachable as e:
                self._fail(job, "peer_unreachable", str(e))
                continue
            except Exception as e:  # noqa: BLE001 - any handshake fault costs a recompute, never the request
                self._fail(job, "peer_unreachable", repr(e))
                continue
            self._post(job, peer, host, port)
        self._handshakes = waiting

    def _post(self, job: PullJob, peer, host: str, port: int) -> None:
        from k3serve.workers.kv_transfer.agent import TransferError
        from k3serve.workers.kv_transfer.views import plan_request

        p, spec = job.params, job.spec
        engine_id = str(p.get("remote_engine_id", ""))
        try:
            mapping, sides = self._sides(peer, engine_id)
        except PDGeometryError as e:
            self._fail(job, "geometry", str(e))
            return
        L, E = spec.num_local_tokens, spec.num_external_tokens
        n = L + E
        Bp = peer.geometry.block_size
        layout = self.ctx.layout
        mla_pairs, mla_loaded, kda_pairs = {}, {}, {}
        notif = str(p.get("remote_request_id", "")).encode()
        lone = len(sides) == 1 and self.tp_size == 1  # the only READ of the pull: it carries the notification
        posted = []
        try:
            remote_groups = {int(g["group_id"]): list(g["block_ids"]) for g in p.get("remote_block_ids", [])}
            for g in layout.groups:
                rb = remote_groups[g.group_id]
                if g.kind == "mla":
                    pblocks = rb[L // Bp: math.ceil(n / Bp)]
                    dblocks = spec.load_block_ids(layout, g.group_id)
                    mla_pairs[g.group_id] = mapping.mla_block_pairs(pblocks, dblocks)
                    mla_loaded[g.group_id] = dblocks
                else:
                    kda_pairs[g.group_id] = (rb[0], spec.block_ids[g.group_id][0])
            plans = []
            for i, (_src, (lside, _lh), (rside, _rh)) in enumerate(sides):
                plans.append(plan_request(lside, rside, self.geometry.groups, mla_pairs if i == 0 else {}, kda_pairs))
            for (_src, (_ls, lh), (_rs, rh)), plan in zip(sides, plans):
                if plan.num_descriptors:
                    posted.append(self.agent.read(lh, plan.local_ids, rh, plan.remote_ids,
                                                  notif=notif if lone else b""))
        except (KeyError, IndexError, PDGeometryError) as e:
            self._release_posted(posted)
            self._fail(job, "geometry", f"transfer parameters do not fit this layout: {e!r}")
            return
        except TransferError as e:
            self._release_posted(posted)
            self.peers.drop(host, port)
            self._fail(job, "transfer_failed", str(e))
            return
        if not posted:
            self._fail(job, "nothing_to_pull")
            return
        total = dict.fromkeys(plans[0].bytes_by_view, 0)
        for plan in plans:
            for view, nb in plan.bytes_by_view.items():
                total[view] += nb
        plans[0].bytes_by_view = total
        notify = None
        if not lone and self.tp_rank == 0:  # the prefill worker's rank 0 frees the pages: tell it once every READ is over
            notify = (peer.ranks_of(engine_id)[0][0], notif)
        now = time.monotonic()
        self._inflight.append(_InFlight(job, posted[0], now, now + self.timeout_s, plans[0],
                                        (mla_loaded, E, kda_pairs, [s[1][0] for s in sides]), host, port,
                                        posted[1:], notify))

    def _release_posted(self, posted) -> None:
        """READs already posted when a later one could not be: wait them out (they write into our pages)."""
        deadline = time.monotonic() + self.timeout_s
        for x in posted:
            while x.poll() == "PROC" and time.monotonic() < deadline:
                time.sleep(0.001)
            x.release()

    def get_finished(self) -> KVConnectorOutput:
        from k3serve.workers.kv_transfer.agent import TransferError
        from k3serve.workers.kv_transfer.views import zero_unreceived

        self._poll_handshakes()
        self._poll_reports()
        out = KVConnectorOutput()
        still = []
        for f in self._inflight:
            state = f.state()
            if state == "PROC":
                if time.monotonic() < f.deadline:
                    still.append(f)
                    continue
                # timed out: the READ may still write into these pages, so keep them until it ends
                if time.monotonic() < f.deadline + 2 * self.timeout_s:
                    still.append(f)
                    continue
                state = "TIMEOUT"
            f.release()
            rid = f.job.request_id
            notify = f.notify
            if state == "DONE" and notify is not None and not self._group:
                try:
                    self.agent.notify(*notify)
                except TransferError as e:  # the pages were read; the prefill side frees them at expiry
                    log.warning("could not confirm the pull of %s to its prefill worker: %s", rid, e)
                notify = None
            if state == "DONE":
                mla_loaded, received, kda_pairs, lside = f.zero
                zero_unreceived(self.kv.pages, self.geometry, lside, mla_loaded, received,
                                {g: d for g, (_p, d) in kda_pairs.items()})
                self._result(rid, True, Outcome("pulled", "", f.job.spec.num_external_tokens,
                                                f.job.spec.num_local_tokens, sum(f.plan.bytes_by_view.values())),
                             seconds=time.monotonic() - f.t0, bytes_by_view=f.plan.bytes_by_view, notify=notify)
            else:
                self.peers.drop(f.host, f.port)
                self._result(rid, False, Outcome("recomputed", "timeout" if state == "TIMEOUT" else "transfer_failed",
                                                 0, f.job.spec.num_local_tokens))
        self._inflight = still
        out.finished_recving, self._done = self._done, set()
        out.failed_recving, self._failed = self._failed, set()
        # prefill side: the decode side's READs completed (their notification names our request id)
        if self.agent is not None:
            for msgs in self.agent.notifs().values():
                for m in msgs:
                    out.finished_sending.add(m.decode(errors="replace"))
        out.stats = dict(self.ledger.counts)
        return out

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        for f in self._inflight:
            f.release()
        self._inflight = []
        if self.agent is not None:
            self.agent.close()


@dataclass
class NixlConnector(KVConnector):
    ledger: TransferLedger = None  # type: ignore[assignment]
    factors: dict = None  # type: ignore[assignment]


def make_nixl_connector(ctx: ConnectorContext) -> NixlConnector:
    """Factory (workers/engine/kv_connector/factory.py name "nixl")."""
    factors = compatibility_factors(ctx.layout, _fingerprint(ctx), int(_opt(ctx, "tensor_parallel_size", 1)))
    ledger = TransferLedger()
    sched, worker = NixlScheduler(ctx, ledger, factors), NixlWorker(ctx, ledger, factors)
    sched.worker_half = worker
    return NixlConnector(scheduler=sched, worker=worker, ledger=ledger, factors=factors)
