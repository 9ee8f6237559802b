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

    def to_plain(self) -> dict:
        """JSON-safe (a rank reports it to rank 0 over a pipe or, from another node, as JSON)."""
        return dict(tp_rank=self.tp_rank, agent_name=self.agent_name, agent_metadata=self.agent_metadata.hex(),
                    bases=[int(b) for b in self.bases])

    @classmethod
    def from_plain(cls, d: dict) -> RankEndpoint:
        return cls(int(d["tp_rank"]), str(d["agent_name"]), bytes.fromhex(d["agent_metadata"]),
                   tuple(int(b) for b in d["bases"]))


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


def metadata_response(pb, *, engine_id: str, factors: dict, agent_name: str, agent_metadata: bytes,
                      bases: list[int], geometry: PageGeometry, other_ranks=()):
    """The TransferMetadataResponse a worker answers with (`pb`: k3serve.proto.worker_pb2); `other_ranks`:
    RankEndpoints of ranks 1.. of a multi-rank worker."""
    others = [pb.TransferRankMetadata(tp_rank=e.tp_rank, agent_name=e.agent_name, agent_metadata=e.agent_metadata,
                                      region_base_addrs=[int(b) for b in e.bases]) for e in other_ranks]
    return pb.TransferMetadataResponse(other_ranks=others,
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
            if p is not None and p.engine_id == engine_id:
                return p
            if p is not None:  # restarted (new engine id): forget the old agent
                self._drop_locked(addr)
        return None

    def install(self, host: str, port: int, engine_id: str, resp) -> Peer:
        """Add a fetched peer's NIXL agent (engine thread: the agent is not shared with other threads)."""
        addr = f"{host}:{port}"
        if resp.engine_id != engine_id:
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
            ranks = {}
            try:
                for r, ep in sorted(eps.items()):
                    ranks[r] = (self.agent.add_peer(ep.agent_metadata), list(ep.bases),
                                dataclasses.replace(geom, tp_rank=r))
            except BaseException:
                for name, _b, _g in ranks.values():
                    self.agent.remove_peer(name)
                raise
            theirs = json.loads(resp.compatibility_factors) if resp.compatibility_factors else {}
            name, bases, geom0 = ranks[0]
            peer = Peer(addr, resp.engine_id, name, bases, geom0, theirs, {}, ranks=ranks)
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
        for name, _b, _g in (p.ranks or {0: (p.agent_name, None, None)}).values():
            self.agent.remove_peer(name)
        log.info("dropped the cached transfer metadata of %s (engine %s)", addr, p.engine_id)
