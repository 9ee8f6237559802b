"""Handshake over the worker's own gRPC (`GetTransferMetadata`), never NIXL's listener (design doc §5.3).

`fetch_metadata` asks a prefill worker for its metadata and checks the compatibility hash first
(IncompatiblePeer names the differing invariants); it makes no NIXL call, so the connector runs it off
the engine thread. `PeerCache` (engine thread) installs the peer's NIXL agent once per (host, port) and
keeps it until the peer's engine id changes (a restart: refetch, old agent removed) or a transfer from
it fails (`drop`).

A multi-rank (tensor-parallel) prefill worker answers for all its ranks at once: rank 0 in the
response's own fields, ranks 1..tp_size-1 in `other_ranks` (each rank registered its own pages with
its own agent, workers/engine/parallel/launcher.py); `Peer.ranks` holds every rank's endpoint, and a
response that does not name each rank exactly once is refused (IncompatiblePeer).

A DEP worker (data-parallel ranks, each a whole engine with its own pages, attention TP=1) answers for its
data-parallel ranks the same way: rank 0 in the response's own fields, ranks 1..M-1 in `dp_ranks`, each with
its engine id (workers/kv_transfer/dp_group.py). A request's transfer parameters name the engine that
pinned its pages (`remote_engine_id`), so the decode side reads from that rank (`Peer.ranks_of`); the peer
stays cached while a request names any of its ranks' engines.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from dataclasses import dataclass

from k3serve.workers.kv_transfer.compat import (
    IncompatiblePeer,
    canonical,
    check_compatible,
    compatibility_hash,
)
from k3serve.workers.kv_transfer.views import PageGeometry

log = logging.getLogger(__name__)
HANDSHAKE_TIMEOUT_S = 5.0


class PeerUnreachable(RuntimeError):
    """The prefill worker did not answer the handshake (the caller recomputes)."""


@dataclass(frozen=True)
class RankEndpoint:
    """One rank's registered pages, as another agent reads them."""

    tp_rank: int
    agent_name: str  # as published (the metadata's own name)
    agent_metadata: bytes
    bases: tuple[int, ...]  # per layer position j: address of this rank's page tensor j
    engine_id: str = ""  # a data-parallel rank's own engine (dp_ranks entries)
    dp_rank: int = 0

    def to_plain(self) -> dict:
        """JSON-safe (a rank reports it to rank 0 over a pipe or, from another node, as JSON)."""
        return dict(tp_rank=self.tp_rank, agent_name=self.agent_name, agent_metadata=self.agent_metadata.hex(),
                    bases=[int(b) for b in self.bases], engine_id=self.engine_id, dp_rank=self.dp_rank)

    @classmethod
    def from_plain(cls, d: dict) -> RankEndpoint:
        return cls(int(d["tp_rank"]), str(d["agent_name"]), bytes.fromhex(d["agent_metadata"]),
                   tuple(int(b) for b in d["bases"]), str(d.get("engine_id", "")), int(d.get("dp_rank", 0)))


@dataclass
class Peer:
    address: str  # host:port of its gRPC
    engine_id: str
    agent_name: str
    bases: list[int]
    geometry: PageGeometry
    factors: dict
    prepared: dict  # connector-owned: prepared dlists for this peer
    remote_side: object = None  # connector-owned: the peer's DescriptorSide
    ranks: dict = None  # tp_rank -> (agent name as installed here, bases, PageGeometry); rank 0 included
    dp_ranks: dict = None  # a DEP peer's ranks 1..: engine id -> its `ranks` dict (one TP rank each)

    def engine_ids(self) -> set[str]:
        return {self.engine_id, *(self.dp_ranks or {})}

    def ranks_of(self, engine_id: str) -> dict:
        """The ranks holding the pages of a request pinned by `engine_id` (a DEP peer's rank; else ours)."""
        if self.dp_ranks and engine_id in self.dp_ranks:
            return self.dp_ranks[engine_id]
        return self.ranks or {0: (self.agent_name, self.bases, self.geometry)}


def rank_endpoints(resp) -> dict[int, RankEndpoint]:
    """Every rank of a TransferMetadataResponse; IncompatiblePeer unless ranks 0..tp_size-1 appear once each."""
    eps = {0: RankEndpoint(0, resp.agent_name, bytes(resp.agent_metadata), tuple(resp.region_base_addrs))}
    for r in resp.other_ranks:
        if r.tp_rank in eps:
            raise IncompatiblePeer(f"transfer metadata names tensor-parallel rank {r.tp_rank} twice")
        eps[r.tp_rank] = RankEndpoint(r.tp_rank, r.agent_name, bytes(r.agent_metadata), tuple(r.region_base_addrs))
    want = set(range(max(int(resp.tp_size), 1)))
    if set(eps) != want or int(resp.tp_rank) != 0:
        raise IncompatiblePeer(f"transfer metadata of a tensor-parallel size {resp.tp_size} worker describes ranks "
                               f"{sorted(eps)} (answered by rank {resp.tp_rank}); it must be ranks 0..{resp.tp_size - 1}"
                               ", answered by rank 0")
    for ep in eps.values():
        if len(ep.bases) != len(eps[0].bases):
            raise IncompatiblePeer(f"rank {ep.tp_rank} registered {len(ep.bases)} page tensors, rank 0 "
                                   f"{len(eps[0].bases)}")
    return eps


def dp_endpoints(resp) -> dict[str, RankEndpoint]:
    """A DEP worker's data-parallel ranks 1..M-1 by engine id; IncompatiblePeer unless each rank and each
    engine id (rank 0's included) appears once."""
    out: dict[str, RankEndpoint] = {}
    seen = set()
    for r in resp.dp_ranks:
        if r.dp_rank in seen or r.dp_rank == 0 or not r.engine_id or r.engine_id in out \
                or r.engine_id == resp.engine_id:
            raise IncompatiblePeer(f"transfer metadata names data-parallel rank {r.dp_rank} (engine "
                                   f"{r.engine_id!r}) twice, as rank 0, or without an engine id")
        seen.add(r.dp_rank)
        out[r.engine_id] = RankEndpoint(0, r.agent_name, bytes(r.agent_metadata), tuple(r.region_base_addrs),
                                        r.engine_id, r.dp_rank)
    if seen and seen != set(range(1, len(seen) + 1)):
        raise IncompatiblePeer(f"transfer metadata of a data-parallel worker names ranks {sorted(seen)}; "
                               f"it must be ranks 1..{len(seen)}")
    if seen and int(resp.tp_size) != 1:
        raise IncompatiblePeer("transfer metadata names data-parallel ranks of a tensor-parallel worker "
                               f"(tp_size {resp.tp_size}); DEP attention runs at TP=1")
    return out


def metadata_response(pb, *, engine_id: str, factors: dict, agent_name: str, agent_metadata: bytes,
                      bases: list[int], geometry: PageGeometry, other_ranks=(), dp_ranks=()):
    """The TransferMetadataResponse a worker answers with (`pb`: k3serve.proto.worker_pb2); `other_ranks`:
    RankEndpoints of ranks 1.. of a multi-rank worker; `dp_ranks`: those of a DEP worker's ranks 1..M-1."""
    others = [pb.TransferRankMetadata(tp_rank=e.tp_rank, agent_name=e.agent_name, agent_metadata=e.agent_metadata,
                                      region_base_addrs=[int(b) for b in e.bases]) for e in other_ranks]
    dps = [pb.TransferRankMetadata(agent_name=e.agent_name, agent_metadata=e.agent_metadata, engine_id=e.engine_id,
                                   dp_rank=e.dp_rank, region_base_addrs=[int(b) for b in e.bases]) for e in dp_ranks]
    return pb.TransferMetadataResponse(other_ranks=others, dp_ranks=dps,
        engine_id=engine_id, compatibility_hash=compatibility_hash(factors), compatibility_factors=canonical(factors),
        agent_name=agent_name, agent_metadata=agent_metadata, region_base_addrs=[int(b) for b in bases],
        num_blocks=geometry.num_blocks, page_bytes=geometry.page_bytes, block_size=geometry.block_size,
        tp_size=geometry.tp_size, tp_rank=geometry.tp_rank, layout=geometry.to_json())


def fetch_metadata(addr: str, factors: dict, timeout_s: float = HANDSHAKE_TIMEOUT_S):
    """GetTransferMetadata from `addr`, compatibility checked (any thread: no NIXL call).
    Raises IncompatiblePeer (the message names the difference) or PeerUnreachable."""
    import grpc

    from k3serve.proto import worker_pb2 as pb
    from k3serve.proto import worker_pb2_grpc as pb_grpc

    req = pb.TransferMetadataRequest(compatibility_hash=compatibility_hash(factors),
                                     compatibility_factors=canonical(factors))
    try:
        with grpc.insecure_channel(addr) as ch:
            resp = pb_grpc.WorkerStub(ch).GetTransferMetadata(req, timeout=timeout_s)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
            raise IncompatiblePeer(e.details()) from None
        raise PeerUnreachable(f"handshake with {addr} failed: {e.code().name}: {e.details()}") from None
    theirs = json.loads(resp.compatibility_factors) if resp.compatibility_factors else None
    check_compatible(factors, resp.compatibility_hash, theirs)
    return resp


class PeerCache:
    def __init__(self, agent, factors: dict, timeout_s: float = HANDSHAKE_TIMEOUT_S):
        self.agent = agent
        self.factors = factors
        self.timeout_s = timeout_s
        self.peers: dict[str, Peer] = {}
        self.fetches = 0
        self._lock = threading.Lock()

    def cached(self, host: str, port: int, engine_id: str) -> Peer | None:
        """The cached peer if it still runs `engine_id`; a restarted peer's entry is dropped (engine thread)."""
        addr = f"{host}:{port}"
        with self._lock:
            p = self.peers.get(addr)
            if p is not None and engine_id in p.engine_ids():
                return p
            if p is not None:  # restarted (new engine id): forget the old agent
                self._drop_locked(addr)
        return None

    def install(self, host: str, port: int, engine_id: str, resp) -> Peer:
        """Add a fetched peer's NIXL agent (engine thread: the agent is not shared with other threads)."""
        addr = f"{host}:{port}"
        dps = dp_endpoints(resp)
        if engine_id != resp.engine_id and engine_id not in dps:
            raise PeerUnreachable(f"{addr} now runs engine {resp.engine_id}, not {engine_id} (it restarted: "
                                  "the pages of this request are gone)")
        with self._lock:
            old = self.peers.get(addr)
            if old is not None and old.engine_id == resp.engine_id:
                return old
            if old is not None:
                self._drop_locked(addr)
            eps = rank_endpoints(resp)
            geom = PageGeometry.from_json(resp.layout)
            ranks, by_engine = {}, {}
            try:
                for r, ep in sorted(eps.items()):
                    ranks[r] = (self.agent.add_peer(ep.agent_metadata), list(ep.bases),
                                dataclasses.replace(geom, tp_rank=r))
                for eid, ep in dps.items():  # a DEP peer: each data-parallel rank's own agent and pages
                    by_engine[eid] = {0: (self.agent.add_peer(ep.agent_metadata), list(ep.bases), geom)}
            except BaseException:
                for name, _b, _g in [*ranks.values(), *(r[0] for r in by_engine.values())]:
                    self.agent.remove_peer(name)
                raise
            theirs = json.loads(resp.compatibility_factors) if resp.compatibility_factors else {}
            name, bases, geom0 = ranks[0]
            peer = Peer(addr, resp.engine_id, name, bases, geom0, theirs, {}, ranks=ranks, dp_ranks=by_engine or None)
            self.peers[addr] = peer
            self.fetches += 1
        return peer

    def get(self, host: str, port: int, engine_id: str) -> Peer:
        """cached() or a blocking fetch + install (tools and tests; the connector fetches off-thread)."""
        return self.cached(host, port, engine_id) or self.install(
            host, port, engine_id, fetch_metadata(f"{host}:{port}", self.factors, self.timeout_s))

    def drop(self, host: str, port: int) -> None:
        with self._lock:
            self._drop_locked(f"{host}:{port}")

    def _drop_locked(self, addr: str) -> None:
        p = self.peers.pop(addr, None)
        if p is None:
            return
        for h in p.prepared.values():
            self.agent.release_dlist(h)
        for ranks in [p.ranks or {0: (p.agent_name, None, None)}, *(p.dp_ranks or {}).values()]:
            for name, _b, _g in ranks.values():
                self.agent.remove_peer(name)
        log.info("dropped the cached transfer metadata of %s (engine %s)", addr, p.engine_id)
