"""Logprobs: values from post-penalty / pre-temperature logits, ranks, top-N, per-row opt-in."""

from __future__ import annotations

import math

import pytest
import torch

from k3serve.sampling_params import SamplingParams
from k3serve.workers.sampler import Sampler, SamplingState, compute_logprobs, gather_logprobs, token_ranks

torch.set_num_threads(1)


def state(output=(), **kw) -> SamplingState:
    s = SamplingState.new(SamplingParams(**kw), [])
    s.output_token_ids = list(output)
    return s


def log_softmax(values: list[float]) -> list[float]:
    m = max(values)
    z = m + math.log(sum(math.exp(v - m) for v in values))
    return [v - z for v in values]


def test_compute_logprobs_is_log_softmax_and_keeps_float64():
    x = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)
    lp = compute_logprobs(x)
    assert lp.dtype == torch.float64
    assert lp[0].tolist() == pytest.approx(log_softmax([1.0, 2.0, 3.0]), abs=1e-12)
    assert compute_logprobs(x.to(torch.bfloat16)).dtype == torch.float32


def test_token_ranks_count_strictly_higher():
    lp = torch.tensor([[-1.0, -3.0, -1.0, -2.0, -0.5]])
    ranks = [token_ranks(lp, torch.tensor([t])).item() for t in range(5)]
    assert ranks == [2, 5, 2, 4, 1]


def test_greedy_logprobs_with_ties_and_top_n():
    vals = [1.0, 3.0, 3.0, 2.0, 0.0]
    x = torch.tensor([vals], dtype=torch.float64)
    out = Sampler(seed=0)(x, [state(temperature=0.0, logprobs=3)])
    ref = log_softmax(vals)
    assert out.token_ids == [1]
    chosen, *top = out.logprobs[0]
    assert chosen[0] == 1 and chosen[2] == 1 and chosen[1] == pytest.approx(ref[1], abs=1e-12)
    assert sorted((t[0], t[2]) for t in top[:2]) == [(1, 1), (2, 1)]  # tied tokens share rank 1
    assert top[2][0] == 3 and top[2][2] == 3 and top[2][1] == pytest.approx(ref[3], abs=1e-12)
    assert len(top) == 3


def test_logprobs_zero_gives_only_chosen_and_none_for_rows_not_asking():
    x = torch.tensor([[0.0, 1.0, 2.0]] * 3)
    out = Sampler(seed=0)(
        x, [state(temperature=0.0, logprobs=0), state(temperature=0.0), state(temperature=0.0, logprobs=1)]
    )
    assert len(out.logprobs) == 3
    assert [e[0] for e in out.logprobs[0]] == [2]
    assert out.logprobs[1] is None
    assert [(e[0], e[2]) for e in out.logprobs[2]] == [(2, 1), (2, 1)]
    assert Sampler(seed=0)(x, [state(), state(), state()]).logprobs is None


def test_logprobs_after_penalties_and_bias_before_temperature_and_filters():
    vals = [2.0, 1.0, 0.5, 0.0, -1.0]
    x = torch.tensor([vals], dtype=torch.float64)
    st = state(
        output=[0], temperature=0.3, top_k=2, frequency_penalty=1.5, logit_bias={4: 2.5}, logprobs=5, seed=1
    )
    out = Sampler(seed=0)(x, [st])
    adjusted = [0.5, 1.0, 0.5, 0.0, 1.5]  # penalty on 0, bias on 4; temperature / top-k not applied
    ref = log_softmax(adjusted)
    tok = out.token_ids[0]
    assert tok in (1, 4)  # top-2 of the adjusted logits
    chosen, *top = out.logprobs[0]
    assert chosen[0] == tok and chosen[1] == pytest.approx(ref[tok], abs=1e-12)
    assert {t[0]: t[1] for t in top} == pytest.approx(dict(enumerate(ref)), abs=1e-12)
    assert [t[2] for t in top] == [1, 2, 3, 3, 5]
    assert [t[0] for t in top][:2] == [4, 1]


def test_sampled_low_rank_token_reports_its_rank():
    # top_k disabled, flat-ish distribution: over many seeded steps, ranks must match the definition.
    vals = [0.3, 0.1, 0.2, 0.0]
    x = torch.tensor([vals])
    st = state(temperature=1.0, seed=3, logprobs=0)
    sampler = Sampler(seed=0)
    expected_rank = {0: 1, 2: 2, 1: 3, 3: 4}
    seen = set()
    for _ in range(60):
        out = sampler(x, [st])
        tok, lp, rank = out.logprobs[0][0]
        assert tok == out.token_ids[0] and rank == expected_rank[tok]
        assert lp == pytest.approx(log_softmax(vals)[tok], abs=1e-6)
        seen.add(tok)
    assert len(seen) == 4


def test_gather_logprobs_direct():
    lp = compute_logprobs(torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]]))
    res = gather_logprobs(lp, torch.tensor([0, 0]), [2, None])
    assert res[1] is None
    assert [(e[0], e[2]) for e in res[0]] == [(0, 4), (3, 1), (2, 2)]
    # n larger than the vocab is clipped
    res = gather_logprobs(lp, torch.tensor([3, 3]), [None, 20])
    assert [e[0] for e in res[1]] == [3, 0, 1, 2, 3]
