"""DPEngine: a DEP group (data_parallel_size=M) as ONE engine, the LLMEngine contract (workers/engine/api.py).

    engine = LLMEngine.from_args(EngineArgs(model=DIR, data_parallel_size=2, enable_expert_parallel=True))

It lives in the leader's process (DP rank 0's, which serves the gRPC endpoint / OpenAI server) and owns
rank 0's engine; ranks 1..M-1 are spawned processes (workers/engine/parallel/dp_engine.py). Over `nnodes`
nodes the leader spawns its node's ranks 1..per_node-1 and the other nodes' ranks connect to it
(workers/engine/parallel/nodes.py; dp_engine.py's docstring): the front drives them the same way.

* Spreading: a new request goes to the rank where it costs least, cost = the rank's load (tokens of its
  running + waiting requests) + the prompt tokens it would have to compute (prompt minus the rank's
  prefix-cache hit, asked of each rank's own cache manager); ties go to the lowest rank. So a request
  whose prefix is cached on rank r goes to r unless r is busier than the hit is worth, and with no hit
  requests go to the least-loaded rank. Aborts go to the owning rank.
* Lockstep: `step()` steps every rank once while any rank has a request (an idle rank runs a dummy pass
  that only serves its experts to the others); with no request anywhere nobody steps.
* KV events: the ranks' events merged into one stream, a (block hash, group) key being "stored" when the
  first rank stores it and "removed" when the last rank holding it drops it. The router's prefix index
  therefore sees this worker holding a block if any rank does; the spreading rule above then sends the
  request to a rank that holds it, so the router's predicted hit is realized unless that rank is busy.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable

from k3serve.kv_events.types import KVEvent
from k3serve.workers.engine.parallel import dp_wire
from k3serve.workers.engine.parallel import nodes as multinode
from k3serve.workers.engine.parallel.dp_engine import (
    DPContext,
    RankArgs,
    check_dp_layout,
    dp_rank_main,
    lockstep_step,
    probe,
    stop_ranks,
)
from k3serve.workers.engine.parallel.group import LOOPBACK, host_store
from k3serve.workers.engine.parallel.launcher import DEFAULT_TIMEOUT_S, STARTUP_TIMEOUT_S
from k3serve.workers.engine.parallel.threads import set_rank_threads

_SUMMED = ("running", "waiting", "free_pages", "total_pages", "kda_slots_used", "kda_slots_total",
           "num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_mla_hits",
           "prefix_cache_kda_hits", "kda_snapshots_stored", "kda_snapshots_evicted", "prefill_tokens_computed",
           "prefill_tokens_skipped", "num_blocks")


class KVEventMerger:
    """Which ranks hold each (block hash, group id) key; `apply` returns the event the merged stream gets
    (None when another rank already holds / still holds the key)."""

    def __init__(self) -> None:
        self.holders: dict[tuple[bytes, int], set[int]] = {}
        self.stored: dict[tuple[bytes, int], KVEvent] = {}

    def apply(self, rank: int, ev: KVEvent) -> KVEvent | None:
        key = (ev.block_hash, ev.group_id)
        if ev.kind == "stored":
            ranks = self.holders.setdefault(key, set())
            first = not ranks
            ranks.add(rank)
            if first:
                self.stored[key] = ev
                return ev
            return None
        ranks = self.holders.get(key)
        if not ranks or rank not in ranks:
            return None
        ranks.discard(rank)
        if ranks:
            return None
        del self.holders[key], self.stored[key]
        return ev

    def snapshot(self) -> list[KVEvent]:
        return list(self.stored.values())


class DPEngine:
    def __init__(self, args):
        from k3serve.workers.engine.llm_engine import LLMEngine
        from k3serve.workers.model.config import K3Config

        check_dp_layout(K3Config.from_pretrained(args.model), args)  # before any rank starts
        self.size = size = int(args.data_parallel_size)
        self.nodes = nodes = multinode.NodeLayout.from_args(args)
        if nodes.node_rank != 0:
            raise ValueError(f"node_rank={nodes.node_rank}: only node 0 runs the engine; the other nodes run ranks "
                             "only (`k3serve worker --node-rank N`)")
        threads = set_rank_threads(nodes.per_node)  # every rank (this one too) its share of the host's CPUs
        bind = multinode.resolve(nodes.master_addr, multinode.RENDEZVOUS_TIMEOUT_S) if nodes.multi_node else LOOPBACK
        store = host_store(size, STARTUP_TIMEOUT_S, host=bind, port=nodes.master_port if nodes.multi_node else 0)
        spec = RankArgs(args, store.port, size, DEFAULT_TIMEOUT_S, threads, host=bind, store_host=bind)
        ctx = mp.get_context("spawn")
        peers = []
        try:
            for rank in range(1, nodes.per_node):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=dp_rank_main, args=(rank, spec, child), name=f"k3serve-dp-rank-{rank}",
                                   daemon=True)
                proc.start()
                child.close()
                peers.append((rank, proc, parent))
            if nodes.multi_node:  # the other nodes' ranks connect, get the same spec, answer in dp_wire frames
                remote = multinode.accept_remote_ranks(bind, nodes, store, lambda _rank: spec,
                                                       time.monotonic() + multinode.RENDEZVOUS_TIMEOUT_S,
                                                       decode=dp_wire.decode)
                peers += [(r.rank, r, r) for r in remote]
            self.local = LLMEngine(args, dp=DPContext(0, size, store.port, DEFAULT_TIMEOUT_S, store=store,
                                                      peers=peers, host=bind))
        except BaseException:
            stop_ranks(peers)
            raise
        self.peers = peers
        self.runner = self.local.runner  # check_peers / close cover the whole group
        self.owner: dict[str, int] = {}  # unfinished request id -> its rank
        self.routed = [0] * size  # requests sent to each rank
        self.merger = KVEventMerger()
        self.pending = [False] * size  # each spawned rank's connector work, as of its last step
        from k3serve.workers.kv_transfer.grpc_pd import find_nixl

        nixl = find_nixl(self.local)
        self.ledger = nixl.ledger if nixl is not None else None  # every rank's P/D outcomes land here
        if nixl is not None:  # P/D: rank 0's handshake names every rank's agent (workers/kv_transfer/dp_group.py)
            from k3serve.workers.kv_transfer.dp_group import install

            install(self.local, [self._call(r, ("transfer_endpoint",)) for r in range(1, size)])
        self.event_listeners: list[Callable[[KVEvent], None]] = []
        self.local.subscribe_kv_events(lambda ev: self._on_event(0, ev))

    def __getattr__(self, name):  # the rest of the contract (model_config, tokenizer, layout, ...) is rank 0's
        if name == "local":
            raise AttributeError(name)
        return getattr(self.local, name)

    # -- talking to the spawned ranks --------------------------------------------------------------
    def _send(self, rank: int, msg) -> None:
        _r, proc, conn = self.peers[rank - 1]
        try:
            conn.send(msg)
        except OSError as e:
            raise self.runner.fail(self.runner.dead_rank(1.0) or f"data-parallel rank {rank}: {e}") from None

    def _recv(self, rank: int):
        _r, proc, conn = self.peers[rank - 1]
        deadline = time.monotonic() + 2 * DEFAULT_TIMEOUT_S
        while not conn.poll(0.05):
            if proc.exitcode is not None or time.monotonic() > deadline:
                why = (f"data-parallel rank {rank} exited (status {proc.exitcode})" if proc.exitcode is not None
                       else f"data-parallel rank {rank} did not answer within {2 * DEFAULT_TIMEOUT_S:g} s")
                raise self.runner.fail(why)
        try:
            status, value, *rest = conn.recv()
        except (EOFError, OSError):
            raise self.runner.fail(self.runner.dead_rank(1.0) or f"data-parallel rank {rank}: its pipe closed") from None
        except ValueError as e:  # a frame from another node that dp_wire cannot read: the group is unusable
            raise self.runner.fail(f"data-parallel rank {rank} sent an unreadable answer: {e}") from None
        for rid, outcome, seconds, bytes_by_view in (rest[0] if rest else ()):
            if self.ledger is not None:
                self.ledger.record(rid, outcome, seconds=seconds, bytes_by_view=bytes_by_view)
        if status == "ok":
            return value
        if status == "err":
            bad_input, text = value  # the rank refused it (a ValueError: bad input) or failed
            raise (ValueError if bad_input else RuntimeError)(text)
        raise self.runner.fail(f"data-parallel rank {rank} failed: {value}")

    def _call(self, rank: int, msg):
        self.runner.check_peers()
        self._send(rank, msg)
        return self._recv(rank)

    def _on_event(self, rank: int, ev: KVEvent) -> None:
        out = self.merger.apply(rank, ev)
        if out is not None:
            for fn in list(self.event_listeners):
                fn(out)

    # -- requests ----------------------------------------------------------------------------------
    def choose_rank(self, prompt_token_ids: list[int], cache_salt: str | None) -> int:
        """The rank a new request goes to (the module docstring's rule)."""
        self.runner.check_peers()
        ids = list(prompt_token_ids)
        for rank in range(1, self.size):
            self._send(rank, ("probe", ids, cache_salt))
        probes = [probe(self.local, ids, cache_salt)] + [self._recv(r) for r in range(1, self.size)]
        cost = [load + len(ids) - hit for hit, load in probes]
        return min(range(self.size), key=lambda r: (cost[r], r))

    def add_request(self, request_id: str, prompt_token_ids: list[int], params, cache_salt: str | None = None,
                    prompt: str | None = None, kv_transfer_params: dict | None = None) -> None:
        if request_id in self.owner:
            raise ValueError(f"request_id {request_id!r} is already in use")
        rank = self.choose_rank(prompt_token_ids, cache_salt)
        if rank == 0:
            self.local.add_request(request_id, prompt_token_ids, params, cache_salt=cache_salt, prompt=prompt,
                                   kv_transfer_params=kv_transfer_params)
        else:
            self._call(rank, ("add", request_id, [int(t) for t in prompt_token_ids], params, cache_salt, prompt,
                              kv_transfer_params))
        self.owner[request_id] = rank
        self.routed[rank] += 1

    def abort_request(self, request_ids) -> list:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            if rid in self.owner:
                by_rank.setdefault(self.owner[rid], []).append(rid)
        finals = []
        for rank, rids in sorted(by_rank.items()):
            finals += self.local.abort_request(rids) if rank == 0 else self._call(rank, ("abort", rids))
            for rid in rids:
                self.owner.pop(rid, None)
        return finals

    def has_unfinished_requests(self) -> bool:
        return bool(self.owner)

    def has_pending_connector_work(self) -> bool:
        return self.local.has_pending_connector_work() or any(self.pending)

    def get_num_unfinished_requests(self) -> int:
        return len(self.owner)

    def step(self) -> list:
        if not self.owner and not self.has_pending_connector_work():
            return []
        self.runner.check_peers()
        for rank in range(1, self.size):
            self._send(rank, ("step",))
        outputs, err = lockstep_step(self.local)  # meets the other ranks in every MoE layer
        errors = [] if err is None else [f"data-parallel rank 0: {type(err).__name__}: {err}"]
        for rank in range(1, self.size):
            outs, events, rank_err, self.pending[rank] = self._recv(rank)
            for ev in events:
                self._on_event(rank, ev)
            outputs += outs
            if rank_err is not None:
                errors.append(f"data-parallel rank {rank}: {rank_err}")
        for out in outputs:
            if out.finished:
                self.owner.pop(out.request_id, None)
        if errors:  # the lockstep held (every rank ran its pass): an ordinary failed step, contained upstream
            raise RuntimeError("; ".join(errors))
        return outputs

    # -- cache events and introspection ------------------------------------------------------------
    def subscribe_kv_events(self, fn: Callable[[KVEvent], None]) -> Callable[[], None]:
        self.event_listeners.append(fn)
        return lambda: self.event_listeners.remove(fn) if fn in self.event_listeners else None

    def kv_cache_snapshot(self) -> list[KVEvent]:
        return self.merger.snapshot()

    def rank_stats(self) -> list[dict]:
        return [self.local.stats()] + [self._call(r, ("stats",)) for r in range(1, self.size)]

    def stats(self) -> dict:
        per = self.rank_stats()
        out = dict(per[0])
        for key in _SUMMED:
            if key in out:
                out[key] = sum(s[key] for s in per)
        used = sum(s["kv_usage"] * s["total_pages"] for s in per)
        out["kv_usage"] = used / out["total_pages"] if out.get("total_pages") else 0.0
        out["data_parallel_size"] = self.size
        out["dp_requests_routed"] = list(self.routed)
        out["dp_ranks"] = [dict(running=s["running"], waiting=s["waiting"], kv_usage=s["kv_usage"]) for s in per]
        return out

    def close(self) -> None:
        self.runner.close()
