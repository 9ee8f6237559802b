"""Ray launching a tensor-parallel group across Ray nodes (workers/engine/parallel/ray_launcher.py): a Ray
cluster of two nodes on this machine (`ray.cluster_utils.Cluster`, each node its own raylet with one CPU
and one GPU *resource* — a count Ray schedules by, no device behind it), every daemon bound to 127.0.0.1.

* TP=2 with K3SERVE_RAY_PLACEMENT_STRATEGY=STRICT_SPREAD: rank 0 (the driver) on its own node, rank 1's
  actor on the other; greedy float64 tokens equal the single-rank engine's and the reference forward's on
  a random config (prefix caching, chunked prefill); every listener of this process tree (Ray's daemons,
  the actor, the rendezvous, gloo) is on 127.0.0.1; the placement group is removed with the runner;
* placement as pure Ray calls: PACK spills onto the second node when one cannot hold the bundles, cuda
  asks for GPU bundles, STRICT_SPREAD with more ranks than nodes and a malformed strategy are clear errors;
* `k3serve worker --distributed-executor-backend ray` against the cluster (RAY_ADDRESS): it serves, and
  SIGKILL of its rank actor's process on the other node makes it exit non-zero within 10 s.
One cluster for the module (start-up takes seconds); its temporary directory is removed at the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from _engine_helpers import engine_outputs, random_model_dir, reference_outputs

from k3serve.workers.engine.parallel import ray_launcher
from tests._proc_tree import _listeners, _tree
from tests._workers import _wait_ready

MAX_NEW = 4
OPTS = dict(dtype="float64", skip_tokenizer_init=True, enable_prefix_caching=True, max_num_batched_tokens=16,
            block_size=16)


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes on 127.0.0.1 (1 CPU + 1 GPU resource each), this process connected as a driver."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # node address and listeners: 127.0.0.1 (ray_launcher.py)
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    ray_constants.ENABLE_RAY_CLUSTER = False  # a ray imported before the variable was set
    temp = tempfile.mkdtemp(prefix="k3ray-")  # short: Ray's unix socket paths live under it
    node = dict(num_cpus=1, num_gpus=1, node_ip_address="127.0.0.1", include_dashboard=False)
    c = Cluster(initialize_head=True, head_node_args=dict(node, temp_dir=temp))
    try:
        second = c.add_node(**node)
        c.wait_for_nodes()
        ray.init(address=c.address, configure_logging=False)
        yield c, second
    finally:
        ray.shutdown()
        c.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def _pg_gone() -> bool:
    import ray

    return all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def test_strict_spread_tp2_one_rank_per_node_greedy_equals_reference(cluster, tmp_path_factory, monkeypatch):
    import random

    import ray

    from k3serve.workers.llm import LLM
    from k3serve.workers.model.testing import random_config

    monkeypatch.setenv(ray_launcher.STRATEGY_ENV, "STRICT_SPREAD")
    seed = 41
    cfg = random_config(seed)
    d = random_model_dir(tmp_path_factory.getbasetemp(), seed)
    rng = random.Random(seed)
    first = [[rng.randrange(cfg.vocab_size) for _ in range(rng.randint(18, 36))] for _ in range(2)]
    rounds = [first, [p[:17] + [rng.randrange(cfg.vocab_size)] for p in first]]  # second round: prefix hits
    ref = reference_outputs(d, [p for r in rounds for p in r], MAX_NEW)
    single = [t for r in rounds for t in engine_outputs(LLM(str(d), **OPTS), r, MAX_NEW)]
    llm = LLM(str(d), distributed_executor_backend="ray", tensor_parallel_size=2, enable_expert_parallel=True,
              **OPTS)
    try:
        (rank, handle, _), = llm.engine.runner.peers
        table = ray.util.placement_group_table(handle.group.pg)
        where = table["bundles_to_node_id"]
        assert table["strategy"] == "STRICT_SPREAD" and rank == 1
        assert where[0] == ray.get_runtime_context().get_node_id() and where[1] != where[0]  # one rank per node
        assert where[1] == cluster[1].node_id
        assert llm.engine.runner.rank_threads[0] >= 1
        got = [t for r in rounds for t in engine_outputs(llm, r, MAX_NEW)]
        stats = llm.engine.stats()
        bound = _listeners(_tree(os.getpid()))
        assert sum(n == "raylet" for n, _a in bound) >= 2, bound  # both nodes' raylets are in this tree
        assert all(a.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")) for _n, a in bound), bound
    finally:
        llm.engine.runner.close()
    assert got == single == ref
    assert stats["prefix_cache_hits"] > 0
    assert _pg_gone()


def test_placement_pack_spills_cuda_asks_gpus_and_no_room_is_clear(cluster, monkeypatch):
    import ray

    me = ray.get_runtime_context().get_node_id()
    for device, kind in (("cpu", "CPU"), ("cuda:0", "GPU")):  # PACK: one node cannot hold two, so it spills
        monkeypatch.delenv(ray_launcher.STRATEGY_ENV, raising=False)
        p = ray_launcher.place(2, device, owns_ray=False)
        try:
            assert p.strategy == "PACK" and p.bundle == {kind: 1.0}
            assert p.node_of[0] == me and p.node_of[1] == cluster[1].node_id
            assert [p.ranks_on_node(r) for r in (0, 1)] == [1, 1]
            assert ray.util.placement_group_table(p.pg)["bundles"] == {0: {kind: 1.0}, 1: {kind: 1.0}}
        finally:
            ray.util.remove_placement_group(p.pg)
    packed = ray_launcher.Placement(None, {"CPU": 1.0}, "PACK", ["a", "a", "b", "b", "a"], False)
    assert [packed.ranks_on_node(r) for r in range(5)] == [3, 3, 2, 2, 3]  # each rank's share of its host
    monkeypatch.setenv(ray_launcher.STRATEGY_ENV, "STRICT_SPREAD")
    monkeypatch.setattr(ray_launcher, "PLACEMENT_TIMEOUT_S", 1.0)
    with pytest.raises(ValueError, match=r"ray: no room for a placement group of 3 one-CPU bundles within 1 s "
                                         r"\(strategy STRICT_SPREAD, rank 0's bundle on the driver's node"):
        ray_launcher.place(3, "cpu", owns_ray=False)
    monkeypatch.setenv(ray_launcher.STRATEGY_ENV, "spread-thin")
    with pytest.raises(ValueError, match=r"K3SERVE_RAY_PLACEMENT_STRATEGY='spread-thin': expected one of PACK"):
        ray_launcher.place(2, "cpu", owns_ray=False)
    assert _pg_gone()


def _rank_actor_pids(raylet_pid: int) -> list[int]:
    """Processes under one node's raylet whose title is Ray's actor title for RankActor."""
    found = []
    for pid in _tree(raylet_pid) - {raylet_pid}:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if title.startswith("ray::RankActor"):
            found.append(pid)
    return found


def test_worker_over_the_ray_cluster_exits_when_its_remote_rank_dies(cluster, tiny_model_dir):
    import grpc

    from k3serve.proto import worker_pb2 as pb
    from k3serve.proto import worker_pb2_grpc as pb_grpc
    from k3serve.proto.convert import sampling_to_proto

    c, second = cluster
    d = tiny_model_dir
    env = dict(os.environ, PYTHONSAFEPATH="1", RAY_ADDRESS=c.address, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               **{ray_launcher.STRATEGY_ENV: "STRICT_SPREAD"})
    cmd = [sys.executable, "-m", "k3serve.cli", "worker", "--model", str(d), "--grpc-port", "0", "--metrics-port",
           "0", "--max-model-len", "256", "--num-threads", "1", "--log-level", "warning", "--dtype", "float64",
           "--tensor-parallel-size", "2", "--enable-expert-parallel", "--distributed-executor-backend", "ray"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    try:
        addr, _murl = _wait_ready(proc, 120, lines)
        with grpc.insecure_channel(addr) as ch:
            req = pb.GenerateRequest(request_id="r1", prompt_token_ids=[5, 17, 33, 2, 9],
                                     sampling_params=sampling_to_proto(dict(temperature=0.0, max_tokens=3,
                                                                            ignore_eos=True)))
            toks = [t for r in pb_grpc.WorkerStub(ch).Generate(req, timeout=60) for o in r.outputs
                    for t in o.token_ids]
        assert len(toks) == 3
        bound = _listeners(_tree(proc.pid))  # the worker: gRPC, metrics, rendezvous, gloo, its Ray driver
        assert bound and all(a.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")) for _n, a in bound), bound
        victims = _rank_actor_pids(second.all_processes["raylet"][0].process.pid)  # rank 1: the other node
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        t0 = time.monotonic()
        rc = proc.wait(timeout=10)
        assert time.monotonic() - t0 < 10 and rc != 0, "".join(lines)
        assert "rank 1 exited" in "".join(lines), "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    deadline = time.monotonic() + 10  # the worker's placement group goes with it (its driver is gone)
    while time.monotonic() < deadline and not _pg_gone():
        time.sleep(0.2)
    assert _pg_gone()
