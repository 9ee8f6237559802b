"""The DEP group: M data-parallel ranks, one process each, every rank a whole engine on its own requests.

Each rank (DP rank 0 in the serving process, ranks 1..M-1 spawned by workers/engine/parallel/dp_front.py)
is an LLMEngine with its own scheduler, KV-cache manager, caches and sampler, whose runner is a
`DEPModelRunner`: attention TP=1, the routed experts expert-parallel over the M ranks
(workers/engine/parallel/dp_model.py). Lockstep: the front steps every rank once per step while any rank
has work, and every engine step runs exactly one forward pass, a real one or `idle_step()` (an empty
schedule, a step whose chunks are empty, or a step that failed before its forward), so the ranks always
meet in the same MoE collectives.

A spawned rank (`dp_rank_main`) answers the front's messages over its pipe, one at a time:
    ("probe", ids, salt) -> (prefix-hit tokens, load tokens)    ("add", rid, ids, params, salt, prompt, kvp)
    ("abort", rids) -> final outputs    ("step",) -> (outputs, KV events since the last step, error text,
                                                      has pending connector work)
    ("snapshot",) -> cache contents     ("stats",) -> stats dict       None -> exit 0
    ("transfer_endpoint",) -> the rank's P/D agent and engine id (workers/kv_transfer/dp_group.py)
Every answer is ("ok", value, transfers) or ("err", (bad input?, message), transfers): `transfers` are the
P/D outcomes (workers/kv_transfer/connector.py TransferLedger.record arguments) the rank's NIXL connector
recorded since its last answer, which the front records in rank 0's ledger (the one the gRPC layer and the
transfer metrics read), so a decode request's KvTransferResult is there whichever rank pulled it.
Failure: as the TP group's (workers/engine/parallel/launcher.py): a rank that exits is `RankFailedError`
at the leader's next call (its exit status polled, or its pipe or a collective breaking), and the other
ranks are stopped; a rank whose leader is gone sees its pipe close (or a collective fail) and exits 1.

Across nodes (`nnodes` > 1: node k runs DP ranks k * per_node .. (k + 1) * per_node - 1, per_node =
data_parallel_size / nnodes): the leader's node spawns its own ranks as above; the other nodes' ranks are
started by their node process (workers/engine/parallel/node_process.py) and answer the same messages over
their TCP link to the leader (workers/engine/parallel/nodes.py: pickled leader -> rank, heartbeats), their
answers msgpack through dp_wire.py's explicit encoders; the MoE all-to-all group spans all M ranks, each
rank's gloo listener on its own node's address.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from dataclasses import dataclass, field

import torch

from k3serve.workers.engine.model_runner import ModelRunner
from k3serve.workers.engine.parallel.dp_model import DEPForwardModel, dep_shard
from k3serve.workers.engine.parallel.group import LOOPBACK, RankGroup, join_store
from k3serve.workers.engine.parallel.launcher import (
    DEFAULT_TIMEOUT_S,
    STARTUP_TIMEOUT_S,
    RankFailedError,
    stop_ranks,
)

log = logging.getLogger(__name__)


def check_dp_layout(cfg, args) -> None:
    """Raise one ValueError naming every reason the DEP layout of `args` cannot run `cfg`, or return."""
    dp = int(args.data_parallel_size)
    tp = int(getattr(args, "tensor_parallel_size", 1) or 1)
    why = []
    if tp != 1:
        why.append(f"tensor_parallel_size={tp}: a data-parallel rank runs attention at TP=1 (only 1 with DP)")
    if not str(getattr(args, "device", "cpu")).startswith("cpu"):
        why.append(f"device={args.device}: data-parallel ranks run on CPU ranks (gloo) only")
    others = [c for c in (getattr(args, "kv_connectors", None) or ()) if c != "nixl"]  # P/D decode: each rank pulls
    if getattr(args, "kv_offload_memory", None) or others or getattr(args, "kv_store", None):
        why.append("KV connectors (offload, store) are not implemented with data_parallel_size > 1 (the P/D "
                   "connector is)")
    if getattr(args, "speculative_config", None):
        why.append("speculative decoding is not implemented with data_parallel_size > 1")
    from k3serve.workers.engine.parallel.nodes import layout_problem

    nnodes = int(getattr(args, "nnodes", 1) or 1)
    nodes = layout_problem(dp, nnodes, int(getattr(args, "node_rank", 0) or 0), "data_parallel_size")
    if nodes:  # P/D on other nodes' ranks: each rank's own agent, as on one node (workers/kv_transfer/dp_group.py)
        why.append(nodes)
    if getattr(args, "distributed_executor_backend", "mp") != "mp":
        why.append(f"distributed_executor_backend={args.distributed_executor_backend}: data-parallel ranks are "
                   "spawned processes (mp) only")
    if not cfg.moe_layer_ids:
        why.append("the model has no MoE layers: data parallelism alone is independent replicas (run one "
                   "worker per replica)")
    elif not getattr(args, "enable_expert_parallel", False):
        why.append("data parallelism needs enable_expert_parallel (the routed experts sharded over the ranks)")
    elif cfg.num_experts % dp:
        why.append(f"routed experts ({cfg.num_experts}) are not divisible over {dp} expert-parallel ranks")
    if why:
        raise ValueError(f"data_parallel_size={dp}: this layout cannot run the model: " + "; ".join(why))


@dataclass
class DPContext:
    """This process's place in the group. The leader's holds the store and its peers [(rank, Process,
    Connection)]; a spawned rank's holds its pipe to the leader."""

    rank: int
    size: int
    port: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    store: object = None
    peers: list = field(default_factory=list)
    conn: object = None
    host: str = LOOPBACK  # this rank's gloo listener (its node's address when the group spans nodes)
    store_host: str = LOOPBACK  # where the leader's store listens


class DEPModelRunner(ModelRunner):
    """One DP rank's runner; on the leader it also watches the other ranks' processes (`peers`)."""

    def __init__(self, config, weights, layout, num_blocks, dtype, *, group: RankGroup, expert_map,
                 max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, peers=()):
        def model_class(cfg, w, lay, kv, dt):
            return DEPForwardModel(cfg, w, lay, kv, dt, group=group, expert_map=expert_map)

        self.model_class = model_class
        super().__init__(config, weights, layout, num_blocks, dtype, "cpu", max_num_batched_tokens, max_num_seqs,
                         max_model_len, cuda_graphs=False)
        self.group = group
        self.peers = list(peers)
        self.passes = 0  # forward passes run (real or idle): one per engine step keeps the lockstep
        self.error: RankFailedError | None = None
        self._finalizer = weakref.finalize(self, stop_ranks, self.peers)

    def check_peers(self) -> None:
        """Raise RankFailedError if a rank has exited (a non-blocking wait per rank)."""
        if self.error is None:
            for rank, proc, _conn in self.peers:
                if proc.exitcode is not None:
                    self.fail(f"data-parallel rank {rank} exited (status {proc.exitcode})")
        if self.error is not None:
            raise self.error

    def dead_rank(self, wait_s: float) -> str | None:
        deadline = time.monotonic() + wait_s
        for rank, proc, _conn in self.peers:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is not None:
                return f"data-parallel rank {rank} exited (status {proc.exitcode})"
        return None

    def fail(self, why: str) -> RankFailedError:
        if self.error is None:
            self.error = RankFailedError(why)
            log.error("%s; stopping the other ranks", why)
            stop_ranks(self.peers)
        return self.error

    def _pass(self, fn):
        self.check_peers()
        try:
            out = fn()
        except Exception as e:  # inside the collectives: the lockstep is broken for good
            raise self.fail(self.dead_rank(1.0) or f"data-parallel step failed: {type(e).__name__}: {e}") from e
        self.passes += 1
        return out

    def execute(self, sched):
        def run():
            out = ModelRunner.execute(self, sched)
            if not sched.chunks:  # only page copies / table deltas: the other ranks still need our experts
                self.model.idle()
            return out

        return self._pass(run)

    def idle_step(self) -> None:
        self._pass(self.model.idle)

    def close(self) -> None:
        self._finalizer()


def wait_message(rank: int, proc, conn, timeout_s: float):
    """The next message from a spawned rank; RankFailedError if it exits or stays silent `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if conn.poll(0.05):
            try:
                return conn.recv()
            except (EOFError, OSError):
                break
        if proc.exitcode is not None:
            break
    proc.join(1.0)
    if proc.exitcode is None:
        raise RankFailedError(f"data-parallel rank {rank} did not answer within {timeout_s:g} s")
    raise RankFailedError(f"data-parallel rank {rank} exited (status {proc.exitcode})")


def start_dp_runner(ctx: DPContext, args, cfg, weights, layout, num_blocks: int, dtype: torch.dtype,
                    max_model_len: int) -> DEPModelRunner:
    """This rank's runner: its expert shard, then the group (the leader first waits until every spawned
    rank has loaded its shard, so a rank that fails to load is an error, not a rendezvous timeout)."""
    rank_cfg, shard, emap = dep_shard(cfg, weights, ctx.rank, ctx.size, dtype)
    del weights
    threads = [torch.get_num_threads()]  # each rank's torch threads, rank 0 first (diagnostics, tests)
    if ctx.rank == 0:
        for rank, proc, conn in ctx.peers:
            msg = wait_message(rank, proc, conn, STARTUP_TIMEOUT_S)
            if msg[0] != "loaded":
                raise RankFailedError(f"data-parallel rank {rank} failed to start: {msg[1]}")
            threads.append(int((msg[1] or {}).get("threads", 0)))
        store = ctx.store
    else:
        ctx.conn.send(("loaded", {"threads": threads[0]}))
        store = join_store(ctx.port, ctx.size, STARTUP_TIMEOUT_S, host=ctx.store_host)
    group = RankGroup(store, ctx.rank, ctx.size, ctx.timeout_s, host=ctx.host)
    runner = DEPModelRunner(rank_cfg, shard, layout, num_blocks, dtype, group=group, expert_map=emap,
                            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                            max_model_len=max_model_len, peers=ctx.peers if ctx.rank == 0 else ())
    runner.store = store  # kept alive: the group's rendezvous
    runner.rank_threads = threads if ctx.rank == 0 else threads[:1]
    _watch_links(ctx, group, runner)
    return runner


def _watch_links(ctx: DPContext, group: RankGroup, runner: DEPModelRunner) -> None:
    """Over nodes, a collective waiting on a frozen node (no FIN: its sockets stay open) would wait the
    collectives' timeout (30 s); the group's watch (workers/engine/parallel/group.py) fails it once the node
    link says the peer is lost (HEARTBEAT_TIMEOUT_S of silence, workers/engine/parallel/nodes.py): on the
    leader any rank on another node, on such a rank its leader."""
    from k3serve.workers.engine.parallel.nodes import LeaderLink, RemoteRank

    if ctx.rank == 0 and any(isinstance(proc, RemoteRank) for _r, proc, _c in ctx.peers):
        group.watch = runner.check_peers  # RankFailedError naming the lost rank (the others stopped)
    elif isinstance(ctx.conn, LeaderLink):
        link = ctx.conn

        def leader_alive() -> None:
            try:
                link.check()
            except EOFError as e:
                raise RankFailedError(f"data-parallel rank {ctx.rank}: {e}") from None

        group.watch = leader_alive


# -- what every rank's engine does for the front -----------------------------------------------------
def lockstep_step(engine) -> tuple[list, Exception | None]:
    """engine.step() that always runs exactly one forward pass: (outputs, the step's error or None)."""
    before = engine.runner.passes
    try:
        return engine.step(), None
    except Exception as e:  # noqa: BLE001 - outside the forward (the runner turns a broken one into RankFailedError)
        if engine.runner.passes == before:
            engine.runner.idle_step()
        return [], e


def probe(engine, ids: list[int], cache_salt: str | None) -> tuple[int, int]:
    """(tokens of `ids` this rank's prefix cache would skip, tokens of its running + waiting requests)."""
    from k3serve.sampling_params import SamplingParams
    from k3serve.workers.engine.request import Request

    sch = engine.scheduler
    load = sum(r.num_tokens for r in sch.running) + sum(r.num_tokens for r in sch.waiting)
    hit = 0
    if engine.args.enable_prefix_caching:
        try:
            req = Request("probe", "probe", 0, list(ids), SamplingParams(max_tokens=1), None, cache_salt=cache_salt)
            hit = engine.kv_manager.find_hit(req).tokens
        except Exception:  # noqa: BLE001 - bad ids: the rank's add_request gives the clear error
            hit = 0
    return hit, load


def _ship_transfers(engine) -> list:
    """The list the rank's NIXL ledger also appends each recorded outcome to (empty without P/D)."""
    from k3serve.workers.kv_transfer.grpc_pd import find_nixl

    out: list = []
    nixl = find_nixl(engine)
    if nixl is not None:
        record = nixl.ledger.record

        def record_and_ship(request_id, outcome, *, seconds=None, bytes_by_view=None):
            record(request_id, outcome, seconds=seconds, bytes_by_view=bytes_by_view)
            out.append((request_id, outcome, seconds, bytes_by_view))

        nixl.ledger.record = record_and_ship
    return out


@dataclass(frozen=True)
class RankArgs:
    """What a spawned rank needs (picklable)."""

    args: object  # EngineArgs
    port: int
    size: int
    timeout_s: float
    num_threads: int
    host: str = LOOPBACK  # the rank's gloo listener (node_process.py sets its own node's address)
    store_host: str = LOOPBACK  # the leader's store


def dp_rank_main(rank: int, spec: RankArgs, conn) -> None:
    """A spawned DP rank: build its engine (joining the group), then answer the front until told to stop."""
    from k3serve.workers.engine.llm_engine import LLMEngine

    torch.set_num_threads(spec.num_threads)
    status = 0
    try:
        ctx = DPContext(rank, spec.size, spec.port, spec.timeout_s, conn=conn, host=spec.host,
                        store_host=spec.store_host)
        engine = LLMEngine(spec.args, dp=ctx)
        events: list = []
        engine.subscribe_kv_events(events.append)
        transfers = _ship_transfers(engine)

        def reply(status, value):
            conn.send((status, value, transfers[:]))
            transfers.clear()
        while True:
            try:
                msg = conn.recv()
            except EOFError as e:  # the leader is gone (a node link says why: closed, or silent for how long)
                log.error("data-parallel rank %d: %s", rank, e or "the leader's pipe closed")
                status = 1
                break
            if msg is None:
                break
            op = msg[0]
            if op == "step":
                outs, err = lockstep_step(engine)
                reply("ok", (outs, events[:], None if err is None else f"{type(err).__name__}: {err}",
                             engine.has_pending_connector_work()))
                events.clear()
                continue
            try:
                if op == "probe":
                    result = probe(engine, msg[1], msg[2])
                elif op == "add":
                    _op, rid, ids, params, salt, prompt, kvp = msg
                    result = engine.add_request(rid, ids, params, cache_salt=salt, prompt=prompt,
                                                kv_transfer_params=kvp)
                elif op == "abort":
                    result = engine.abort_request(msg[1])
                elif op == "snapshot":
                    result = engine.kv_cache_snapshot()
                elif op == "stats":
                    result = engine.stats()
                elif op == "transfer_endpoint":  # P/D from a DEP worker: workers/kv_transfer/dp_group.py
                    from k3serve.workers.kv_transfer.dp_group import rank_endpoint

                    result = rank_endpoint(engine, rank)
                else:
                    raise ValueError(f"unknown message {op!r}")
            except Exception as e:  # noqa: BLE001 - e.g. a bad request: the front raises it to its caller
                reply("err", (isinstance(e, ValueError), f"{e}" if isinstance(e, ValueError)
                              else f"{type(e).__name__}: {e}"))
                continue
            reply("ok", result)
    except BaseException as e:  # noqa: BLE001 - reported to the leader (while starting) and in the exit status
        status = 1
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        log.error("data-parallel rank %d failed: %s", rank, e)
    os._exit(status)
