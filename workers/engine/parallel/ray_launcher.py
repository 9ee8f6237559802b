"""Ray as the launcher of a tensor-parallel group (`--distributed-executor-backend ray`, vLLM's spelling).

Rank 0 stays the engine's own process (the Ray driver), as with the mp launcher
(workers/engine/parallel/launcher.py); ranks 1..N-1 are Ray actors, one per rank, placed in one placement
group of N bundles (bundle r for rank r; bundle 0 is the driver's own share, pinned to the driver's Ray node
by its `ray.io/node-id` label). A bundle is one GPU when the engine's device is cuda, else one CPU
(`rank_bundle`; the ranks' collectives are gloo either way, launcher.py). The strategy is
K3SERVE_RAY_PLACEMENT_STRATEGY (Ray's PACK, the default: one node first, spilling onto other nodes when it
cannot hold every bundle; STRICT_SPREAD: one rank per node; SPREAD, STRICT_PACK). The group spans as many
Ray nodes as the placement says: every rank's gloo listener binds its own node's address, rank 0's
rendezvous the driver's, and each rank takes the CPU share of the ranks placed on its node. Each actor runs the same
`rank_main` a spawned rank runs, on a thread, fed through queues instead of a pipe, and the ranks form
the same gloo group over the rendezvous that rank 0 hosts on its Ray node address. `RayRank` stands in
for a rank's Process and Pipe in ParallelModelRunner.peers, so stepping, failure (an actor that dies:
its pings fail, RankFailedError) and shutdown are the mp launcher's.

Ray itself: an existing `ray.init` (or RAY_ADDRESS) is used as it is; otherwise a local Ray starts with
one CPU per rank, no dashboard, no usage stats, and loopback only: `_node_ip_address="127.0.0.1"`
alone is rewritten to the host's address and Ray then listens on every interface, so
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is set too, which keeps the node address and every listener on
127.0.0.1 (measured with ray 2.60.0, tests/test_parallel_ray.py checks it with `ss`).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = float(os.environ.get("K3SERVE_RAY_PLACEMENT_TIMEOUT_S", "120"))
PING_EVERY_S = 0.5


def ensure_ray(num_cpus: int) -> bool:
    """Connect to Ray (started here, loopback only, when there is none); True when this call started it."""
    import sys

    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        import ray

        ray.init(address=os.environ["RAY_ADDRESS"])
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keeps 127.0.0.1 (module docstring); read at import
    import ray
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # the same switch, for a ray imported before the variable was set
    ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             configure_logging=False)
    return True


def driver_address() -> str:
    import ray

    return ray.util.get_node_ip_address()


class _QueueConn:
    """rank_main's end of its 'pipe' inside an actor: recv() from the driver, send() to the driver."""

    def __init__(self):
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()

    def recv(self):
        return self.inbox.get()

    def send(self, msg) -> None:
        self.outbox.put(msg)


class RankActor:
    """One rank as a Ray actor: rank_main on a thread; the methods hand it steps and fetch its messages."""

    def __init__(self, rank: int, spec):
        import dataclasses

        import ray

        from k3serve.workers.engine.parallel.launcher import rank_main

        spec = dataclasses.replace(spec, host=ray.util.get_node_ip_address())  # this rank's gloo listener
        self.conn = _QueueConn()
        threading.Thread(target=rank_main, args=(rank, spec, self.conn), name=f"k3serve-tp-rank-{rank}",
                         daemon=True).start()

    def put(self, obj) -> None:  # the next SchedulerOutput, or None = stop (rank_main then ends the process)
        self.conn.inbox.put(obj)

    def message(self, timeout_s: float):
        try:
            return self.conn.outbox.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def ping(self) -> int:
        return os.getpid()


class RayGroup:
    """The placement group and the Ray session (when started here), released with the last rank."""

    def __init__(self, pg, owns_ray: bool, ranks: int):
        self.pg, self.owns_ray, self.open = pg, owns_ray, ranks

    def release(self) -> None:
        import ray

        self.open -= 1
        if self.open == 0 and ray.is_initialized():
            ray.util.remove_placement_group(self.pg)
            if self.owns_ray:
                ray.shutdown()


class RayRank:
    """The driver's handle of one rank actor: Connection-like (send / poll / recv) and Process-like
    (exitcode / join / kill / sentinel-free), as ParallelModelRunner.peers wants (launcher.py)."""

    def __init__(self, rank: int, actor, group: RayGroup):
        self.rank, self.actor, self.group = rank, actor, group
        self.pending_msg = None  # an ObjectRef of actor.message()
        self.ping_ref = actor.ping.remote()
        self.ping_at = time.monotonic()
        self.dead: str | None = None
        self.stopped = False
        self.closed = False

    # Connection side
    def send(self, obj) -> None:
        self.stopped = self.stopped or obj is None
        self.actor.put.remote(obj)

    def poll(self, timeout_s: float = 0.0) -> bool:
        import ray

        if self.pending_msg is None:
            self.pending_msg = self.actor.message.remote(max(timeout_s, 0.1))
        ready, _ = ray.wait([self.pending_msg], timeout=timeout_s + 0.5)
        if not ready:
            return False
        try:
            msg = ray.get(self.pending_msg)
        except ray.exceptions.RayError:
            return True  # recv raises EOFError
        if msg is None:
            self.pending_msg = None
            return False
        return True

    def recv(self):
        import ray

        while not self.poll(1.0):
            if self.exitcode is not None:
                raise EOFError(self.exitcode)
        ref, self.pending_msg = self.pending_msg, None
        try:
            return ray.get(ref)
        except ray.exceptions.RayError as e:
            raise EOFError(f"rank {self.rank}'s actor failed: {type(e).__name__}") from None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.group.release()

    # Process side
    @property
    def exitcode(self):
        import ray

        if self.dead is not None:
            return self.dead
        ready, _ = ray.wait([self.ping_ref], timeout=0)
        if ready:
            try:
                ray.get(self.ping_ref)
            except ray.exceptions.RayError as e:
                self.dead = 0 if self.stopped else f"lost: its Ray actor died ({type(e).__name__})"
                return self.dead
            if time.monotonic() - self.ping_at >= PING_EVERY_S:
                self.ping_ref, self.ping_at = self.actor.ping.remote(), time.monotonic()
        return None

    def join(self, timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else 3600.0)
        while self.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)
        self.dead = self.dead if self.dead is not None else "killed"


STRATEGY_ENV = "K3SERVE_RAY_PLACEMENT_STRATEGY"
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # Ray's placement group strategies
NODE_ID_LABEL = "ray.io/node-id"  # every Ray node carries it (ray.nodes()[i]["Labels"])


def placement_strategy() -> str:
    """K3SERVE_RAY_PLACEMENT_STRATEGY, default PACK (Ray fills one node first and spills the rest onto other
    nodes when one cannot hold every bundle); STRICT_SPREAD puts every rank on its own node."""
    raw = os.environ.get(STRATEGY_ENV, "PACK")
    if raw.strip().upper() not in STRATEGIES:
        raise ValueError(f"{STRATEGY_ENV}={raw!r}: expected one of {', '.join(STRATEGIES)}")
    return raw.strip().upper()


def rank_bundle(device: str) -> dict[str, float]:
    """One rank's share of a node: a GPU when the engine's device is cuda, else a CPU."""
    return {"GPU": 1.0} if str(device).startswith("cuda") else {"CPU": 1.0}


@dataclass
class Placement:
    """A ready placement group of one bundle per rank; bundle r for rank r, bundle 0 (rank 0, the driver
    itself) pinned to the driver's own Ray node; `node_of[r]`: the Ray node id rank r's bundle landed on."""

    pg: object
    bundle: dict[str, float]
    strategy: str
    node_of: list[str]
    owns_ray: bool

    def ranks_on_node(self, rank: int) -> int:
        """Ranks sharing rank `rank`'s node (each runs its share of that host's CPUs)."""
        return self.node_of.count(self.node_of[rank])


def place(size: int, device: str, owns_ray: bool) -> Placement:
    """Reserve `size` bundles (rank_bundle) with placement_strategy(); bounded wait, a clear error without room."""
    import ray
    from ray.util.placement_group import placement_group_table

    try:
        strategy = placement_strategy()
    except ValueError:
        if owns_ray:
            ray.shutdown()
        raise
    bundle = rank_bundle(device)
    driver_node = ray.get_runtime_context().get_node_id()
    pg = ray.util.placement_group([dict(bundle) for _ in range(size)], strategy=strategy,
                                  bundle_label_selector=[{NODE_ID_LABEL: driver_node}] + [{}] * (size - 1))
    ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        ray.util.remove_placement_group(pg)
        nodes = [(n["NodeID"][:8], n["Resources"].get(next(iter(bundle)), 0.0)) for n in ray.nodes() if n["Alive"]]
        resources = ray.cluster_resources()
        if owns_ray:
            ray.shutdown()
        kind = next(iter(bundle))
        raise ValueError(f"ray: no room for a placement group of {size} one-{kind} bundles within "
                         f"{PLACEMENT_TIMEOUT_S:g} s (strategy {strategy}, rank 0's bundle on the driver's node "
                         f"{driver_node[:8]}; {kind} per node: {nodes}; ray.cluster_resources(): {resources})")
    where = placement_group_table(pg)["bundles_to_node_id"]
    return Placement(pg, bundle, strategy, [where[r] for r in range(size)], owns_ray)


def start_rank_actors(spec, placement: Placement) -> list[tuple[int, RayRank, RayRank]]:
    """Ranks 1..N-1 as actors, rank r in bundle r; each takes its node's CPU share (ranks_per_host)."""
    import dataclasses

    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    size = len(placement.node_of)
    group = RayGroup(placement.pg, placement.owns_ray, size - 1)
    actor_class = ray.remote(RankActor)
    gpu = "GPU" in placement.bundle
    peers = []
    try:
        for rank in range(1, size):
            actor = actor_class.options(
                num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0, name=None, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=placement.pg,
                                                                     placement_group_bundle_index=rank),
            ).remote(rank, dataclasses.replace(spec, ranks_per_host=placement.ranks_on_node(rank)))
            handle = RayRank(rank, actor, group)
            peers.append((rank, handle, handle))
    except BaseException:  # no rank handle will release the group: kill what started, drop the reservation
        for _rank, handle, _ in peers:
            handle.kill()
        ray.util.remove_placement_group(placement.pg)
        if placement.owns_ray:
            ray.shutdown()
        raise
    return peers
