"""P/D with tensor-parallel groups spanning nodes, for real: two "nodes" per group on 127.0.0.1 (the leader
`k3serve worker --role prefill|decode --tensor-parallel-size T --nnodes 2 --node-rank 0` and a separate
`--node-rank 1` process tree running the other node's ranks, workers/engine/parallel/nodes.py), NIXL (UCX over
shared memory) between the workers' ranks: a TP2 prefill group (1 rank per node) and a TP4 decode group
(2 ranks per node: the leader's rank 1 is a local process, ranks 2 and 3 the other node's).

Each rank, the other node's too, registers its own pages with its own agent and reports its endpoint to the
leader (JSON over the node's connection); the leader's handshake names every rank, so a decode rank reads
each prefill rank's pages directly, and a decode rank on the other node pulls its own share itself and
reports the outcome to rank 0 (workers/kv_transfer/connector.py). Decode block 32 = 2 x prefill block 16;
every decode rank's free pages are poisoned with 0xFF (NaN) first, so a slice not read shows.

Greedy float64 tokens, and their log-probabilities (to 1e-9), equal the plain reference forward's on a random
config and random prompts: TP2 over 2 nodes -> TP1 decode, and TP2 over 2 nodes -> TP4 over 2 nodes (each
decode rank reads half of one prefill rank's KDA heads, k3serve/common/pd_geometry.py).
"""

from __future__ import annotations

import random
import time

import pytest

from k3serve.proto import worker_pb2 as pb
from k3serve.workers.model.testing import random_config
from tests._engine_helpers import random_model_dir, reference_outputs
from tests._pd_hops import _decode, _reference_logprobs, _sp, prefill_hop
from tests._proc_tree import _listen_addrs, _tree
from tests._workers import _W, ENV, _cli, _free_port, _Proc

SEED = 27  # random_config(27): 3 KDA + 2 MLA layers, 16 routed experts (the prefill group shards them: EP)
POISON = {"K3SERVE_KV_POISON_FREE_PAGES": "1"}


def _group(model, role: str, *extra: str, tp: int = 2, env_extra=None):
    """A TP=tp worker over two nodes: (leader _Proc, node _Proc); the leader serves gRPC once both joined."""
    port = _free_port()
    common = ["--model", str(model), "--role", role, "--tensor-parallel-size", str(tp), "--nnodes", "2",
              "--master-port", str(port), "--metrics-port", "0", *extra]
    env = dict(ENV, **(env_extra or {}))
    leader = _Proc(_cli(*common, "--node-rank", "0", "--grpc-port", "0", "--dtype", "float64",
                        "--max-model-len", "256", "--skip-tokenizer-init"), env=env)
    node = _Proc(_cli(*common, "--node-rank", "1"), env=env)
    return leader, node


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    model = random_model_dir(tmp_path_factory.mktemp("pd-nodes"), SEED)
    procs = {"P": _group(model, "prefill", "--block-size", "16", "--expert-parallel", "--enable-prefix-caching"),
             "D": _group(model, "decode", "--block-size", "32", "--kv-transfer-timeout", "5", tp=4, env_extra=POISON)}
    one = _Proc(_cli("--model", str(model), "--role", "decode", "--grpc-port", "0", "--metrics-port", "0",
                     "--dtype", "float64", "--max-model-len", "256", "--skip-tokenizer-init", "--block-size", "32",
                     "--kv-transfer-timeout", "5"), env=dict(ENV, **POISON))
    workers = {}
    try:
        for name, (leader, node) in procs.items():
            m = leader.wait_line(r"ready grpc=(\S+) metrics=(\S+)", 240)
            node.wait_line(r"node 1 of 2 ready", 60)
            workers[name] = _W(leader.p, m.group(1), m.group(2))
        m = one.wait_line(r"ready grpc=(\S+) metrics=(\S+)", 240)
        workers["D1"] = _W(one.p, m.group(1), m.group(2))
        yield model, workers, procs
    finally:
        for w in workers.values():
            w.channel.close()
        for proc in [one] + [p for pair in procs.values() for p in pair]:
            proc.kill_tree()


def _all_free(w, timeout_s=10.0) -> bool:
    """Every pinned page of every rank released (the decode side's confirmation reached the prefill group)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        load = w.stub.GetLoad(pb.LoadRequest(), timeout=5)
        if load.free_pages == load.total_pages:
            return True
        time.sleep(0.2)
    return False


def test_prefill_group_over_two_nodes_feeds_tp1_and_a_tp4_decode_group_over_two_nodes(groups):
    model, w, procs = groups
    vocab = random_config(SEED).vocab_size
    rng = random.Random(SEED)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (2, 17, 40, rng.randint(60, 110))]
    prompts.append(prompts[2][:33] + [rng.randrange(vocab) for _ in range(5)])  # the prefill side's cache hits
    max_new = 5
    want = reference_outputs(model, prompts, max_new)
    cached, pulled = [], {}
    for dname in ("D1", "D"):
        for i, prompt in enumerate(prompts):
            resps = list(w["P"].stub.Generate(pb.GenerateRequest(
                request_id=f"{dname}-p{i}", prompt_token_ids=prompt,
                sampling_params=_sp(max_new),
                kv_transfer_params=pb.KvTransferParams(do_remote_decode=True)), timeout=120))
            kvp = resps[-1].kv_transfer_params
            cached.append(resps[-1].cached_tokens)
            assert kvp.tp_size == 2 and kvp.block_size == 16 and kvp.remote_num_tokens == len(prompt) - 1
            toks, lps, res = _decode(w[dname], f"{dname}-d{i}", prompt, max_new, kvp)
            assert toks == want[i], (dname, i, res)
            ref = _reference_logprobs(model, prompt, toks)
            assert max(abs(a - b) for a, b in zip(lps, ref)) < 1e-9, (dname, i, lps, ref)
            assert res["outcome"] == "pulled" and res["bytes"] > 0, (dname, i, res)
            assert res["pulled_tokens"] + res["local_cached_tokens"] == len(prompt) - 1, res
            pulled[dname, i] = res["bytes"]
        assert _all_free(w["P"]), dname
    # the two-node decode group's result counts all four ranks' shares (each holds the replicated MLA pages)
    assert all(pulled["D", i] > pulled["D1", i] for i in range(len(prompts))), pulled
    assert cached[4] >= 32 and cached[-1] >= 32, cached  # the 2-node prefill group's prefix cache served it
    # one handshake covers the whole group: both ranks' agents, the other node's too
    resp = w["P"].stub.GetTransferMetadata(pb.TransferMetadataRequest(compatibility_hash=kvp.compatibility_hash),
                                           timeout=10)
    assert resp.tp_size == 2 and [r.tp_rank for r in resp.other_ranks] == [1]
    assert resp.other_ranks[0].agent_name != resp.agent_name
    # everything both groups opened listens on loopback only
    pids = set()
    for leader, node in procs.values():
        pids |= _tree(leader.p.pid) | _tree(node.p.pid)
    bound = _listen_addrs(pids)
    assert bound and all(a.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")) for a in bound), bound


def test_killed_prefill_node_makes_the_leader_exit_and_decode_recompute(groups):
    """Last in the module: it ends the prefill group. The decode group holds parameters from before the
    prefill node died: it recomputes (the request is not lost) and its tokens still equal the reference."""
    model, w, procs = groups
    vocab = random_config(SEED).vocab_size
    prompt = [t % vocab for t in range(7, 50)]
    want = reference_outputs(model, [prompt], 4)[0]
    kvp = prefill_hop(w["P"], "kill-p", prompt, 4)
    leader, node = procs["P"]
    t0 = time.monotonic()
    node.kill_tree()
    rc = leader.p.wait(10)
    assert rc != 0 and time.monotonic() - t0 < 10, leader.output()
    toks, _lps, res = _decode(w["D"], "kill-d", prompt, 4, kvp)
    assert toks == want and res["outcome"] == "recomputed", res
    assert res["reason"] in ("transfer_failed", "peer_unreachable", "timeout"), res
