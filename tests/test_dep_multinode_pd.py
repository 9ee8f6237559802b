"""P/D with DEP groups spanning nodes, for real: a `k3serve worker --role prefill` (one rank), and DEP2 workers
as 2 nodes x 1 rank on 127.0.0.1 (the leader `--node-rank 0` and a `--node-rank 1` process tree,
workers/engine/parallel/nodes.py), NIXL (UCX over shared memory) between every rank's own agent.

* TP1 prefill -> DEP2 decode over 2 nodes (the operator's rendered multi-node DEP decode pool): the rank on the
  other node pulls its own requests' pages itself and its outcome reaches the leader's gRPC layer through
  dp_wire (workers/engine/parallel/dp_wire.py); requests land on both ranks;
* DEP2 prefill over 2 nodes -> TP1 decode: the leader's handshake lists the other node's rank's agent (its
  endpoint crossed the node link as plain data), the decode side reads each request from the rank that
  prefilled it, and every prefill rank's pinned pages are released.
Greedy float64 tokens equal the reference forward's; every outcome is "pulled".
"""

from __future__ import annotations

import random
import re
import threading
import time

import httpx
import pytest

from k3serve.proto import worker_pb2 as pb
from k3serve.workers.model.testing import random_config
from tests._engine_helpers import random_model_dir, reference_outputs
from tests._pd_hops import _sp, decode_hop, decode_while_first_runs, prefill_hop
from tests._workers import _W, _cli, _free_port, _Proc

SEED = 0  # random_config(0): LatentMoE (16 experts, norm, shared experts), AttnRes
COMMON = ["--dtype", "float64", "--max-model-len", "256", "--skip-tokenizer-init", "--enable-prefix-caching",
          "--prefix-cache-retention-interval", "dense", "--block-size", "16"]


def _dep_group(model, role: str):
    port = _free_port()
    common = ["--model", str(model), "--role", role, "--data-parallel-size", "2", "--enable-expert-parallel",
              "--nnodes", "2", "--master-port", str(port), "--metrics-port", "0", *COMMON]
    return (_Proc(_cli(*common, "--node-rank", "0", "--grpc-port", "0")), _Proc(_cli(*common, "--node-rank", "1")))


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    model = random_model_dir(tmp_path_factory.mktemp("dep-pd-nodes"), SEED)
    one = {r: _Proc(_cli("--model", str(model), "--role", r, "--grpc-port", "0", "--metrics-port", "0", *COMMON))
           for r in ("prefill", "decode")}
    groups = {r: _dep_group(model, r) for r in ("prefill", "decode")}
    out = {}
    try:
        for r, p in one.items():
            m = p.wait_line(r"ready grpc=(\S+) metrics=(\S+)", 240)
            out["P1" if r == "prefill" else "D1"] = _W(p.p, m.group(1), m.group(2))
        for r, (leader, node) in groups.items():
            m = leader.wait_line(r"ready grpc=(\S+) metrics=(\S+)", 240)
            node.wait_line(r"node 1 of 2 ready ranks=\[1\]", 60)
            out["P2" if r == "prefill" else "D2"] = _W(leader.p, m.group(1), m.group(2))
        yield model, out
    finally:
        for w in out.values():
            w.channel.close()
        for p in [*one.values(), *(x for g in groups.values() for x in g)]:
            p.kill_tree()


def _prompts(n_tokens):
    rng = random.Random(SEED)
    vocab = random_config(SEED).vocab_size
    return [[rng.randrange(vocab) for _ in range(n)] for n in n_tokens]


def test_tp1_prefill_into_a_two_node_dep_decode_group(workers):
    model, w = workers
    prompts = _prompts((37, 21, 50))
    news = [32, 16, 16]  # (the later two long enough that a /metrics poll sees the remote rank running one: with 4
    # new tokens each they could finish between two polls on a loaded 2-core machine, and the test failed once so)
    want = [reference_outputs(model, [p], n)[0] for p, n in zip(prompts, news)]
    kvps = [prefill_hop(w["P1"], f"p{i}", p, n) for i, (p, n) in enumerate(zip(prompts, news))]
    seen = set()  # the DP ranks seen running a request (the leader's per-rank gauges)

    def watch():
        text = httpx.get(w["D2"].murl + "/metrics", timeout=5).text
        seen.update(m.group(1) for m in re.finditer(r'^k3serve_dp_rank_num_requests_running\{engine="(\d)",[^}]*\} '
                                                    r'([1-9]\S*)$', text, re.M))

    # the later ones arrive while the first decodes on rank 0: rank 1 (remote)
    got = decode_while_first_runs(w["D2"], prompts, news, kvps, watch)
    assert seen == {"0", "1"}, seen  # the other node's rank ran requests too
    for i, (toks, res) in enumerate(got):
        assert toks == want[i], (i, res)
        assert res["outcome"] == "pulled" and res["bytes"] > 0, (i, res)
        assert res["pulled_tokens"] + res["local_cached_tokens"] == len(prompts[i]) - 1


def test_two_node_dep_prefill_group_into_tp1_decode(workers):
    model, w = workers
    prompts = _prompts((40, 33))
    want = reference_outputs(model, prompts, 4)
    busy = threading.Thread(target=lambda: list(w["P2"].stub.Generate(pb.GenerateRequest(
        request_id="busy", prompt_token_ids=prompts[1][:5], sampling_params=_sp(150)), timeout=120)))
    busy.start()  # an ordinary request keeps rank 0 busy: the first prefill goes to the idle rank 1 (remote)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not w["P2"].stub.GetLoad(pb.LoadRequest(), timeout=5).running:
        time.sleep(0.01)
    kvps = [prefill_hop(w["P2"], "q0", prompts[0], 4)]
    busy.join(120)
    kvps.append(prefill_hop(w["P2"], "q1", prompts[1], 4))  # both idle: rank 0
    assert kvps[0].remote_engine_id != kvps[1].remote_engine_id, kvps  # one request on each rank
    meta = w["P2"].stub.GetTransferMetadata(pb.TransferMetadataRequest(
        compatibility_hash=kvps[0].compatibility_hash), timeout=10)
    assert [r.engine_id for r in meta.dp_ranks] == [kvps[0].remote_engine_id], meta  # rank 1, the other node
    for i in range(2):
        toks, res = decode_hop(w["D1"], f"e{i}", prompts[i], 4, kvps[i])
        assert toks == want[i] and res["outcome"] == "pulled", (i, res)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # every rank's pinned pages released once decode confirmed
        load = w["P2"].stub.GetLoad(pb.LoadRequest(), timeout=5)
        if load.free_pages == load.total_pages:
            break
        time.sleep(0.2)
    assert load.free_pages == load.total_pages, load
