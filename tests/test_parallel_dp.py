"""DEP decode (workers/engine/parallel/dp_*.py): data_parallel_size=M ranks, attention TP=1 per rank, the
routed experts expert-parallel over the M ranks, one engine to the outside (dp_front.py DPEngine).

Greedy float64 tokens equal the single-rank engine's and the reference forward's on random configs (AttnRes,
MXFP4, LatentMoE with its norm, shared experts), with prefix caching and chunked prefill (a 16-token step
budget): a concurrent round spread over the ranks, then requests one at a time (the other ranks idle, running
dummy passes) that each go to the rank holding their prefix and hit its cache. The merged KV-event stream
equals the union of the ranks' caches; an unrunnable layout is one clear error before any rank starts; a
killed rank fails the engine within the bound and no rank process is left behind.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from _engine_helpers import random_model_dir, reference_outputs

from k3serve.kv_events.types import KVEvent
from k3serve.sampling_params import SamplingParams
from k3serve.workers.engine.parallel.dp_front import KVEventMerger
from k3serve.workers.engine.parallel.launcher import RankFailedError
from k3serve.workers.llm import LLM
from k3serve.workers.model.testing import random_config

MAX_NEW = 5
OPTS = dict(dtype="float64", skip_tokenizer_init=True, enable_prefix_caching=True, max_num_batched_tokens=16,
            block_size=16, prefix_cache_retention_interval=16)  # a KDA snapshot every block: any shared block hits


def _prompts(seed: int, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """A first round, and a second whose prompts each share >= one block with one of the first round's."""
    rng = random.Random(seed)
    first = [[rng.randrange(vocab) for _ in range(rng.randint(18, 40))] for _ in range(3)]
    second = [p[: rng.randint(17, len(p))] + [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
              for p in first]
    return first, second


def _generate(engine, prompts, tag: str):
    """Add every prompt, then step until all finish: (token lists, the rank each went to, cached tokens)."""
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    ranks = []
    for rid, p in zip(rids, prompts):
        engine.add_request(rid, p, sp.clone())
        ranks.append(engine.owner[rid])
    done = {}
    while len(done) < len(rids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return ([done[r].outputs[0].token_ids for r in rids], ranks, [done[r].num_cached_tokens for r in rids])


def _single(d, rounds):
    llm = LLM(str(d), **OPTS)
    first = [o.outputs[0].token_ids for o in llm.generate(rounds[0], _sp())]
    return first + [llm.generate([p], _sp())[0].outputs[0].token_ids for p in rounds[1]]


def _sp():
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _keys(events) -> set:
    return {(e.block_hash, e.group_id) for e in events}


@pytest.mark.parametrize("seed,dp", [(0, 2), (10, 2), (39, 4)],
                         ids=["dp2-latentmoe-norm-shared-attnres", "dp2-mxfp4-latent-attnres", "dp4-mxfp4-latent"])
def test_dep_greedy_equals_single_rank_and_reference(tmp_path_factory, seed, dp):
    cfg = random_config(seed)
    d = random_model_dir(tmp_path_factory.getbasetemp(), seed)
    rounds = _prompts(seed, cfg.vocab_size)
    ref = reference_outputs(d, rounds[0] + rounds[1], MAX_NEW)
    single = _single(d, rounds)
    llm = LLM(str(d), data_parallel_size=dp, enable_expert_parallel=True, **OPTS)
    engine = llm.engine
    merged = []  # the one stream a subscriber (the router) sees
    engine.subscribe_kv_events(merged.append)
    try:
        assert len(engine.peers) == dp - 1
        got, first_ranks, _ = _generate(engine, rounds[0], "a")
        assert len(set(first_ranks)) == min(3, dp)  # spread by load: no two on one rank while one is empty
        second_ranks, cached = [], []
        for i, p in enumerate(rounds[1]):  # one at a time: every other rank idle (dummy passes)
            toks, (rank,), (hit,) = _generate(engine, [p], f"b{i}")
            got += toks
            second_ranks.append(rank)
            cached.append(hit)
        stats = engine.stats()
        snaps = [engine.local.kv_cache_snapshot()] + [engine._call(r, ("snapshot",)) for r in range(1, dp)]
    finally:
        engine.close()
    assert got == single == ref
    assert second_ranks == first_ranks, (cached, [len(p) for p in rounds[1]])  # each went to the rank holding its prefix ...
    assert all(c > 0 for c in cached), cached  # ... and hit its cache there
    assert stats["prefix_cache_hits"] >= len(rounds[1]) and stats["dp_requests_routed"] == [
        first_ranks.count(r) * 2 for r in range(dp)]
    union = set().union(*(_keys(s) for s in snaps))
    held = set()
    for e in merged:  # the merged stream replayed: each key stored once while any rank holds it
        key = (e.block_hash, e.group_id)
        assert (key in held) == (e.kind == "removed"), e
        (held.discard if e.kind == "removed" else held.add)(key)
    assert held == union == _keys(engine.kv_cache_snapshot()) and union
    assert not multiprocessing.active_children()


def test_dep_random_arrivals_and_aborts_match_single_rank(tmp_path_factory):
    """Requests arrive at random steps (ragged per-rank batches: prefill chunks next to decodes, idle ranks),
    some greedy, some seeded sampling, a quarter aborted mid-flight: every request's tokens equal the
    single-rank engine's for the same prompt and parameters (an aborted one's are a prefix of them)."""
    seed = 27
    cfg = random_config(seed)
    d = random_model_dir(tmp_path_factory.getbasetemp(), seed)
    rng = random.Random(seed)
    base = [rng.randrange(cfg.vocab_size) for _ in range(40)]
    reqs = []  # (rid, prompt, params, arrival step, abort step or None)
    for i in range(10):
        prompt = base[: rng.randint(0, 40)] + [rng.randrange(cfg.vocab_size) for _ in range(rng.randint(1, 24))]
        sp = (SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 8), ignore_eos=True) if i % 3 else
              SamplingParams(temperature=1.0, seed=100 + i, max_tokens=rng.randint(1, 8), ignore_eos=True))
        arrive = rng.randint(0, 10)
        reqs.append((f"q{i}", prompt, sp, arrive, arrive + rng.randint(1, 3) if rng.random() < 0.25 else None))
    single = LLM(str(d), **OPTS)
    want = [o.outputs[0].token_ids for o in single.generate([r[1] for r in reqs], [r[2] for r in reqs])]
    llm = LLM(str(d), data_parallel_size=2, enable_expert_parallel=True, **OPTS)
    engine = llm.engine
    got, ranks, aborted = {}, set(), 0
    try:
        step = 0
        while len(got) < len(reqs):
            for rid, prompt, sp, arrive, abort in reqs:
                if arrive == step:
                    engine.add_request(rid, prompt, sp.clone())
                    ranks.add(engine.owner[rid])
                if abort == step and rid not in got:
                    for out in engine.abort_request([rid]):
                        got[rid] = out.outputs[0].token_ids
                        aborted += out.outputs[0].finish_reason == "abort"
            for out in engine.step():
                if out.finished:
                    got[out.request_id] = out.outputs[0].token_ids
            step += 1
            assert step < 500
    finally:
        engine.close()
    assert ranks == {0, 1} and aborted > 0
    for (rid, _p, _sp, _a, abort), w in zip(reqs, want):
        assert got[rid] == w if abort is None else got[rid] == w[: len(got[rid])], rid
    assert not multiprocessing.active_children()


def test_merged_events_store_on_first_holder_and_remove_on_last():
    def ev(kind, h):
        return KVEvent(kind, h, None, 0, "mla", 16, 16)

    m = KVEventMerger()
    assert m.apply(0, ev("stored", b"a")) is not None
    assert m.apply(1, ev("stored", b"a")) is None  # rank 1 computed the same block: no second "stored"
    assert m.apply(1, ev("stored", b"b")).block_hash == b"b"
    assert m.apply(0, ev("removed", b"a")) is None  # rank 1 still holds it
    assert _keys(m.snapshot()) == {(b"a", 0), (b"b", 0)}
    assert m.apply(0, ev("removed", b"b")) is None  # rank 0 never held b
    assert m.apply(1, ev("removed", b"a")).kind == "removed"
    assert _keys(m.snapshot()) == {(b"b", 0)}


@pytest.mark.parametrize("kw,why", [
    (dict(data_parallel_size=3, enable_expert_parallel=True), r"routed experts \(16\) are not divisible over 3"),
    (dict(data_parallel_size=2), "data parallelism needs enable_expert_parallel"),
    (dict(data_parallel_size=2, enable_expert_parallel=True, tensor_parallel_size=2), "attention at TP=1"),
    (dict(data_parallel_size=2, enable_expert_parallel=True, kv_offload_memory=1 << 20), "KV connectors"),
    (dict(data_parallel_size=2, enable_expert_parallel=True, speculative_config={"method": "ngram",
                                                                                 "num_speculative_tokens": 2}),
     "speculative decoding"),
    (dict(data_parallel_size=2, enable_expert_parallel=True, nnodes=3), "data_parallel_size=2 does not split over "
                                                                        "nnodes=3"),
], ids=["experts-not-divisible", "no-expert-parallel", "tp-with-dp", "connectors", "spec", "nnodes"])
def test_unrunnable_layout_is_a_clear_error(tmp_path_factory, kw, why):
    d = random_model_dir(tmp_path_factory.getbasetemp(), 0)
    with pytest.raises(ValueError, match=rf"data_parallel_size={kw['data_parallel_size']}: this layout cannot run "
                                         rf"the model: .*{why}"):
        LLM(str(d), **{**OPTS, **kw})
    assert not multiprocessing.active_children()  # refused before any rank started


def test_an_engine_error_after_the_ranks_started_stops_them(tmp_path_factory):
    d = random_model_dir(tmp_path_factory.getbasetemp(), 0)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="kv_cache_memory: 4096 bytes is too small"):
        LLM(str(d), data_parallel_size=2, enable_expert_parallel=True, kv_cache_memory=4096, **OPTS)
    assert not multiprocessing.active_children() and time.monotonic() - t0 < 30


def test_dense_model_is_refused(tmp_path_factory):
    d = random_model_dir(tmp_path_factory.getbasetemp(), 13)  # no MoE layers
    with pytest.raises(ValueError, match="no MoE layers"):
        LLM(str(d), data_parallel_size=2, enable_expert_parallel=True, **OPTS)


def test_killed_rank_fails_the_engine_within_the_bound(tmp_path_factory):
    d = random_model_dir(tmp_path_factory.getbasetemp(), 10)
    llm = LLM(str(d), data_parallel_size=2, enable_expert_parallel=True, **OPTS)
    engine = llm.engine
    try:
        assert llm.generate([[3, 4, 5, 6]], _sp())[0].finished
        long = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        engine.add_request("x", [1, 2, 3], long)
        engine.add_request("y", [4, 5], long)  # rank 0 has x: y goes to rank 1
        assert (engine.owner["x"], engine.owner["y"]) == (0, 1)
        assert engine.choose_rank([1, 99999], None) == 1  # the less loaded rank now
        with pytest.raises(ValueError, match=r"token id 99999 is outside the vocabulary"):  # refused by rank 1
            engine.add_request("z", [1, 99999], long)
        assert "z" not in engine.owner
        engine.step()
        (fin,) = engine.abort_request(["y", "unknown"])  # to the owning rank; unknown ids are ignored
        assert fin.request_id == "y" and fin.outputs[0].finish_reason == "abort"
        while engine.has_unfinished_requests():
            outs = engine.step()
        assert outs[0].request_id == "x" and len(outs[0].outputs[0].token_ids) == 8
        assert [(s["running"], s["waiting"]) for s in engine.rank_stats()] == [(0, 0), (0, 0)]
        (_rank, proc, _conn), = engine.peers
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RankFailedError, match="data-parallel rank 1 exited"):
            llm.generate([[3, 4, 5, 7], [9, 9, 9]], _sp())
        assert time.monotonic() - t0 < 10
        with pytest.raises(RankFailedError):  # stays failed: never a hang on the broken group
            engine.runner.check_peers()
    finally:
        engine.close()
    assert not multiprocessing.active_children()


LEADER = """
import os, sys, time
from k3serve.workers.llm import LLM
if __name__ == "__main__":
    llm = LLM(sys.argv[1], data_parallel_size=2, enable_expert_parallel=True, dtype="float64",
              skip_tokenizer_init=True)
    print(llm.engine.peers[0][1].pid, flush=True)
    time.sleep(120)
"""


def test_rank_exits_when_its_leader_is_killed(tmp_path_factory):
    d = random_model_dir(tmp_path_factory.getbasetemp(), 10)
    leader = subprocess.Popen([sys.executable, "-c", LEADER, str(d)], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONSAFEPATH="1"))
    try:
        rank_pid = int(leader.stdout.readline())
        leader.kill()
        leader.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(rank_pid, 0)
            except ProcessLookupError:
                break
            with open(f"/proc/{rank_pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    break
            time.sleep(0.1)
        else:
            os.kill(rank_pid, signal.SIGKILL)
            raise AssertionError("the rank outlived its leader by 10 s")
    finally:
        if leader.poll() is None:
            leader.kill()


def test_dep_benchmark_prints_both_and_agrees():
    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "dep_decode.py")
    proc = subprocess.run([sys.executable, bench, "--requests", "2", "--tokens", "3", "--ranks", "2", "--two-node"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONSAFEPATH="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line[:10].strip(): line[10:].split() for line in proc.stdout.splitlines()[2:]}
    assert set(rows) == {"1 rank", "DEP2", "DEP2 2x1"} and "ratio vs 1 rank" in proc.stdout
    for name in ("DEP2", "DEP2 2x1"):  # one node, and over 2 nodes: greedy agrees; the a2a bytes are counted
        assert rows[name][-1] == "True" and float(rows[name][3]) > 0, proc.stdout
