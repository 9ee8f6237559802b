"""Heterogeneous P/D for real: a `k3serve worker --role prefill --tensor-parallel-size 2` (two rank
processes, each holding half the KDA heads and half of every KDA state page, the MLA latent replicated)
feeds a `--role decode` worker with one rank over NIXL (UCX shared memory). Each prefill rank registers its
own pages with its own agent; the decode worker reads MLA pages from rank 0 and each rank's KDA head slices
into their offsets of its own (twice as large) state page (k3serve/common/pd_geometry.py), its free pages
poisoned with 0xFF (NaN) first, so a slice not read shows. Decode block 32 = 2 x prefill block 16.

Greedy float64 tokens, and their log-probabilities (to 1e-9: a tiny random model's argmax can survive a
wrong state), must equal the plain reference forward's, on two random configs (TP-sliced and
expert-parallel experts) and random prompts, including prompts that hit the prefill worker's prefix cache. A mismatched geometry is a clear
FAILED_PRECONDITION; a killed prefill rank makes that worker exit non-zero within 10 s and the decode side
recompute (the request is not lost).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import grpc
import pytest

from k3serve.proto import worker_pb2 as pb
from tests._engine_helpers import random_model_dir, reference_outputs
from tests._pd_hops import _decode, _reference_logprobs, _sp, decode_hop, prefill_hop
from tests._proc_tree import _listening_sockets, _rank_pids
from tests._workers import _start, worker_group

# random configs whose KDA and MLA heads split over 2 ranks: 23 (3 KDA layers + 1 MLA, MXFP4 experts sliced by
# TP, tied vocabulary padded per rank), 41 (4 KDA + 1 MLA, whole experts per rank: --expert-parallel)
LAYOUTS = [(23, ()), (41, ("--expert-parallel",))]
CACHE = ["--enable-prefix-caching", "--prefix-cache-retention-interval", "dense"]


@pytest.fixture(scope="module", params=LAYOUTS, ids=["seed23-tp", "seed41-ep"])
def layout(request):
    return request.param


@pytest.fixture(scope="module")
def model(tmp_path_factory, layout):
    return random_model_dir(tmp_path_factory.mktemp("pdtp"), layout[0])


@pytest.fixture(scope="module")
def vocab(model):
    from k3serve.workers.model.config import K3Config

    return K3Config.from_pretrained(model).vocab_size


@pytest.fixture(scope="module")
def pair(model, layout):
    procs = {"P": _start(model, "prefill", "--tensor-parallel-size", "2", "--block-size", "16", *layout[1], *CACHE),
             "D": _start(model, "decode", "--block-size", "32", "--kv-transfer-timeout", "5", *CACHE,
                         env_extra={"K3SERVE_KV_POISON_FREE_PAGES": "1"})}
    with worker_group(procs, stop_timeout=10) as out:
        yield out


@pytest.fixture(scope="module")
def tp2_decode(model, layout):
    """A TP=1 prefill worker and a TP=2 decode worker (each decode rank pulls its own share into its own
    pages, poisoned first) on the same model."""
    procs = {"P1": _start(model, "prefill", "--block-size", "16"),
             "D2": _start(model, "decode", "--tensor-parallel-size", "2", "--block-size", "32", *layout[1],
                          "--kv-transfer-timeout", "5", env_extra={"K3SERVE_KV_POISON_FREE_PAGES": "1"})}
    with worker_group(procs, stop_timeout=10) as out:
        yield out


def test_tp2_prefill_to_tp1_decode_equals_reference(pair, model, vocab):
    rng = random.Random(3)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (2, 9, 17, 33, rng.randint(60, 120))]
    # a second round over the first round's prefixes (>= one prefill block): the prefill side's cache hits
    prompts += [p[: rng.randint(17, len(p))] + [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]
                for p in prompts[3:]]
    max_new = 6
    want = reference_outputs(model, prompts, max_new)
    cached = []
    for i, prompt in enumerate(prompts):
        resps = list(pair["P"].stub.Generate(pb.GenerateRequest(
            request_id=f"p{i}", prompt_token_ids=prompt, sampling_params=_sp(max_new),
            kv_transfer_params=pb.KvTransferParams(do_remote_decode=True)), timeout=120))
        kvp = resps[-1].kv_transfer_params
        cached.append(resps[-1].cached_tokens)
        assert kvp.tp_size == 2 and kvp.block_size == 16 and kvp.remote_num_tokens == len(prompt) - 1
        toks, lps, res = _decode(pair["D"], f"d{i}", prompt, max_new, kvp)
        assert toks == want[i], (i, len(prompt), res)
        # greedy tokens of a tiny random model can survive a wrong state; its log-probabilities cannot
        ref = _reference_logprobs(model, prompt, toks)
        assert max(abs(a - b) for a, b in zip(lps, ref)) < 1e-9, (i, lps, ref)
        assert res["outcome"] == "pulled" and res["bytes"] > 0, res
        assert res["pulled_tokens"] + res["local_cached_tokens"] == len(prompt) - 1, res
    assert all(c >= 16 for c in cached[5:]), cached  # the prefill worker's prefix cache served the second round
    # the decode side's confirmation reached rank 0: every pinned page of both ranks is free again
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        load = pair["P"].stub.GetLoad(pb.LoadRequest(), timeout=5)
        if load.free_pages == load.total_pages:
            break
        time.sleep(0.2)
    assert load.free_pages == load.total_pages


def test_into_a_tp2_decode_worker_from_tp1_and_tp2_prefill(pair, tp2_decode, model, vocab):
    """TP=1 prefill -> TP=2 decode (each decode rank reads its half of the heads of the one prefill page) and
    TP=2 -> TP=2 (decode rank r reads prefill rank r's page): tokens and logprobs == the reference."""
    rng = random.Random(4)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 17, 40, rng.randint(60, 110))]
    max_new = 5
    want = reference_outputs(model, prompts, max_new)
    for src, prefill in (("tp1", tp2_decode["P1"]), ("tp2", pair["P"])):
        for i, prompt in enumerate(prompts):
            kvp = prefill_hop(prefill, f"{src}-p{i}", prompt, max_new)
            toks, lps, res = _decode(tp2_decode["D2"], f"{src}-d{i}", prompt, max_new, kvp)
            assert toks == want[i], (src, i, res)
            ref = _reference_logprobs(model, prompt, toks)
            assert max(abs(a - b) for a, b in zip(lps, ref)) < 1e-9, (src, i, lps, ref)
            assert res["outcome"] == "pulled" and res["pulled_tokens"] == len(prompt) - 1, (src, res)
    # the result counts every decode rank's share: both hold the (replicated) MLA pages, so more bytes than
    # the one-rank decode worker pulls for the same prompt
    _t, _l, one = _decode(pair["D"], "one-rank", prompts[-1], 1, prefill_hop(tp2_decode["P1"], "one-p", prompts[-1], 1))
    assert one["outcome"] == "pulled" and res["bytes"] > one["bytes"] > 0, (res, one)
    for prefill in (tp2_decode["P1"], pair["P"]):  # every decode rank done -> the prefill pages were released
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            load = prefill.stub.GetLoad(pb.LoadRequest(), timeout=5)
            if load.free_pages == load.total_pages:
                break
            time.sleep(0.2)
        assert load.free_pages == load.total_pages


def test_transfer_metadata_names_every_rank(pair):
    """One handshake answers for the group: rank 0's agent in the response's fields, rank 1's in other_ranks."""
    import json

    from k3serve.workers.kv_transfer.compat import compatibility_hash
    from k3serve.workers.kv_transfer.handshake import rank_endpoints
    from k3serve.workers.kv_transfer.views import PageGeometry

    kvp = prefill_hop(pair["P"], "md-p", [1, 2, 3, 4, 5], 1)
    resp = pair["P"].stub.GetTransferMetadata(pb.TransferMetadataRequest(compatibility_hash=kvp.compatibility_hash),
                                              timeout=10)
    assert compatibility_hash(json.loads(resp.compatibility_factors)) == kvp.compatibility_hash
    eps = rank_endpoints(resp)
    assert sorted(eps) == [0, 1] and eps[0].agent_name != eps[1].agent_name
    assert len(eps[1].bases) == len(eps[0].bases) > 0
    geom = PageGeometry.from_json(resp.layout)
    assert (geom.tp_size, geom.tp_rank) == (2, 0) and geom.kda_heads == 2 * geom.side().local_heads


def test_mismatched_geometry_is_a_clear_error(pair, vocab):
    prompt = [t % vocab for t in range(5, 40)]
    kvp = prefill_hop(pair["P"], "geo-p", prompt, 4)
    for field, value, says in (("block_size", 48, "not a whole multiple"), ("tp_size", 3, "does not divide")):
        bad = pb.KvTransferParams.FromString(kvp.SerializeToString())
        setattr(bad, field, value)
        with pytest.raises(grpc.RpcError) as e:
            decode_hop(pair["D"], f"geo-{field}", prompt, 4, bad)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, field
        assert says in e.value.details(), e.value.details()


def test_prefill_ranks_listen_on_loopback_only(pair):
    pids = [pair["P"].proc.pid, *_rank_pids(pair["P"].proc.pid)]
    assert len(pids) == 2
    for pid in pids:
        for proto, addr in _listening_sockets(pid):
            ok = addr == "0100007F" if proto in ("tcp", "udp") else addr in (
                "00000000000000000000000001000000", "0000000000000000FFFF00000100007F")
            assert ok, f"{pid} listens on {proto} {addr} (not loopback)"


def test_killed_prefill_rank_exits_the_worker_and_decode_recomputes(pair, model, vocab):
    """Last in the module: it ends the prefill worker. Rank 1 dies while the group computes a prefill hop
    (stopped first, so the hop is surely inside a collective): that call fails instead of hanging, the worker
    exits non-zero within 10 s, and a decode request holding parameters from before recomputes."""
    import threading

    p, d = pair["P"], pair["D"]
    prompt = [t % vocab for t in range(7, 60)]
    want = reference_outputs(model, [prompt], 5)[0]
    kvp = prefill_hop(p, "kill-p", prompt, 5)
    (rank1,) = _rank_pids(p.proc.pid)
    os.kill(rank1, signal.SIGSTOP)
    hop = {}

    def in_flight():
        try:
            prefill_hop(p, "kill-during-p", [t % vocab for t in range(3, 90)], 5)
            hop["outcome"] = "answered"
        except grpc.RpcError as e:
            hop["outcome"] = e.code()
        hop["t"] = time.monotonic()

    th = threading.Thread(target=in_flight, daemon=True)
    th.start()
    time.sleep(1.0)  # the hop is waiting for rank 1 inside the step's collectives
    t0 = time.monotonic()
    os.kill(rank1, signal.SIGKILL)
    rc = p.proc.wait(timeout=10)
    assert rc != 0 and time.monotonic() - t0 < 10
    th.join(10)
    assert hop.get("outcome") not in (None, "answered"), hop  # an error status, not a hang or an answer
    assert hop["t"] - t0 < 10
    toks, res = decode_hop(d, "kill", prompt, 5, kvp)
    assert toks == want and res["outcome"] == "recomputed", res
    assert res["reason"] in ("transfer_failed", "peer_unreachable", "timeout"), res


def test_hetero_benchmark_smoke(tiny_model_dir):
    """benchmarks/pd_hetero_tp.py runs (its own workers on the tiny model) and prints both rows."""
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "pd_hetero_tp.py"
    out = subprocess.run([sys.executable, str(bench), "--requests", "1", "--tokens", "64"], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, PYTHONSAFEPATH="1"), check=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("prefill tp")]
    assert [r.split()[1] for r in rows] == ["tp1", "tp2"], out
