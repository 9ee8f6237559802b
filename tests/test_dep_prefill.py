"""P/D from a DEP prefill pool, for real: `k3serve worker --role prefill --data-parallel-size 2
--enable-expert-parallel` (each DP rank a whole engine with its own pages, NIXL connector and agent) feeds a
one-rank decode worker, a DEP2 decode worker and a TP2 decode worker over NIXL (UCX over shared memory), driven over gRPC the way
the router does (tests/test_pd_workers.py's hops).

A request's transfer parameters name the engine of the DP rank that prefilled it; the prefill worker's one
handshake lists every DP rank's agent (`dp_ranks`, workers/kv_transfer/dp_group.py), so the decode side reads
that rank's pages and its notification frees them on that rank (the TP2 decode worker's rank 0 sends it once
both decode ranks' READs are done: to the agent of the prefill rank that holds the pages). Prefill hops sent together spread over both
prefill ranks (the front's load rule); decode block 32 = 2 x prefill block 16 (design doc §5.4/§5.5), the
decode workers' free pages poisoned with 0xFF (NaN) first. Greedy float64 tokens and their log-probabilities
(to 1e-9) equal the plain reference forward's on a random config and random prompts, and every pinned page of
both prefill ranks is free again afterwards.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from k3serve.proto import worker_pb2 as pb
from k3serve.workers.model.testing import random_config
from tests._engine_helpers import random_model_dir, reference_outputs
from tests._pd_hops import _decode, _reference_logprobs, _sp, _together, prefill_hop
from tests._proc_tree import _rank_pids
from tests._workers import _start, worker_group

SEED = 6  # random_config(6): 4 KDA + 2 MLA layers (heads split over 2 TP ranks), 8 routed experts
DEP = ["--data-parallel-size", "2", "--enable-expert-parallel"]
POISON = {"K3SERVE_KV_POISON_FREE_PAGES": "1"}


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    model = random_model_dir(tmp_path_factory.mktemp("dep-prefill"), SEED)
    procs = {"P": _start(model, "prefill", *DEP, "--block-size", "16", "--enable-prefix-caching",
                         "--max-num-batched-tokens", "16"),
             "D1": _start(model, "decode", "--block-size", "32", "--kv-transfer-timeout", "5", env_extra=POISON),
             "D2": _start(model, "decode", *DEP, "--block-size", "32", "--kv-transfer-timeout", "5",
                          env_extra=POISON),
             "D3": _start(model, "decode", "--tensor-parallel-size", "2", "--block-size", "32",
                          "--kv-transfer-timeout", "5", env_extra=POISON)}
    with worker_group(procs, stop_timeout=15) as out:
        yield model, out


def _hop(w, rid, prompt, max_new):
    """prefill_hop's transfer parameters and the prefill worker's prefix-cache hit (cached_tokens)."""
    resps = list(w.stub.Generate(pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                                    sampling_params=_sp(max_new),
                                                    kv_transfer_params=pb.KvTransferParams(do_remote_decode=True)),
                                 timeout=120))
    assert len(resps) == 1 and resps[0].finished and resps[0].HasField("kv_transfer_params")
    assert resps[0].kv_transfer_params.remote_num_tokens == len(prompt) - 1
    return resps[0].kv_transfer_params, resps[0].cached_tokens


def test_dep2_prefill_to_tp1_dep2_and_tp2_decode_equals_reference(pool):
    model, w = pool
    vocab = random_config(SEED).vocab_size
    rng = random.Random(SEED)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(20, 70))] for _ in range(4)]
    max_new = 5
    want = reference_outputs(model, prompts, max_new)
    engines, cached = set(), {}
    for dname in ("D1", "D2", "D3"):
        hops = _together(lambda i, d=dname: _hop(w["P"], f"{d}-p{i}", prompts[i], max_new), len(prompts))
        kvps = [k for k, _c in hops]
        cached[dname] = [c for _k, c in hops]
        engines |= {k.remote_engine_id for k in kvps}
        assert all(k.tp_size == 1 and k.block_size == 16 for k in kvps)
        got = _together(lambda i, d=dname, k=kvps: _decode(w[d], f"{d}-d{i}", prompts[i], max_new, k[i]),
                        len(prompts))
        for i, (toks, lps, res) in enumerate(got):
            assert toks == want[i], (dname, i, res)
            ref = _reference_logprobs(model, prompts[i], toks)
            assert max(abs(a - b) for a, b in zip(lps, ref)) < 1e-9, (dname, i, lps, ref)
            assert res["outcome"] == "pulled" and res["bytes"] > 0, (dname, i, res)
            assert res["pulled_tokens"] + res["local_cached_tokens"] == len(prompts[i]) - 1, (dname, i, res)
    # the same prompts again: a hop goes to the rank that cached it unless that rank is busier than the hit is
    # worth (the front's rule; these hops arrive together), so each later round has prefix-cache hits
    assert cached["D1"] == [0] * len(prompts), cached
    assert max(cached["D2"]) >= 16 and max(cached["D3"]) >= 16, cached
    # the prefill hops landed on both DP ranks (their engines), and one handshake names both ranks' agents
    assert len(engines) == 2, engines
    resp = w["P"].stub.GetTransferMetadata(pb.TransferMetadataRequest(compatibility_hash=kvps[0].compatibility_hash),
                                           timeout=10)
    assert [r.dp_rank for r in resp.dp_ranks] == [1] and resp.tp_size == 1
    assert {resp.engine_id, resp.dp_ranks[0].engine_id} == engines
    assert resp.dp_ranks[0].agent_name != resp.agent_name
    # every decode pull's notification reached the rank holding its pages: all pages of both ranks free again
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        load = w["P"].stub.GetLoad(pb.LoadRequest(), timeout=5)
        if load.free_pages == load.total_pages:
            break
        time.sleep(0.2)
    assert load.free_pages == load.total_pages, load


def test_malformed_dp_ranks_in_transfer_metadata_are_refused():
    """A handshake answer whose dp_ranks do not name ranks 1..M-1 once each, each with its own engine id (or
    that names them for a tensor-parallel worker) is IncompatiblePeer: no agent is installed from it."""
    from k3serve.workers.kv_transfer.compat import IncompatiblePeer
    from k3serve.workers.kv_transfer.handshake import dp_endpoints

    def resp(*ranks, tp_size=1):
        return pb.TransferMetadataResponse(engine_id="e0", tp_size=tp_size, dp_ranks=[
            pb.TransferRankMetadata(dp_rank=r, engine_id=e, agent_name=f"a{r}", region_base_addrs=[1]) for r, e in ranks])

    assert set(dp_endpoints(resp((1, "e1"), (2, "e2")))) == {"e1", "e2"}
    assert dp_endpoints(resp()) == {}
    for bad in (resp((1, "e1"), (1, "e2")), resp((1, "e1"), (2, "e1")), resp((1, "")), resp((1, "e0")),
                resp((2, "e2")), resp((0, "e1")), resp((1, "e1"), tp_size=2)):
        with pytest.raises(IncompatiblePeer):
            dp_endpoints(bad)


def test_killed_prefill_rank_exits_the_worker_and_decode_recomputes(pool):
    """Last in the module: it ends the prefill worker. Parameters of a request whose pages sit on DP rank 1;
    SIGKILL of that rank makes the worker exit non-zero within 10 s, and the decode worker holding them
    recomputes (the request is not lost, the tokens are the reference's)."""
    model, w = pool
    vocab = random_config(SEED).vocab_size
    rng = random.Random(SEED + 1)
    md = w["P"].stub.GetTransferMetadata(pb.TransferMetadataRequest(
        compatibility_hash=prefill_hop(w["P"], "kill-md", [1, 2, 3], 1).compatibility_hash), timeout=10)
    on_rank1 = None
    for attempt in range(3):  # hops sent together spread over both ranks (the front's load rule)
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(30, 60))] for _ in range(3)]
        kvps = _together(lambda i, a=attempt, ps=prompts: prefill_hop(w["P"], f"kill-{a}-{i}", ps[i], 4), 3)
        hits = [i for i, k in enumerate(kvps) if k.remote_engine_id == md.dp_ranks[0].engine_id]
        if hits:
            on_rank1 = prompts[hits[0]], kvps[hits[0]]
            break
    assert on_rank1 is not None, "no prefill hop landed on DP rank 1"
    prompt, kvp = on_rank1
    want = reference_outputs(model, [prompt], 4)[0]
    (rank1,) = _rank_pids(w["P"].proc.pid)
    t0 = time.monotonic()
    os.kill(rank1, signal.SIGKILL)
    rc = w["P"].proc.wait(timeout=10)
    assert rc != 0 and time.monotonic() - t0 < 10
    toks, _lps, res = _decode(w["D1"], "kill-d", prompt, 4, kvp)
    assert toks == want and res["outcome"] == "recomputed", res
    assert res["reason"] in ("transfer_failed", "peer_unreachable", "timeout"), res
