"""The process model of a tensor-parallel engine: one process per rank, rank 0 is the engine's own.

Rank 0 (`start_parallel_runner`, called by LLMEngine when tensor_parallel_size > 1) runs the scheduler,
the KV-cache manager and the sampler as a single-rank engine does; its runner is a `ParallelModelRunner`.
Ranks 1..N-1 are spawned processes (`rank_main`): each loads the checkpoint, keeps its shard
(workers/engine/parallel/shard.py), builds the same cache layout and pool size, and then executes every
step's SchedulerOutput (plain data, workers/engine/scheduler_output.py) that rank 0 sends it over a pipe,
before rank 0 executes the same step itself. Inside the step the ranks meet in the model's collectives
(gloo over 127.0.0.1, workers/engine/parallel/group.py); rank 0 alone gets the full logits it samples.

P/D (the "nixl" connector): each spawned rank also runs its own connector worker half over its own page
tensors and NIXL agent (`_rank_transfer`) and reports the agent's metadata and page addresses to rank 0
(a `RankEndpoint`); rank 0 sets them as `runner.kv.transfer_ranks`, and its connector's handshake answers
for the whole group (workers/kv_transfer/handshake.py), so a decode worker reads every prefill rank's
pages directly (the bytes never pass through rank 0: one NIC per GPU in a real pod). In a decode worker,
every rank pulls its own share of each request named in the step's connector metadata and sends rank 0
("recv", {"done", "failed"}) over its pipe; rank 0's half polls them (`runner.kv.transfer_reports`) and
settles the request once every rank has answered.

Failure: a rank that exits (killed, crashed) is seen by rank 0 at the next step before anything is sent
(`RankFailedError` naming the rank and its exit code), or inside a step's collective (its sockets close:
gloo raises at once); a rank that hangs makes the collective raise after `timeout_s`, or, on another node,
once its node link has been silent for nodes.HEARTBEAT_TIMEOUT_S (RankGroup.watch: rank 0 checks its peers, a
remote rank its LeaderLink, every second while a collective waits; so a frozen node or leader fails a step
within ~6 s). A node taken for lost is not told to stop (`stop_ranks`): thawed, it exits 1. After one failure
the runner stays failed, and the other ranks are stopped. A rank whose rank 0 is gone sees its pipe close
and exits with status 1. Ranks spanning nodes (`nnodes` > 1: the leader node's ranks are spawned here,
the other nodes' ranks connect to rank 0 over TCP and stand in `peers` like local ones):
workers/engine/parallel/nodes.py.

Threads: every rank, rank 0 too when it shares its host with other ranks, runs its share of the host's
CPUs as torch threads (workers/engine/parallel/threads.py; `ranks_per_host` / `num_threads` of the spec).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import time
import weakref
from dataclasses import dataclass

import torch

from k3serve.workers.engine.model_runner import ModelRunner
from k3serve.workers.engine.parallel import nodes as multinode
from k3serve.workers.engine.parallel import ray_launcher
from k3serve.workers.engine.parallel.group import LOOPBACK, RankGroup, host_store, join_store
from k3serve.workers.engine.parallel.layers import ParallelK3ForwardModel
from k3serve.workers.engine.parallel.seq_parallel import SequenceParallelK3ForwardModel
from k3serve.workers.engine.parallel.shard import ShardPlan, load_shard, shard_weights
from k3serve.workers.engine.parallel.threads import override as threads_override
from k3serve.workers.engine.parallel.threads import set_rank_threads

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = float(os.environ.get("K3SERVE_TP_TIMEOUT_S", "30"))  # a hung peer inside a collective
STARTUP_TIMEOUT_S = 600.0  # ranks loading the checkpoint


class RankFailedError(BaseException):
    """A rank of the tensor-parallel group exited or stopped answering; the engine cannot step again.

    A BaseException on purpose: workers/async_engine.py contains a failed step (`except Exception`) and
    keeps serving, which a broken group cannot; this ends the engine thread instead (unhealthy, and the
    serving process exits 1 through its on_fatal)."""


@dataclass(frozen=True)
class RankSpec:
    """Everything a spawned rank needs to build the same runner as rank 0 (picklable plain data)."""

    model: str
    dtype: torch.dtype
    size: int
    expert_parallel: bool
    port: int
    layout: object  # CacheLayout
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    static_decode: bool
    timeout_s: float
    transfer: tuple | None = None  # (NIXL network devices or None,): register the pages for P/D reads
    host: str = LOOPBACK  # this rank's gloo listener (its node's address when the group spans nodes)
    store_host: str = LOOPBACK  # where rank 0's store listens
    sequence_parallel: bool = False  # workers/engine/parallel/seq_parallel.py
    ranks_per_host: int = 1  # ranks sharing a host's CPUs: each takes its share (workers/engine/parallel/threads.py)
    num_threads: int | None = None  # every rank's torch threads when set (K3SERVE_RANK_THREADS on rank 0's host)


def _wants_transfer(args) -> tuple | None:
    """(NIXL network devices or None, pull timeout s) when the engine has the P/D connector."""
    if "nixl" in (getattr(args, "kv_connectors", None) or ()):
        return (getattr(args, "kv_transfer_devices", None) or None, getattr(args, "kv_transfer_timeout", None))
    return None


def _rank_transfer(rank: int, spec: RankSpec, runner):
    """Rank `rank`'s own P/D worker half over its own pages (workers/kv_transfer/connector.py NixlWorker:
    its agent serves a decode worker's reads of a prefill rank, and pulls a decode rank's share); ->
    (worker, RankEndpoint)."""
    import uuid

    from k3serve.common.block_hash import model_fingerprint
    from k3serve.workers.engine.kv_connector.base import ConnectorContext
    from k3serve.workers.kv_transfer.compat import compatibility_factors
    from k3serve.workers.kv_transfer.connector import NixlWorker, TransferLedger
    from k3serve.workers.kv_transfer.handshake import RankEndpoint

    devices, timeout = spec.transfer
    fp = model_fingerprint(spec.model)
    extra = dict(tensor_parallel_size=spec.size, tp_rank=rank, kv_transfer_devices=devices)
    if timeout is not None:
        extra["kv_transfer_timeout"] = timeout
    ctx = ConnectorContext(layout=spec.layout, hash_unit=spec.layout.block_size, model_fingerprint=fp, device="cpu",
                           engine_id=f"{os.getpid()}-tp{rank}-{uuid.uuid4().hex[:8]}", enable_prefix_caching=False,
                           extra_config=extra)
    worker = NixlWorker(ctx, TransferLedger(), compatibility_factors(spec.layout, fp, spec.size))
    worker.register_kv_caches(runner.kv)
    return worker, RankEndpoint(rank, worker.agent.name, worker.agent.metadata(), tuple(worker.bases))


def _nixl_meta(meta):
    """The P/D connector's part of a step's connector metadata (the engine composes its connectors)."""
    from k3serve.workers.kv_transfer.connector import NixlMeta

    for m in [meta, *(getattr(meta, "data", None) or ())]:
        if isinstance(m, NixlMeta):
            return m
    return NixlMeta(step=getattr(meta, "step", 0))


def _report_pulls(transfer, conn) -> None:
    """Send rank 0 the request ids whose pull on this rank ended (done or failed)."""
    out = transfer.get_finished()
    if out.finished_recving or out.failed_recving:
        nbytes = {rid: transfer.pulled_bytes.pop(rid) for rid in out.finished_recving if rid in transfer.pulled_bytes}
        conn.send(("recv", {"done": sorted(out.finished_recving), "failed": sorted(out.failed_recving),
                            "bytes": nbytes}))


def _transfer_reports(peers):
    """Rank 0's poll of the other ranks' pull outcomes: [(rank, {"done": [...], "failed": [...]})], waiting
    up to `wait_s` for a first message from each rank (they report right after the step both just ran)."""
    def poll(wait_s: float = 0.0):
        out = []
        deadline = time.monotonic() + wait_s
        for rank, _proc, conn in peers:
            first = True
            while conn.poll(max(0.0, deadline - time.monotonic()) if first else 0):
                first = False
                try:
                    msg = conn.recv()
                except (EOFError, OSError):  # the rank is gone: check_peers fails the group at the next step
                    break
                if msg[0] == "recv":
                    out.append((rank, msg[1]))
        return out

    return poll


class ParallelModelRunner(ModelRunner):
    """A ModelRunner whose model is this rank's ParallelK3ForwardModel; on rank 0 it also forwards each
    step to the other ranks (`peers`) before executing it."""

    def __init__(self, config, weights, layout, num_blocks, dtype, *, group: RankGroup, plan: ShardPlan,
                 max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, peers=()):
        def model_class(cfg, w, lay, kv, dt):
            cls = SequenceParallelK3ForwardModel if plan.sequence_parallel else ParallelK3ForwardModel
            return cls(cfg, w, lay, kv, dt, group=group, plan=plan)

        self.model_class = model_class
        super().__init__(config, weights, layout, num_blocks, dtype, "cpu", max_num_batched_tokens, max_num_seqs,
                         max_model_len, cuda_graphs=False)
        self.group = group
        self.peers = list(peers)  # rank 0: [(rank, Process, Connection)]
        self.error: RankFailedError | None = None
        self._finalizer = weakref.finalize(self, stop_ranks, self.peers)

    def check_peers(self) -> None:
        """Raise RankFailedError if a rank has exited (cheap: a non-blocking wait per rank)."""
        if self.error is None:
            for rank, proc, _conn in self.peers:
                if proc.exitcode is not None:
                    self._fail(f"tensor-parallel rank {rank} exited (status {proc.exitcode})")
        if self.error is not None:
            raise self.error

    def _dead_rank(self, wait_s: float) -> str | None:
        """Which rank exited, waiting up to `wait_s` for its status (a collective fails as its sockets close,
        a moment before the process is reaped)."""
        deadline = time.monotonic() + wait_s
        for rank, proc, _conn in self.peers:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is not None:
                return f"tensor-parallel rank {rank} exited (status {proc.exitcode})"
        return None

    def _fail(self, why: str) -> None:
        self.error = RankFailedError(why)
        log.error("%s; stopping the other ranks", why)
        stop_ranks(self.peers)

    def execute(self, sched):
        self.check_peers()
        try:
            for _rank, _proc, conn in self.peers:
                conn.send(sched)
            return super().execute(sched)
        except Exception as e:
            if self.peers:  # rank 0: the ranks are out of lockstep, the group is broken for good
                self._fail(self._dead_rank(1.0) or f"tensor-parallel step failed: {type(e).__name__}: {e}")
                raise self.error from e
            raise

    def close(self) -> None:
        self._finalizer()


def stop_ranks(peers) -> None:
    """Tell each spawned rank to exit, then kill those that do not within 5 s (TP and DEP groups). A rank
    already taken for dead (exited, or a node lost: nodes.RemoteRank.exitcode) is not told to stop: a frozen
    node thawed later finds its link closed with no stop in it and exits 1 (it was lost, not stopped)."""
    for _rank, proc, conn in peers:
        if proc.exitcode is not None:
            continue
        try:
            conn.send(None)
        except OSError:
            pass
    deadline = time.monotonic() + 5.0
    for _rank, proc, _conn in peers:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.exitcode is None:
            proc.kill()
            proc.join(5.0)
    for _rank, _proc, conn in peers:
        conn.close()


def start_parallel_runner(args, cfg, weights, layout, num_blocks: int, dtype: torch.dtype,
                          max_model_len: int) -> ParallelModelRunner:
    """Rank 0: spawn ranks 1..N-1, wait until each has loaded its shard, join the group, return the runner."""
    size = int(args.tensor_parallel_size)
    ep = bool(getattr(args, "enable_expert_parallel", False))
    sp = bool(getattr(args, "enable_sequence_parallel", False))
    timeout_s = DEFAULT_TIMEOUT_S
    forced_threads = threads_override()  # K3SERVE_RANK_THREADS (a malformed value: an error before any rank)
    nodes = multinode.NodeLayout.from_args(args)  # groups spanning nodes: workers/engine/parallel/nodes.py
    if nodes.node_rank != 0:
        raise ValueError(f"node_rank={nodes.node_rank}: only node 0 runs the engine; the other nodes run ranks "
                         "only (`k3serve worker --node-rank N`)")
    use_ray = getattr(args, "distributed_executor_backend", "mp") == "ray"  # workers/engine/parallel/ray_launcher.py
    if use_ray and nodes.multi_node:
        raise ValueError("distributed_executor_backend='ray' places the ranks on the Ray cluster's nodes itself "
                         "(K3SERVE_RAY_PLACEMENT_STRATEGY, workers/engine/parallel/ray_launcher.py): nnodes must be 1")
    owns_ray = ray_launcher.ensure_ray(size) if use_ray else False
    bind = multinode.resolve(nodes.master_addr, multinode.RENDEZVOUS_TIMEOUT_S) if nodes.multi_node else (
        ray_launcher.driver_address() if use_ray else LOOPBACK)
    store = host_store(size, STARTUP_TIMEOUT_S, host=bind, port=nodes.master_port if nodes.multi_node else 0)
    spec = RankSpec(args.model, dtype, size, ep, store.port, layout, num_blocks, args.max_num_batched_tokens,
                    args.max_num_seqs, max_model_len, bool(args.static_decode), timeout_s, _wants_transfer(args),
                    sequence_parallel=sp)
    placement = ray_launcher.place(size, str(getattr(args, "device", "cpu")), owns_ray) if use_ray else None
    local = placement.ranks_on_node(0) if use_ray else nodes.per_node  # ranks on rank 0's host
    spec = dataclasses.replace(spec, host=bind, store_host=bind, ranks_per_host=local,
                               num_threads=forced_threads)
    if local > 1:  # rank 0 shares its host with the others: its share too (workers/engine/parallel/threads.py)
        set_rank_threads(local, spec.num_threads)
    ctx = mp.get_context("spawn")
    peers = []
    try:
        if use_ray:  # one actor per rank in a placement group instead of spawned processes
            peers += ray_launcher.start_rank_actors(spec, placement)
        for rank in range(1, 1 if use_ray else nodes.per_node):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(rank, spec, child), name=f"k3serve-tp-rank-{rank}",
                               daemon=True)
            proc.start()
            child.close()
            peers.append((rank, proc, parent))
        if nodes.multi_node:  # the other nodes' ranks connect and get the same spec
            remote = multinode.accept_remote_ranks(bind, nodes, store, lambda _rank: spec,
                                                   time.monotonic() + multinode.RENDEZVOUS_TIMEOUT_S)
            peers += [(r.rank, r, r) for r in remote]
        plan = ShardPlan.make(cfg, 0, size, ep, sp)
        if weights is None:  # the engine left the reading to the ranks: only this rank's slices
            _cfg, _plan, rank_cfg, shard = load_shard(args.model, dtype, 0, size, ep, sp)
        else:
            rank_cfg, shard = shard_weights(cfg, weights, plan, dtype)
        del weights
        threads = [torch.get_num_threads()]  # each rank's torch threads, rank 0 first (diagnostics, tests)
        for rank, proc, conn in peers:  # each rank reports "loaded" (or its error) before the group forms
            msg = _wait_message(rank, proc, conn, STARTUP_TIMEOUT_S)
            if msg[0] != "loaded":
                raise RankFailedError(f"tensor-parallel rank {rank} failed to start: {msg[1]}")
            threads.append(int((msg[1] or {}).get("threads", 0)))
        group = RankGroup(store, 0, size, timeout_s, host=bind)
        runner = ParallelModelRunner(rank_cfg, shard, layout, num_blocks, dtype, group=group, plan=plan,
                                     max_num_batched_tokens=args.max_num_batched_tokens,
                                     max_num_seqs=args.max_num_seqs, max_model_len=max_model_len, peers=peers)
        if any(isinstance(proc, multinode.RemoteRank) for _r, proc, _c in peers):
            group.watch = runner.check_peers  # a frozen node fails a waiting collective (RankFailedError naming it)
        if spec.transfer is not None:  # each rank's own agent over its own pages (P/D)
            from k3serve.workers.kv_transfer.handshake import RankEndpoint

            runner.kv.transfer_ranks = []
            for rank, proc, conn in peers:
                msg = _wait_message(rank, proc, conn, STARTUP_TIMEOUT_S)
                if msg[0] != "transfer":
                    raise RankFailedError(f"tensor-parallel rank {rank} could not register its pages: {msg[1]}")
                runner.kv.transfer_ranks.append(RankEndpoint.from_plain(msg[1]))
            runner.kv.transfer_reports = _transfer_reports(peers)
    except BaseException:
        stop_ranks(peers)
        raise
    runner.store = store  # kept alive: the group's rendezvous
    runner.rank_threads = threads
    if args.static_decode is not None:
        runner.static_decode = bool(args.static_decode)
    return runner


def _wait_message(rank: int, proc, conn, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if conn.poll(0.1):
            try:
                return conn.recv()
            except EOFError:
                break
        if proc.exitcode is not None:
            break
    proc.join(1.0)
    raise RankFailedError(f"tensor-parallel rank {rank} exited while starting (status {proc.exitcode})")


def rank_main(rank: int, spec: RankSpec, conn) -> None:
    """A spawned rank: load its shard, join the group, execute steps until rank 0 says stop or goes away."""
    status = 0
    try:
        set_rank_threads(spec.ranks_per_host, spec.num_threads)  # before any torch work: the host's CPU share
        cfg, plan, rank_cfg, shard = load_shard(spec.model, spec.dtype, rank, spec.size, spec.expert_parallel,
                                                spec.sequence_parallel)  # only this rank's slices
        conn.send(("loaded", {"threads": torch.get_num_threads()}))
        group = RankGroup(join_store(spec.port, spec.size, STARTUP_TIMEOUT_S, host=spec.store_host), rank,
                          spec.size, spec.timeout_s, host=spec.host)
        runner = ParallelModelRunner(rank_cfg, shard, spec.layout, spec.num_blocks, spec.dtype, group=group,
                                     plan=plan, max_num_batched_tokens=spec.max_num_batched_tokens,
                                     max_num_seqs=spec.max_num_seqs, max_model_len=spec.max_model_len)
        runner.static_decode = spec.static_decode
        if isinstance(conn, multinode.LeaderLink):  # a rank on another node: a frozen leader fails a waiting collective
            group.watch = _leader_watch(rank, conn)
        transfer = None
        if spec.transfer is not None:
            transfer, endpoint = _rank_transfer(rank, spec, runner)
            conn.send(("transfer", endpoint.to_plain()))
        while True:
            # a pull of this rank still running: report it the moment it ends, not at rank 0's next step
            while transfer is not None and transfer.pending() and not conn.poll(0.002):
                _report_pulls(transfer, conn)
            try:
                sched = conn.recv()
            except EOFError as e:  # rank 0 is gone
                status = 1
                if isinstance(conn, multinode.LeaderLink):  # a rank on another node: say why, one line
                    log.error("tensor-parallel rank %d, between steps: %s", rank, e)
                break
            if sched is None:
                break
            if transfer is not None:  # a decode rank pulls its own share (rank 0 settles the request)
                transfer.start_load_kv(_nixl_meta(sched.kv_connector_metadata))
            runner.execute(sched)
            if transfer is not None:
                _report_pulls(transfer, conn)
        if transfer is not None:
            transfer.shutdown()
    except BaseException as e:  # noqa: BLE001 - reported to rank 0 (while starting) and in the exit status
        status = 1
        why = _one_line(e)
        try:
            conn.send(("error", why))
        except OSError:
            pass
        log.error("tensor-parallel rank %d failed: %s", rank, why)
    os._exit(status)


def _one_line(e: BaseException) -> str:
    """`Type: first line of the message` (gloo's errors run over many lines)."""
    text = str(e).strip()
    if isinstance(e, RankFailedError):
        return text.splitlines()[0] if text else "RankFailedError"
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _leader_watch(rank: int, link):
    """RankGroup.watch of a rank on another node (group.py): the leader frozen mid-step (sockets open, no
    heartbeats: nodes.LeaderLink.check) fails the collective's wait instead of gloo's timeout."""
    def leader_alive() -> None:
        try:
            link.check()
        except EOFError as e:
            raise RankFailedError(f"in a collective: {e}") from None

    return leader_alive


def parallel_layout(engine) -> dict[str, int]:
    """What the engine's rank 0 runs, read from the runner it built (not from the arguments asked for):
    tp / dp (ranks of the TP or DEP group), ep (experts sharded over them), sp (the sequence-parallel model of
    seq_parallel.py), nnodes (the group's ranks over those on this node). 1 / 0 for a one-rank engine.
    The worker exports it as k3serve_parallel_layout (workers/metrics.py)."""
    from k3serve.workers.engine.parallel.dp_model import DEPForwardModel

    runner = engine.runner
    model, group = getattr(runner, "model", None), getattr(runner, "group", None)
    size = group.size if group is not None else 1
    local = 1 + sum(1 for _r, proc, _c in getattr(runner, "peers", ()) if not isinstance(proc, multinode.RemoteRank))
    out = dict(tp=1, dp=1, ep=0, sp=0, nnodes=max(1, size // local))
    if isinstance(model, DEPForwardModel):
        out.update(dp=size, ep=1)
    elif isinstance(model, ParallelK3ForwardModel):
        plan = model.plan
        out.update(tp=size, ep=int(plan.expert_parallel), sp=int(isinstance(model, SequenceParallelK3ForwardModel)))
    return out
