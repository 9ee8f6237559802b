"""Rank groups spanning nodes (workers/engine/parallel/nodes.py, node_process.py), two "nodes" on 127.0.0.1:
the leader (node 0: the engine and rank 0, hosting the rendezvous at --master-addr:--master-port) and a
`k3serve worker --node-rank 1` process running the other ranks, each a separate process tree.

* greedy float64 tokens of TP=2 over 2 nodes (1 rank each) and TP=4 over 2 nodes (2 ranks each) equal
  the single-rank engine's and the reference forward's, on random configs with prefix caching and
  chunked prefill; everything the group opens listens on 127.0.0.1 only;
* health: SIGKILL or SIGSTOP (a hung node: heartbeats stop, sockets stay open) of the non-leader node's
  process tree -> the serving leader exits non-zero within 10 s naming the lost rank; SIGKILL or SIGSTOP
  of the leader -> the node process exits non-zero within 10 s;
* the non-leader node takes its place from the pod contract's env (K3SERVE_NUM_NODES, K3SERVE_NODE_RANK,
  K3SERVE_LEADER_ADDR) as a rendered pod does;
* bounded rendezvous: a node with no leader, and a leader whose node never comes, each fail within their
  timeout with a message naming the address they waited for.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import httpx
import pytest
from _engine_helpers import engine_outputs, random_model_dir, reference_outputs

from k3serve.workers.engine.parallel import nodes
from k3serve.workers.engine.parallel.group import RendezvousError
from k3serve.workers.engine.parallel.nodes import RemoteRank
from k3serve.workers.llm import LLM
from k3serve.workers.model.testing import random_config
from tests._proc_tree import _listen_addrs, _tree
from tests._sim_group import (
    complete,
    complete_when,
    group_leader_ip,
    kill_pod,
    offline_completion,
    one_gpu_node_decode_cr,
)
from tests._workers import ENV, _cli, _free_port, _Proc, assert_node_exits_when_leader_lost

MAX_NEW = 4
OPTS = dict(dtype="float64", skip_tokenizer_init=True, enable_prefix_caching=True, max_num_batched_tokens=16,
            block_size=16)


def _prompts(seed: int, vocab: int):
    import random

    rng = random.Random(seed)
    first = [[rng.randrange(vocab) for _ in range(rng.randint(18, 36))] for _ in range(2)]
    second = [p[: rng.randint(17, len(p))] + [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
              for p in first]
    return [first, second]


@pytest.mark.parametrize("seed,tp,ep", [(77, 2, True), (2, 4, True)], ids=["tp2-2x1", "tp4-2x2"])
def test_two_node_group_greedy_equals_single_rank_and_reference(tmp_path_factory, seed, tp, ep):
    cfg = random_config(seed)
    d = random_model_dir(tmp_path_factory.getbasetemp(), seed)
    rounds = _prompts(seed, cfg.vocab_size)
    flat = [p for r in rounds for p in r]
    ref = reference_outputs(d, flat, MAX_NEW)
    single = [t for r in rounds for t in engine_outputs(LLM(str(d), **OPTS), r, MAX_NEW)]
    port = _free_port()
    node = _Proc(_cli("--model", str(d), "--tensor-parallel-size", str(tp), "--nnodes", "2", "--node-rank", "1",
                      "--master-addr", "127.0.0.1", "--master-port", str(port), "--metrics-port", "0"))
    try:
        llm = LLM(str(d), tensor_parallel_size=tp, enable_expert_parallel=ep, nnodes=2, master_port=port, **OPTS)
        try:
            runner = llm.engine.runner
            assert [r for r, _p, _c in runner.peers] == list(range(1, tp))
            assert sum(1 for _r, p, _c in runner.peers if isinstance(p, RemoteRank)) == tp // 2
            m = node.wait_line(r"node 1 of 2 ready ranks=\[([\d, ]+)\].*metrics=(\S+)")
            assert [int(x) for x in m.group(1).split(",")] == list(range(tp // 2, tp))
            assert httpx.get(m.group(2) + "/health", timeout=5).status_code == 200
            metrics = httpx.get(m.group(2) + "/metrics", timeout=5).text
            assert re.search(rf"^k3serve_node_ranks_ready {tp // 2}\.0$", metrics, re.M), metrics
            got = [t for r in rounds for t in engine_outputs(llm, r, MAX_NEW)]
            stats = llm.engine.stats()
            bound = _listen_addrs(_tree(os.getpid()) | _tree(node.p.pid))
            assert bound, "the group opened no listener?"
            assert all(a.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")) for a in bound), bound
        finally:
            llm.engine.runner.close()
        assert node.p.wait(15) == 0, node.output()  # the leader stopped the group: the node exits 0
    finally:
        node.kill_tree()
    assert got == single == ref
    assert stats["prefix_cache_hits"] > 0


@pytest.fixture(scope="module")
def tp2_model(tmp_path_factory):
    return random_model_dir(tmp_path_factory.getbasetemp(), 23)  # TP2 without expert parallelism


def _start_group(model_dir):
    port = _free_port()
    common = ["--model", str(model_dir), "--tensor-parallel-size", "2",
              "--master-port", str(port), "--metrics-port", "0", "--dtype", "float64", "--max-model-len", "128",
              "--skip-tokenizer-init"]
    leader = _Proc(_cli(*common, "--nnodes", "2", "--node-rank", "0", "--grpc-port", "0"))
    # the node's place as a pod gets it (the pod contract's env, docs/components.md), not as flags
    node = _Proc(_cli(*common), env=dict(ENV, K3SERVE_NUM_NODES="2", K3SERVE_NODE_RANK="1",
                                          K3SERVE_LEADER_ADDR="localhost"))
    lm = leader.wait_line(r"ready grpc=(\S+) metrics=(\S+)")
    nm = node.wait_line(r"node 1 of 2 ready .*metrics=(\S+)")
    return leader, lm.group(2), node, nm.group(1)


def test_node_death_makes_the_leader_unhealthy_and_exit(tp2_model):
    leader, lurl, node, _ = _start_group(tp2_model)
    try:
        assert httpx.get(lurl + "/health", timeout=5).status_code == 200
        t0 = time.monotonic()
        node.kill_tree()  # the pod dies: the node process and its rank
        leader.p.wait(10)
        took = time.monotonic() - t0
        assert leader.p.returncode not in (None, 0), leader.output()
        assert took < 10, took
        assert re.search(r"tensor-parallel rank 1 exited \(status lost", leader.output()), leader.output()
    finally:
        leader.kill_tree()
        node.kill_tree()


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_leader_death_makes_the_node_exit(tp2_model, how):
    """killed: the connection closes; frozen (SIGSTOP, its sockets stay open): its heartbeats stop."""
    leader, _, node, nurl = _start_group(tp2_model)
    try:
        assert httpx.get(nurl + "/health", timeout=5).status_code == 200
        assert_node_exits_when_leader_lost(leader, node, how)
    finally:
        leader.kill_tree()
        node.kill_tree()


def test_frozen_node_makes_the_leader_exit_and_then_exits_itself(tp2_model):
    """A node that stops answering (SIGSTOP: no FIN, no heartbeats) is lost after the heartbeat timeout;
    the leader exits non-zero within 10 s; thawed, the node finds its link closed with no stop in it (it was
    lost, not stopped: launcher.stop_ranks) and exits 1 (mid-decode: tests/test_tp_multinode_health.py)."""
    leader, lurl, node, _ = _start_group(tp2_model)
    try:
        assert httpx.get(lurl + "/health", timeout=5).status_code == 200
        t0 = time.monotonic()
        os.killpg(node.p.pid, signal.SIGSTOP)
        leader.p.wait(10)
        assert leader.p.returncode not in (None, 0) and time.monotonic() - t0 < 10, leader.output()
        assert re.search(r"tensor-parallel rank 1 exited \(status lost: its node \(\S+\) was silent for",
                         leader.output()), leader.output()
        os.killpg(node.p.pid, signal.SIGCONT)
        assert node.p.wait(15) == 1 and "Traceback" not in node.output(), node.output()
    finally:
        leader.kill_tree()
        node.kill_tree()


def test_node_without_leader_fails_within_its_timeout_naming_the_address(tp2_model):
    port = _free_port()
    t0 = time.monotonic()
    node = _Proc(_cli("--model", str(tp2_model), "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
                      "--master-port", str(port), "--metrics-port", "0"),
                 env=dict(ENV, K3SERVE_RENDEZVOUS_TIMEOUT_S="3"))
    try:
        assert node.p.wait(60) == 1, node.output()
        assert time.monotonic() - t0 < 60
        assert f"rendezvous: no group leader answered at 127.0.0.1:{port} within 3 s" in node.output()
    finally:
        node.kill_tree()


def test_leader_without_its_node_fails_within_its_timeout(tp2_model, monkeypatch):
    monkeypatch.setattr(nodes, "RENDEZVOUS_TIMEOUT_S", 2.0)
    port = _free_port()
    with pytest.raises(RendezvousError, match=rf"ranks \[1\] \(of nodes \[1\]\) never joined the group at "
                                              rf"127\.0\.0\.1:{port}"):
        LLM(str(tp2_model), tensor_parallel_size=2, nnodes=2, master_port=port, **OPTS)
    # the serving leader: the same as one line, exit 1
    p = subprocess.run(_cli("--model", str(tp2_model), "--tensor-parallel-size", "2", "--nnodes", "2",
                            "--master-port", str(port), "--grpc-port", "0", "--metrics-port", "0",
                            "--skip-tokenizer-init"), capture_output=True, text=True, timeout=120,
                       env=dict(ENV, K3SERVE_RENDEZVOUS_TIMEOUT_S="2"))
    assert p.returncode == 1 and "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    assert f"k3serve: error: rendezvous: ranks [1] (of nodes [1]) never joined the group at 127.0.0.1:{port}" \
        in p.stdout + p.stderr


def test_layouts_that_cannot_span_nodes_are_one_line_exit_2(tp2_model):
    bad_env = subprocess.run(_cli("--model", str(tp2_model)), capture_output=True, text=True, timeout=120,
                             env=dict(ENV, K3SERVE_NUM_NODES="two"))
    assert bad_env.returncode == 2 and "K3SERVE_NUM_NODES='two': expected a whole number" in bad_env.stdout
    for args, why in [(["--tensor-parallel-size", "3", "--nnodes", "2"], "does not split over --nnodes=2"),
                      (["--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "2"],
                       "--node-rank 2 is not in 0..1")]:
        p = subprocess.run(_cli("--model", str(tp2_model), *args), capture_output=True, text=True, env=ENV,
                           timeout=120)
        assert p.returncode == 2 and why in p.stdout + p.stderr, p.stdout + p.stderr
    # (P/D with ranks on other nodes runs: tests/test_pd_multinode.py)


def test_operator_simulate_runs_a_rendered_two_node_group(tmp_path, tiny_model_dir):
    """The operator's multi-node rendering for real: a decode pool of TP=2 on 1-GPU nodes renders one
    StatefulSet of 2 pods per group (operator/render_workers.py); `k3serve operator simulate` runs them
    (pod IPs 127.100.x.N, the leader's headless DNS name resolved to its pod) and the router's gateway
    serves greedy completions equal to the offline TP=2 engine on the same checkpoint; SIGKILL of the
    node pod makes the leader exit 1, the restarted pods form the group again and serve the same tokens;
    stopping the pods together stops the group cleanly (no lost-rank failure on either side)."""
    from _k8s_sim import start_simulation

    cr = one_gpu_node_decode_cr(tensorParallelSize=2)
    cr["spec"]["cache"].update(kvCacheMemory="8Mi", maxModelLen=512)
    sim = start_simulation(cr, tmp_path, model_dir=tiny_model_dir, operator=False, timeout=300)
    try:
        assert "ready grpc=" in sim.log("tiny-decode-0-0"), sim.log("tiny-decode-0-0")
        assert group_leader_ip(sim, "tiny-decode-0-0", "tiny-decode-0-1").startswith("127.100.")
        first = complete(sim)
        # the node pod dies: the leader exits non-zero, both are restarted (restartPolicy), the group forms again
        kill_pod(sim, "tiny-decode-0-1")
        again = complete_when(sim, "pod tiny-decode-0-0 exited with code 1; restart 1", 150)
        assert again is not None, sim.output()
    finally:
        sim.stop()
    leader_log, node_log = sim.log("tiny-decode-0-0"), sim.log("tiny-decode-0-1")
    assert "tensor-parallel rank 1 exited (status lost: its node" in leader_log, leader_log
    # the pods are stopped together: the node gives the leader time to stop the group, so nobody sees a lost rank
    leader_last = leader_log.rsplit("ready grpc=", 1)[1]
    node_last = node_log.rsplit("node 1 of 2 ready", 1)[1]
    assert "the engine failed" not in leader_last and "exited (status" not in node_last, leader_last + node_last
    assert first == again == offline_completion(tiny_model_dir, tensor_parallel_size=2)
