"""The one-wait greedy MTP step (workers/engine/llm_engine.py `_fused_spec`, workers/engine/spec/mtp_graphs.py
`verify_and_draft`: acceptance, observe and the next drafts on the device after the verify, one device->host copy)
against the step it replaces (`_greedy_fast` on the host, then `observe_batch` + `propose_batch`): float64, random
configs (a dense, a LatentMoE and an MXFP4-MoE MTP layer), the fixed-shape drafter run eagerly, batches of 4 with
chunked prefill and prefix caching on, the fixed-shape verify batches on and off. Same drafts at every step, same
tokens, both == the reference forward."""

from __future__ import annotations

import pytest
from test_spec_decode import FIRST, MAX_NEW, MTP_SEEDS, _greedy, _llm, _setup

from k3serve.sampling_params import SamplingParams
from k3serve.workers.engine.spec.mtp_graphs import GraphMTPProposer


def _engine(d, k: int, fused: bool, static: bool, slots: int = 4, positions: int = 256):
    llm = _llm(
        d, {"method": "mtp", "num_speculative_tokens": k}, static_decode=static, max_num_batched_tokens=64
    )
    eng = llm.engine
    prop = eng.proposer
    eng.proposer = GraphMTPProposer(
        prop.cfg, eng.runner.model.w, prop.dtype, k, graphs=False, slots=slots, positions=positions
    )
    eng.fused_spec_step = fused
    steps: list[dict] = []  # every step's drafts as scheduled
    execute = eng.runner.execute

    def record(sched, execute=execute):
        steps.append({rid: list(d) for rid, d in sched.spec_token_ids.items()})
        return execute(sched)

    eng.runner.execute = record
    calls = {"fused": 0, "propose": 0}
    vd, pb = eng.proposer.verify_and_draft, eng.proposer.propose_batch

    def counted_vd(*a, vd=vd):
        calls["fused"] += 1
        return vd(*a)

    def counted_pb(reqs, pb=pb):
        calls["propose"] += 1
        return pb(reqs)

    eng.proposer.verify_and_draft, eng.proposer.propose_batch = counted_vd, counted_pb
    return llm, steps, calls


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("seed", MTP_SEEDS[:3])
def test_one_wait_step_equals_the_two_wait_step(tmp_path_factory, seed, k, static):
    d, cfg, prompts, ref = _setup(tmp_path_factory, seed)
    outs, drafts = [], []
    for fused in (False, True):
        llm, steps, calls = _engine(d, k, fused, static)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(MAX_NEW))])
        drafts.append(steps)
        if fused:
            assert calls["fused"] > 0  # the verify steps took the one-wait path
            assert max(len(s) for s in steps) > 1  # several verify chunks in one step
        else:
            assert calls["fused"] == 0 and calls["propose"] > 0
    assert outs[0] == ref and outs[1] == ref
    assert drafts[1] == drafts[0]  # the same drafts, step by step, hence the same schedule


def test_one_wait_step_pool_growth_resend_and_sampling(tmp_path_factory):
    """The drafter's pool starting at 1 request x 8 positions (grows inside verify_and_draft), a resend that hits
    the prefix cache (drafting over fewer cache entries), and a sampled request in the batch (those steps take the
    rejection sampler: the same tokens as the two-wait engine with the same seed)."""
    seed = MTP_SEEDS[1]
    d, cfg, prompts, ref = _setup(tmp_path_factory, seed)
    got = []
    for fused in (False, True):
        llm, steps, calls = _engine(d, 3, fused, True, slots=1, positions=8)
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(MAX_NEW))]
        assert out == ref
        resend = [p + r[:FIRST] for p, r in zip(prompts, ref)]
        assert [o.outputs[0].token_ids for o in llm.generate(resend, _greedy(MAX_NEW - FIRST))] == [
            r[FIRST:] for r in ref
        ]
        mixed = [_greedy(MAX_NEW)] * 3 + [
            SamplingParams(temperature=0.8, max_tokens=MAX_NEW, seed=7, ignore_eos=True)
        ]
        sampled = [o.outputs[0].token_ids for o in llm.generate(prompts, mixed)]
        assert sampled[:3] == ref[:3]
        got.append((steps, sampled[3]))
        if fused:
            assert (
                calls["fused"] > 0
                and llm.engine.proposer._pool["S"] >= 4
                and llm.engine.proposer._pool["L"] > 8
            )
    assert got[1] == got[0]


class _Req:
    def __init__(self, rid: str, ids: list[int]):
        self.request_id, self.all_token_ids = rid, list(ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@pytest.mark.parametrize("seed", MTP_SEEDS[:3])
def test_verify_and_draft_equals_greedy_then_observe_and_propose(tmp_path_factory, seed):
    """Direct: verify logits whose argmax follows a random number 0..k' of the drafts (so every accepted length,
    k' <= k per request, several requests a batch, rounds in a row), random hidden states; the fused call's tokens,
    accepted counts and next drafts == `_greedy_fast`, then `observe_batch` + `propose_batch` of a twin drafter."""
    import random

    import torch

    from k3serve.workers.engine.spec.rejection_sampler import _greedy_fast

    d, cfg, _prompts, _ref = _setup(tmp_path_factory, seed)
    k = 3
    llm = _llm(d, {"method": "mtp", "num_speculative_tokens": k})
    base = llm.engine.proposer
    A, B = (
        GraphMTPProposer(
            base.cfg, llm.engine.runner.model.w, base.dtype, k, graphs=False, slots=1, positions=16
        )
        for _ in range(2)
    )
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    V, H = cfg.vocab_size, cfg.hidden_size
    reqs = {}
    for i in range(3):  # prompts observed as prefill chunks by both
        n = rng.randint(6, 12)
        ids = [rng.randrange(V) for _ in range(n + 1)]
        hid = torch.randn(n, H, dtype=torch.float64, generator=gen)
        reqs[i] = (_Req(f"r{i}", ids), _Req(f"r{i}", ids))
        A.observe_batch([(reqs[i][0], 0, hid, n)])
        B.observe_batch([(reqs[i][1], 0, hid, n)])
    accepted = set()
    for _round in range(8):
        group = rng.sample(sorted(reqs), rng.randint(1, 3))
        items_a, drafts, rows, counts = [], [], [], []
        for i in group:
            ra = reqs[i][0]
            c = rng.randint(1, k)
            dr = [rng.randrange(V) for _ in range(c)]
            a = rng.randint(0, c)
            lg = torch.randn(1 + c, V, dtype=torch.float64, generator=gen)
            for j in range(a):  # the target agrees with the first a drafts
                lg[j, dr[j]] = lg[j].max() + 1.0
            items_a.append((ra, ra.num_tokens - 1, dr))
            drafts.append(dr)
            rows.append(lg)
            counts.append(c)
        logits = torch.cat(rows)
        hidden = torch.randn(logits.shape[0], H, dtype=torch.float64, generator=gen)
        got = A.verify_and_draft(items_a, logits, hidden)
        want = _greedy_fast(logits, drafts, counts)
        assert [g[0] for g in got] == want.token_ids and [g[1] for g in got] == want.num_accepted
        o, seen = 0, []
        for i, (toks, a, _n), c in zip(group, got, counts):
            ra, rb = reqs[i]
            start = rb.num_tokens - 1
            ra.all_token_ids += toks
            rb.all_token_ids += toks
            seen.append((rb, start, hidden[o : o + a + 1], a + 1))
            o += 1 + c
            accepted.add(a)
        B.observe_batch(seen)
        want_drafts = B.propose_batch([reqs[i][1] for i in group])
        assert [A.drafts_for(reqs[i][0], g[2]) for i, g in zip(group, got)] == want_drafts
        assert all(len(w) == k for w in want_drafts)
    assert accepted >= {0, 1}  # rejections and acceptances both ran


def test_benchmark_rows_for_the_two_wait_step_and_the_ngram_k_sweep(capsys):
    """benchmarks/spec_decode.py --configs mtp,mtp-two-wait,ngram --ngram-ks 2,3 (smallest sizes, demo model): one
    row per config, the same tokens as the baseline, acc@ columns up to the largest k."""
    import os
    import sys

    from k3serve.workers.model.paths import DEMO_MODEL_DIR

    if not (DEMO_MODEL_DIR / "config.json").exists():
        pytest.skip("demo model not in the tree")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import spec_decode

    spec_decode.main(
        [
            "--device",
            "cpu",
            "--prompts",
            "1",
            "--max-tokens",
            "6",
            "--prompt-tokens",
            "24",
            "--k",
            "2",
            "--threads",
            "1",
            "--sets",
            "code",
            "--configs",
            "mtp,mtp-two-wait,ngram",
            "--ngram-ks",
            "2,3",
        ]
    )
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("code")]
    names = ["baseline", "mtp multi_slot", "mtp two-wait", "ngram multi_slot k=2", "ngram multi_slot k=3"]
    assert len(lines) == 2 * len(names)
    for line, name in zip(lines, names):
        assert line.split()[1 : 1 + len(name.split())] == name.split()
        assert "1/1" in line.split()  # greedy: the same tokens as the baseline
    assert "acc@2" in out


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_draft_free_decode_steps_take_the_steps_argmax(tmp_path_factory, method):
    """A speculating engine's steps without drafts (plain decodes: no n-gram match, no room for drafts) take the
    fixed-shape decode step's own argmax (ModelRunner.take_greedy_ids) when every row is plain greedy, as an engine
    without speculation does; tokens == reference; a sampled request in the batch keeps the rejection sampler."""
    d, cfg, prompts, ref = _setup(tmp_path_factory, MTP_SEEDS[0])
    llm = _llm(
        d, {"method": method, "num_speculative_tokens": 3}, static_decode=True, max_num_batched_tokens=64
    )
    runner = llm.engine.runner
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(MAX_NEW))] == ref
    for p, r in zip(prompts, ref):  # alone (batch 1): steps with no drafts at all are decode-only steps
        assert llm.generate([p], _greedy(MAX_NEW))[0].outputs[0].token_ids == r
    n = runner.num_greedy_steps
    assert n > 0
    st = llm.engine.stats()
    assert st["spec_decode_num_drafts"] > 0
    sampled = [SamplingParams(temperature=0.8, max_tokens=MAX_NEW, seed=3, ignore_eos=True)] * len(prompts)
    twice = [[o.outputs[0].token_ids for o in llm.generate(prompts, sampled)] for _ in range(2)]
    assert twice[0] == twice[1] and runner.num_greedy_steps == n


def test_incremental_ngram_index_is_the_reference_rule():
    """NgramDrafter.propose (the per-request n-gram index, extended as tokens are added) == the reference rule
    (workers/model/ngram_proposer.py) at every length of random repetitive sequences grown by 1..4 tokens a step,
    with cuts (a stop string removing tokens) and several requests interleaved."""
    import random

    from k3serve.workers.engine.spec.proposers import NgramDrafter
    from k3serve.workers.model.ngram_proposer import NgramProposer

    rng = random.Random(0)
    hits = 0
    for case in range(60):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        k = rng.randint(1, 7)
        V = rng.choice([2, 3, 5, 20])
        d, ref = NgramDrafter(k, lo, hi), NgramProposer(k, lo, hi)
        reqs = [_Req(f"r{i}", [rng.randrange(V) for _ in range(rng.randint(1, 6))]) for i in range(3)]
        for _step in range(40):
            r = rng.choice(reqs)
            if rng.random() < 0.05 and r.num_tokens > 2:
                del r.all_token_ids[rng.randint(1, r.num_tokens - 1) :]
            else:
                r.all_token_ids += [rng.randrange(V) for _ in range(rng.randint(1, 4))]
            got = d.propose_batch([r])[0]
            assert got == ref.propose(r.all_token_ids) == d.propose_ids(r.all_token_ids), (
                case,
                r.all_token_ids,
            )
            hits += bool(got)
        d.drop("r0")
        assert "r0" not in d._index
    assert hits > 600  # most steps found a match (small vocabularies), so the index's answers were checked
