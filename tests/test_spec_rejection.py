"""Rejection sampling (workers/engine/spec/rejection_sampler.py): greedy == the plain sampler token for
token, and sampling with speculation emits tokens distributed exactly as the target (chi-square)."""

from __future__ import annotations

import random

import pytest
import torch

from k3serve.sampling_params import SamplingParams
from k3serve.workers.engine.spec import rejection_sampler as rs
from k3serve.workers.engine.spec.rejection_sampler import RejectionSampler, greedy_verify
from k3serve.workers.sampler import Sampler, SamplingState, make_generator

torch.set_num_threads(1)


def _sequential_greedy(logits, state, drafts):
    """What the plain Sampler emits, one position at a time, while it agrees with the drafts."""
    sampler = Sampler(seed=0)
    out = []
    for j in range(len(drafts) + 1):
        st = SamplingState(state.params, state.prompt_token_ids, state.output_token_ids + list(drafts[:j]),
                           None, state.eos_token_id)
        tok = sampler(logits[j : j + 1], [st]).token_ids[0]
        out.append(tok)
        if j == len(drafts) or tok != drafts[j]:
            return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_greedy_equals_sequential_sampler_with_penalties(dtype):
    rng = random.Random(7)
    vocab = 23
    for trial in range(30):
        n = rng.randint(1, 5)
        states, drafts, blocks = [], [], []
        for _ in range(n):
            k = rng.randint(0, 5)
            logits = torch.randn(1 + k, vocab, generator=torch.Generator().manual_seed(rng.randrange(10**6)),
                                 dtype=dtype) * 3
            # drafts: a random mix of the argmax (accepted) and random tokens (rejected)
            d = [int(logits[j].argmax()) if rng.random() < 0.7 else rng.randrange(vocab) for j in range(k)]
            params = SamplingParams(
                temperature=0.0,
                repetition_penalty=rng.choice([1.0, 1.3]),
                frequency_penalty=rng.choice([0.0, 0.5]),
                presence_penalty=rng.choice([0.0, 0.7]),
                min_tokens=rng.choice([0, 3]),
                logit_bias={rng.randrange(vocab): 2.0} if rng.random() < 0.5 else None,
            )
            out = [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
            states.append(SamplingState(params, [rng.randrange(vocab) for _ in range(4)], out, None,
                                        eos_token_id=rng.randrange(vocab)))
            drafts.append(d)
            blocks.append(logits)
        logits = torch.cat(blocks)
        before = logits.clone()
        got = RejectionSampler(Sampler(seed=1))(logits, states, drafts)
        assert torch.equal(logits, before)
        for i in range(n):
            want = _sequential_greedy(blocks[i], states[i], drafts[i])
            assert got.token_ids[i] == want, (trial, i)
            assert got.num_accepted[i] == len(want) - 1
            assert got.token_ids[i][:-1] == drafts[i][: got.num_accepted[i]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_plain_greedy_fast_path_equals_sequential_sampler(dtype, monkeypatch):
    """Every row plain greedy (no processors, no logprobs): the one-copy host acceptance (rejection_sampler.py
    `_greedy_fast`) == the plain Sampler position by position, with argmax ties (small integer logits)."""
    import k3serve.workers.engine.spec.rejection_sampler as rs

    calls = []
    fast = rs._greedy_fast
    monkeypatch.setattr(rs, "_greedy_fast", lambda *a: calls.append(1) or fast(*a))
    rng = random.Random(3)
    vocab = 11
    for trial in range(40):
        n = rng.randint(1, 4)
        states, drafts, blocks = [], [], []
        for _ in range(n):
            k = rng.randint(0, 4)
            logits = torch.randint(0, 4, (1 + k, vocab), generator=torch.Generator().manual_seed(trial)).to(dtype)
            d = [int(logits[j].argmax()) if rng.random() < 0.7 else rng.randrange(vocab) for j in range(k)]
            states.append(SamplingState(SamplingParams(temperature=0.0), [1, 2], [], None, eos_token_id=0))
            drafts.append(d)
            blocks.append(logits)
        got = RejectionSampler(Sampler(seed=1))(torch.cat(blocks), states, drafts)
        for i in range(n):
            want = _sequential_greedy(blocks[i].float(), states[i], drafts[i])
            assert got.token_ids[i] == want, (trial, i)
            assert got.num_accepted[i] == len(want) - 1
    assert len(calls) == 40


def test_greedy_verify_padding_never_accepted():
    argmax = torch.tensor([[3, 4, 5, 0], [1, 1, 1, 1]])
    drafts = torch.tensor([[3, 4, 0], [1, 0, 0]])  # row 0: padding 0 == argmax 0 must not count
    acc, fin = greedy_verify(argmax, drafts, torch.tensor([2, 1]))
    assert acc.tolist() == [2, 1]
    assert fin.tolist() == [5, 1]


def test_zero_drafts_seeded_equals_plain_sampler_and_is_batch_independent():
    """k_i = 0 rows get exactly the plain Sampler's token (same seed), also next to rows with drafts."""
    vocab = 50
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.01, seed=42)
    plain = SamplingState.new(params, [1, 2])
    spec = SamplingState.new(params, [1, 2])
    other = SamplingState.new(SamplingParams(temperature=1.0, seed=5), [3])
    sampler, spec_sampler = Sampler(seed=3), RejectionSampler(Sampler(seed=99))
    for step in range(25):
        lg = torch.randn(1, vocab, generator=torch.Generator().manual_seed(step)) * 2
        other_lg = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1000 + step))
        a = sampler(lg, [plain]).token_ids[0]
        rows = [other_lg, lg] if step % 2 else [lg, other_lg]
        sts = [other, spec] if step % 2 else [spec, other]
        drafts = [[1, 2, 3], []] if step % 2 else [[], [1, 2, 3]]
        out = spec_sampler(torch.cat(rows), sts, drafts)
        b = out.token_ids[1 if step % 2 else 0]
        assert b == [a]
        plain.output_token_ids.append(a)
        spec.output_token_ids.append(a)


def test_seeded_rows_reproducible():
    vocab = 30
    lg = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    runs = []
    for _ in range(2):
        st = SamplingState.new(SamplingParams(temperature=1.0, seed=11), [0])
        runs.append([RejectionSampler(Sampler())(lg, [st], [[1, 2, 3]]).token_ids[0] for _ in range(20)])
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs[0]}) > 1  # the generator advances per step


def test_bad_input_is_a_clear_error():
    st = SamplingState.new(SamplingParams(), [0])
    s = RejectionSampler()
    with pytest.raises(ValueError, match="sum"):
        s(torch.zeros(2, 5), [st], [[1, 2]])
    with pytest.raises(ValueError, match="draft token ids"):
        s(torch.zeros(2, 5), [st], [[7]])
    with pytest.raises(ValueError, match="draft_probs"):
        s(torch.zeros(2, 5), [st], [[1]], [torch.ones(2, 5)])


def test_logprobs_per_emitted_token_match_plain_sampler():
    vocab = 12
    lg = torch.randn(3, vocab, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    drafts = [int(lg[0].argmax()), (int(lg[1].argmax()) + 1) % vocab]
    st = SamplingState.new(SamplingParams(temperature=0.0, logprobs=2), [0])
    out = RejectionSampler()(lg, [st], [drafts])
    assert out.num_accepted == [1]
    plain = Sampler()
    want = []
    for j, tok in enumerate(out.token_ids[0]):
        s = SamplingState(st.params, [0], drafts[:j], None)
        r = plain(lg[j : j + 1], [s])
        assert r.token_ids[0] == tok
        want.append(r.logprobs[0])
    assert out.logprobs[0] == want


# --------------------------------------------------------------------------------------------
# Distribution preservation: the joint distribution of the first L emitted tokens of a toy
# autoregressive "model" (logits a random function of the prefix) with speculation equals the
# product of the target's conditionals (chi-square, fixed seeds).
# --------------------------------------------------------------------------------------------

V, L, K, N = 4, 3, 3, 24000


def _table(seed, scale):
    g = torch.Generator().manual_seed(seed)
    return {(): torch.randn(V, generator=g, dtype=torch.float64) * scale} | {
        p: torch.randn(V, generator=g, dtype=torch.float64) * scale for p in _prefixes(L + K)}


def _prefixes(n):
    out, frontier = [], [()]
    for _ in range(n):
        frontier = [p + (t,) for p in frontier for t in range(V)]
        out += frontier
    return out


def _target_dist(logits, params):
    """The plain Sampler's distribution for one row: temperature, then top-k, then top-p (no ties here)."""
    x = logits / params.temperature
    if params.top_k:
        kth = x.topk(params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        p, order = torch.softmax(x, dim=-1).sort(descending=True)
        before = torch.cumsum(p, 0) - p  # mass of the strictly more likely tokens
        drop = order[before >= params.top_p]
        x = x.clone()
        x[drop] = float("-inf")
    return torch.softmax(x, dim=-1)


def _spec_generate(params, proposer, seed, seeded=False):
    """N sequences of >= L tokens with speculation; proposer: 'sampled' (drafts drawn from q,
    probabilities passed) or 'onehot' (deterministic drafts, no probabilities)."""
    target, draft_logits = _table(1, 1.5), _table(2, 1.0)
    sampler = RejectionSampler(Sampler(seed=seed))
    g = torch.Generator().manual_seed(seed + 1)
    seqs = [[] for _ in range(N)]
    states = [SamplingState(params, [0], [], make_generator(seed * N + i) if seeded else None) for i in range(N)]
    while True:
        live = [i for i in range(N) if len(seqs[i]) < L]
        if not live:
            return [tuple(s[:L]) for s in seqs]
        drafts, dprobs, blocks = [], [], []
        for i in live:
            k = random.Random(i * 31 + len(seqs[i])).randint(0, K)  # varying draft lengths
            ctx, d, qs = tuple(seqs[i]), [], []
            for _ in range(k):
                q = torch.softmax(draft_logits[ctx], dim=-1)
                tok = int(torch.multinomial(q, 1, generator=g)) if proposer == "sampled" else int(q.argmax())
                d.append(tok)
                qs.append(q)
                ctx = ctx + (tok,)
            drafts.append(d)
            dprobs.append(torch.stack(qs) if (qs and proposer == "sampled") else None)
            blocks += [target[tuple(seqs[i]) + tuple(d[:j])] for j in range(k + 1)]
        out = sampler(torch.stack(blocks), [states[i] for i in live], drafts,
                      dprobs if proposer == "sampled" else None)
        for i, toks in zip(live, out.token_ids):
            seqs[i] += toks


def _chi_square_pvalue(samples, params):
    target = _table(1, 1.5)
    counts: dict[tuple, int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    stat, cells = 0.0, 0
    for seq in _prefixes(L):
        if len(seq) != L:
            continue
        prob = 1.0
        for j in range(L):
            prob *= float(_target_dist(target[seq[:j]], params)[seq[j]])
        expected = prob * len(samples)
        if expected == 0:
            assert counts.get(seq, 0) == 0, f"{seq} has probability 0 but was emitted"
            continue
        stat += (counts.get(seq, 0) - expected) ** 2 / expected
        cells += 1
    df = cells - 1
    return 1.0 - float(torch.special.gammainc(torch.tensor(df / 2, dtype=torch.float64),
                                              torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("proposer,params,seeded", [
    ("sampled", SamplingParams(temperature=1.0), False),
    ("onehot", SamplingParams(temperature=0.7, top_k=3), False),
    ("sampled", SamplingParams(temperature=1.3, top_p=0.85), True),  # per-request generators
])
def test_speculative_sampling_preserves_target_distribution(proposer, params, seeded):
    pvalue = _chi_square_pvalue(_spec_generate(params, proposer, seed=123, seeded=seeded), params)
    assert pvalue > 1e-3, pvalue


def test_chi_square_detects_a_broken_rule(monkeypatch):
    """The test above has power: a rule that accepts every draft (q treated as p) is rejected."""
    real = rs.rejection_sample

    def broken(target_probs, draft_token_ids, num_draft, draft_probs, uniforms, noise):
        return real(target_probs, draft_token_ids, num_draft, None, torch.zeros_like(uniforms) - 1, noise)

    monkeypatch.setattr(rs, "rejection_sample", broken)
    params = SamplingParams(temperature=1.0)
    pvalue = _chi_square_pvalue(_spec_generate(params, "sampled", seed=123), params)
    assert pvalue < 1e-6, pvalue


def test_grammar_constrained_rows_equal_sequential_sampler():
    """A constrained row: each position's mask is the grammar after the drafts before it; greedy output ==
    the plain Sampler one position at a time, and the grammar ends advanced by exactly the emitted tokens."""
    import xgrammar as xgr

    from k3serve.workers.structured.matcher import GrammarState

    vocab = ["a", "b", "c", "ab", "ba", "x", "</s>", "y"]
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[6])
    compiled = xgr.GrammarCompiler(info).compile_regex("(ab|ba)+c")
    rng = random.Random(3)
    spec_sampler, plain = RejectionSampler(Sampler(seed=0)), Sampler(seed=0)
    for trial in range(40):
        prefix = [rng.choice([3, 4]) for _ in range(rng.randint(0, 2))]
        k = rng.randint(0, 4)
        drafts = [rng.choice([0, 1, 2, 3, 4, 5, 6]) for _ in range(k)]
        logits = torch.randn(1 + k, len(vocab), generator=torch.Generator().manual_seed(trial), dtype=torch.float64)
        spec_st = SamplingState.new(SamplingParams(temperature=0.0), [0])
        spec_st.structured = GrammarState(compiled)
        ref_st = SamplingState.new(SamplingParams(temperature=0.0), [0])
        ref_st.structured = GrammarState(compiled)
        for t in prefix:
            assert spec_st.structured.accept(t) and ref_st.structured.accept(t)
        got = spec_sampler(logits, [spec_st], [drafts])
        want = []
        for j in range(k + 1):  # the plain sampler, which advances its grammar by each token
            tok = plain(logits[j : j + 1], [ref_st]).token_ids[0]
            want.append(tok)
            if j == k or tok != drafts[j]:
                break
        assert got.token_ids[0] == want, (trial, drafts)
        assert spec_st.structured.num_accepted == ref_st.structured.num_accepted
        assert not spec_st.structured.failed
