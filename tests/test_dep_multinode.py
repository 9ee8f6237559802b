"""DEP groups spanning nodes (workers/engine/parallel/dp_engine.py, dp_front.py, nodes.py, node_process.py), two
"nodes" on 127.0.0.1: the leader (node 0: the front, DP ranks 0..per_node-1, the rendezvous at
--master-addr:--master-port) and a `k3serve worker --node-rank 1` process tree running the other DP ranks, which
answer the front over their TCP link in msgpack (workers/engine/parallel/dp_wire.py), never pickle.

* greedy float64 tokens of DP=2 over 2 nodes (1 rank each) and DP=4 over 2 nodes (2 ranks each) equal the
  single-rank engine's and the reference forward's on random configs with prefix caching and chunked prefill:
  a first round spread one request per rank (remote ranks too), then requests one at a time that each go to the
  rank holding their prefix (remote ranks' caches hit); the merged KV-event stream equals the union of every
  rank's cache (remote snapshots come back through dp_wire); everything listens on 127.0.0.1 only;
* the serving leader's /metrics carries per-rank gauges (`engine` = the DP rank, vLLM's label) that follow
  which rank runs what; SIGKILL of the node's process tree -> the leader exits non-zero within 10 s naming
  the lost rank; SIGKILL of the leader -> the node process exits 1 within 10 s;
* the operator's rendered two-node DEP decode group (one StatefulSet of 2 pods, 1 GPU per node) starts for
  real under `k3serve operator simulate` and serves the offline DEP engine's tokens through the gateway.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import grpc
import httpx
import pytest
from _engine_helpers import random_model_dir, reference_outputs
from test_parallel_dp import OPTS, _generate, _keys, _single

from k3serve.proto import worker_pb2 as pb
from k3serve.proto import worker_pb2_grpc as pb_grpc
from k3serve.proto.convert import sampling_to_proto
from k3serve.workers.engine.parallel.nodes import RemoteRank
from k3serve.workers.llm import LLM
from k3serve.workers.model.testing import random_config
from tests._proc_tree import _listen_addrs, _tree
from tests._sim_group import complete, group_leader_ip, kill_pod, offline_completion, one_gpu_node_decode_cr
from tests._workers import ENV, _cli, _free_port, _Proc, assert_node_exits_when_leader_lost


def _rounds(seed: int, vocab: int, n: int):
    """n prompts (one per rank), then n each sharing >= one block with one of the first."""
    import random

    rng = random.Random(seed)
    first = [[rng.randrange(vocab) for _ in range(rng.randint(18, 36))] for _ in range(n)]
    second = [p[: rng.randint(17, len(p))] + [rng.randrange(vocab) for _ in range(rng.randint(1, 4))] for p in first]
    return first, second


def _dep(dp: int, *extra: str) -> list[str]:
    return ["--data-parallel-size", str(dp), "--enable-expert-parallel", "--nnodes", "2", *extra]


@pytest.mark.parametrize("seed,dp", [(10, 2), (39, 4)], ids=["dp2-2x1", "dp4-2x2"])
def test_two_node_dep_greedy_equals_single_rank_and_reference(tmp_path_factory, seed, dp):
    cfg = random_config(seed)
    d = random_model_dir(tmp_path_factory.getbasetemp(), seed)
    rounds = _rounds(seed, cfg.vocab_size, dp)
    ref = reference_outputs(d, rounds[0] + rounds[1], 5)
    single = _single(d, rounds)
    port = _free_port()
    node = _Proc(_cli("--model", str(d), *_dep(dp, "--node-rank", "1", "--master-addr", "127.0.0.1",
                                              "--master-port", str(port), "--metrics-port", "0")))
    try:
        llm = LLM(str(d), data_parallel_size=dp, enable_expert_parallel=True, nnodes=2, master_port=port, **OPTS)
        engine = llm.engine
        merged = []
        engine.subscribe_kv_events(merged.append)
        try:
            remote = [r for r, p, _c in engine.peers if isinstance(p, RemoteRank)]
            assert remote == list(range(dp // 2, dp)) and [r for r, _p, _c in engine.peers] == list(range(1, dp))
            m = node.wait_line(r"node 1 of 2 ready ranks=\[([\d, ]+)\]")
            assert [int(x) for x in m.group(1).split(",")] == remote
            got, first_ranks, _ = _generate(engine, rounds[0], "a")
            assert sorted(first_ranks) == list(range(dp))  # one per rank: the remote ranks ran requests too
            second_ranks, cached = [], []
            for i, p in enumerate(rounds[1]):  # one at a time: the other ranks idle (dummy passes), local or not
                toks, (rank,), (hit,) = _generate(engine, [p], f"b{i}")
                got += toks
                second_ranks.append(rank)
                cached.append(hit)
            stats = engine.stats()
            snaps = [engine.local.kv_cache_snapshot()] + [engine._call(r, ("snapshot",)) for r in range(1, dp)]
            bound = _listen_addrs(_tree(os.getpid()) | _tree(node.p.pid))
        finally:
            engine.close()
        assert node.p.wait(15) == 0, node.output()  # the leader stopped the group: the node exits 0
    finally:
        node.kill_tree()
    assert got == single == ref
    assert second_ranks == first_ranks and all(c > 0 for c in cached), (second_ranks, first_ranks, cached)
    assert stats["dp_requests_routed"] == [2] * dp and len(stats["dp_ranks"]) == dp
    assert stats["prefix_cache_hits"] >= dp
    union = set().union(*(_keys(s) for s in snaps))
    held = set()
    for e in merged:  # the merged stream replayed: each key stored once while any rank holds it
        key = (e.block_hash, e.group_id)
        assert (key in held) == (e.kind == "removed"), e
        (held.discard if e.kind == "removed" else held.add)(key)
    assert held == union and all(_keys(s) for s in snaps)  # every rank, remote ones too, holds blocks
    assert bound and all(a.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")) for a in bound), bound


@pytest.fixture(scope="module")
def dep_model(tmp_path_factory):
    return random_model_dir(tmp_path_factory.getbasetemp(), 10)  # 2 DP ranks: experts divide


def _start_group(model_dir):
    port = _free_port()
    common = ["--model", str(model_dir), *_dep(2), "--master-port", str(port), "--metrics-port", "0",
              "--dtype", "float64", "--max-model-len", "512", "--skip-tokenizer-init", "--served-model-name", "m"]
    leader = _Proc(_cli(*common, "--node-rank", "0", "--grpc-port", "0"))
    node = _Proc(_cli(*common), env=dict(ENV, K3SERVE_NUM_NODES="2", K3SERVE_NODE_RANK="1",
                                          K3SERVE_LEADER_ADDR="localhost"))  # its place as a pod gets it
    lm = leader.wait_line(r"ready grpc=(\S+) metrics=(\S+)")
    nm = node.wait_line(r"node 1 of 2 ready ranks=\[1\] .*metrics=(\S+)")
    return leader, lm.group(1), lm.group(2), node, nm.group(1)


def _rank_gauges(url: str) -> dict[tuple[str, str], float]:
    text = httpx.get(url + "/metrics", timeout=5).text
    return {(m.group(1), m.group(2)): float(m.group(3)) for m in re.finditer(
        r'^k3serve_dp_rank_(num_requests_running|kv_cache_usage_perc)\{engine="(\d+)",model_name="m"\} (\S+)$',
        text, re.M)}


def _wait(cond, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError("condition not reached")


def _long_request(grpc_addr, rid, prompt, streams):
    """A 400-token greedy request over gRPC in a thread (its stream ends when the leader goes)."""
    sp = sampling_to_proto(dict(temperature=0.0, max_tokens=400, ignore_eos=True))

    def run():
        with grpc.insecure_channel(grpc_addr) as ch:
            s = pb_grpc.WorkerStub(ch).Generate(pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                                                   sampling_params=sp), timeout=120)
            streams.append(s)
            try:
                for _ in s:
                    pass
            except grpc.RpcError:  # cancelled, or the leader exits
                pass

    threading.Thread(target=run, daemon=True).start()


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_serving_leader_per_rank_metrics_and_node_death(dep_model, how):
    """killed: the node's sockets close; frozen (SIGSTOP mid-decode, its sockets stay open and a collective
    waits on it): the node link's silence fails the collective's wait (RankGroup.watch), not its 30 s timeout."""
    leader, grpc_addr, lurl, node, _ = _start_group(dep_model)
    try:
        g = _wait(lambda: (lambda g: g if len(g) == 4 else None)(_rank_gauges(lurl)))  # 2 gauges x 2 ranks
        assert g[("num_requests_running", "0")] == g[("num_requests_running", "1")] == 0.0, g
        streams = []
        _long_request(grpc_addr, "a", list(range(3, 40)), streams)
        # a runs on rank 0 alone (the leader's own), then b goes to the idle remote rank 1
        _wait(lambda: _rank_gauges(lurl).get(("num_requests_running", "0")) == 1.0)
        assert _rank_gauges(lurl)[("num_requests_running", "1")] == 0.0
        _long_request(grpc_addr, "b", [(5 * i + 1) % 60 for i in range(30)], streams)
        g = _wait(lambda: (lambda g: g if g.get(("num_requests_running", "1")) == 1.0 else None)(_rank_gauges(lurl)))
        assert g[("num_requests_running", "0")] == 1.0 and g[("kv_cache_usage_perc", "1")] > 0.0, g
        assert httpx.get(lurl + "/health", timeout=5).status_code == 200
        # the layout the front runs, read from its runner (workers/engine/parallel/launcher.py parallel_layout)
        assert re.search(r'^k3serve_parallel_layout\{dp="2",ep="1",model_name="m",nnodes="2",sp="0",tp="1"\} 1\.0$',
                         httpx.get(lurl + "/metrics", timeout=5).text, re.M)
        t0 = time.monotonic()
        if how == "killed":
            node.kill_tree()  # the node pod dies mid-decode: its rank and the node process
        else:
            os.killpg(node.p.pid, signal.SIGSTOP)
        leader.p.wait(10)
        took = time.monotonic() - t0
        if how != "killed":  # thawed: lost, not stopped (no stop in its closed link): exit 1, no traceback
            os.killpg(node.p.pid, signal.SIGCONT)
            assert node.p.wait(15) == 1 and "Traceback" not in node.output(), node.output()
    finally:
        leader.kill_tree()
        node.kill_tree()
    assert leader.p.returncode not in (None, 0) and took < 10, (took, leader.output())
    why = "closed the connection" if how == "killed" else r"was silent for"
    assert re.search(rf"data-parallel rank 1 exited \(status lost: its node \(\S+\) {why}", leader.output()), \
        leader.output()


@pytest.mark.parametrize("how", ["killed", "frozen-mid-decode"])
def test_leader_death_makes_the_dep_node_exit(dep_model, how):
    """killed (idle): the link closes; frozen mid-decode: the rank waits in a collective on the leader, and the
    link's silence (RankGroup.watch) ends the wait."""
    leader, grpc_addr, lurl, node, nurl = _start_group(dep_model)
    try:
        assert httpx.get(nurl + "/health", timeout=5).status_code == 200
        if how != "killed":
            _long_request(grpc_addr, "a", list(range(3, 40)), [])
            _wait(lambda: _rank_gauges(lurl).get(("num_requests_running", "0")) == 1.0)
        assert_node_exits_when_leader_lost(leader, node, how)
        if how != "killed":
            assert "data-parallel rank 1: the group leader" in node.output() and "was silent for" in node.output()
    finally:
        leader.kill_tree()
        node.kill_tree()


def test_operator_simulate_runs_a_rendered_two_node_dep_group(tmp_path, tiny_model_dir):
    """A DEP pool of dataParallelSize=2 with expert parallelism on 1-GPU nodes renders one StatefulSet of 2 pods
    per group, each running `k3serve worker --data-parallel-size 2 --enable-expert-parallel` with its place
    from the pod contract's env (operator/render_workers.py); `k3serve operator simulate` runs them (pod IPs
    127.100.x.N) and the gateway serves the offline DEP2 engine's greedy completion; SIGKILL of the node pod
    makes the leader exit 1 (restartPolicy restarts both)."""
    from _k8s_sim import start_simulation

    cr = one_gpu_node_decode_cr(dataParallelSize=2)
    cr["spec"]["cache"].update(kvCacheMemory="8Mi", maxModelLen=512)
    sim = start_simulation(cr, tmp_path, model_dir=tiny_model_dir, operator=False, timeout=300)
    try:
        assert group_leader_ip(sim, "tiny-decode-0-0", "tiny-decode-0-1").startswith("127.100.")
        got = complete(sim)
        kill_pod(sim, "tiny-decode-0-1")
        deadline = time.monotonic() + 30
        while "pod tiny-decode-0-0 exited with code 1" not in sim.output() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "pod tiny-decode-0-0 exited with code 1" in sim.output(), sim.output()
    finally:
        sim.stop()
    assert "data-parallel rank 1 exited (status lost: its node" in sim.log("tiny-decode-0-0")
    assert got == offline_completion(tiny_model_dir, data_parallel_size=2)


def test_dp_wire_round_trips_the_answers_and_never_unpickles():
    """What a remote DP rank sends: every answer type round-trips exactly; anything else is refused on the
    rank (TypeError), and a frame that is not dp_wire's (a pickle, garbage, an unknown type code) is a
    ValueError on the leader, never an object."""
    import pickle

    import msgpack

    from k3serve.kv_events.types import KVEvent
    from k3serve.outputs import CompletionOutput, Logprob, RequestOutput
    from k3serve.workers.engine.parallel import dp_wire
    from k3serve.workers.kv_transfer.connector import Outcome

    out = RequestOutput("r1", None, [1, 2, 3], [CompletionOutput(0, "", [7, 8], -1.5, [{7: Logprob(-0.5, 1)},
                        {8: Logprob(-1.0, 2, "x"), 9: Logprob(-2.0, 3)}], "length", None)], True, 16,
                        {"arrival_time": 1.25}, {"remote_block_ids": [4, 5]})
    ev = KVEvent("stored", b"\x00\xffhash", None, 1, "kda", 32, 16)
    step = ("ok", [[out], [ev], None, False], [["r1", Outcome("pulled", "", 12, 4, 4096), 0.01, {"mla": 4096}]])
    back = dp_wire.decode(dp_wire.encode(step))
    assert back[0] == "ok" and back[1] == [[out], [ev], None, False]
    assert back[2] == [["r1", Outcome("pulled", "", 12, 4, 4096), 0.01, {"mla": 4096}]]
    assert dp_wire.decode(dp_wire.encode(("loaded", {"threads": 2}))) == ("loaded", {"threads": 2})
    with pytest.raises(TypeError, match="cannot send 'object'"):
        dp_wire.encode(("ok", object(), []))
    for frame in (pickle.dumps(("ok", out, [])), b"\xc1garbage", msgpack.packb(["ok", msgpack.ExtType(99, b"")]),
                  msgpack.packb(["ok", msgpack.ExtType(4, msgpack.packb([1, 2]))]), msgpack.packb({"a": 1})):
        with pytest.raises(ValueError, match="dp_wire"):
            dp_wire.decode(frame)
