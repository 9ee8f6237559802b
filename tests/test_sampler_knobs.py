"""Sampler knobs on hand-made logits: greedy, top-k, top-p, min-p, penalties, logit_bias, min_tokens."""

from __future__ import annotations

import math

import pytest
import torch

from k3serve.sampling_params import SamplingParams
from k3serve.workers.sample.filters import apply_min_p, apply_top_k_top_p
from k3serve.workers.sample.processors import (
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
    token_counts,
)
from k3serve.workers.sample.state import TokenIdCache
from k3serve.workers.sampler import Sampler, SamplingState

torch.set_num_threads(1)


def state(prompt=(), output=(), eos=None, **kw) -> SamplingState:
    s = SamplingState.new(SamplingParams(**kw), list(prompt), eos_token_id=eos)
    s.output_token_ids = list(output)
    return s


def logits_of(probs) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]], dtype=torch.float64)


def kept(x: torch.Tensor) -> set[int]:
    return set(torch.isfinite(x[0]).nonzero().flatten().tolist())


def sampled_set(probs, draws=400, **kw) -> set[int]:
    """Distinct tokens drawn from one seeded row over `draws` steps (the row's own generator)."""
    sampler = Sampler(seed=0)
    st = state(seed=123, **kw)
    x = logits_of(probs)
    return {sampler(x, [st]).token_ids[0] for _ in range(draws)}


# ---------------------------------------------------------------- greedy


def test_greedy_equals_argmax_float64_and_float32():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 97, generator=g, dtype=torch.float64)
    x[2, 40] = x[2].max() + 1e-12  # only float64 can tell these apart
    sts = [state(temperature=0.0) for _ in range(6)]
    out = Sampler(seed=0)(x, sts)
    assert out.token_ids == x.argmax(dim=-1).tolist()
    assert out.token_ids[2] == 40
    assert out.logprobs is None
    x32 = x.float()
    assert Sampler(seed=0)(x32, sts).token_ids == x32.argmax(dim=-1).tolist()


def test_greedy_ties_take_lowest_id():
    x = torch.tensor([[0.0, 5.0, 1.0, 5.0, 5.0], [7.0, 7.0, 7.0, 7.0, 7.0]])
    out = Sampler(seed=0)(x, [state(temperature=0.0), state(temperature=0.0)])
    assert out.token_ids == [1, 0]


def test_greedy_rows_in_mixed_batch_and_input_untouched():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 33, generator=g)
    before = x.clone()
    sts = [
        state(temperature=0.0),
        state(temperature=1.0),
        state(temperature=0.0, seed=4),
        state(temperature=0.9, top_k=5),
        state(temperature=1e-6),
    ]
    out = Sampler(seed=0)(x, sts)
    am = x.argmax(dim=-1).tolist()
    assert [out.token_ids[i] for i in (0, 2, 4)] == [am[0], am[2], am[4]]
    assert torch.equal(x, before)


def test_empty_batch_and_shape_check():
    assert Sampler(seed=0)(torch.zeros(0, 8), []).token_ids == []
    with pytest.raises(ValueError):
        Sampler(seed=0)(torch.zeros(2, 8), [state()])


# ---------------------------------------------------------------- top-k / top-p / min-p


def test_top_k_keeps_exactly_k_highest():
    x = torch.tensor([[0.3, 2.0, -1.0, 1.5, 0.9, 3.0]])
    out = apply_top_k_top_p(x, torch.tensor([3]), torch.tensor([1.0]))
    assert kept(out) == {5, 1, 3}
    assert torch.equal(out[0, [5, 1, 3]], x[0, [5, 1, 3]])  # survivors keep their values
    assert kept(apply_top_k_top_p(x, torch.tensor([0]), torch.tensor([1.0]))) == set(range(6))
    assert kept(apply_top_k_top_p(x, torch.tensor([100]), torch.tensor([1.0]))) == set(range(6))


def test_top_k_only_path_matches_sort_path():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 50, generator=g)
    x[1, 10] = x[1, 11] = x[1].max() + 1.0  # a tie at the top
    k = torch.tensor([5, 2, 0, 49])
    only_k = apply_top_k_top_p(x, k, torch.ones(4))  # no row uses top-p: topk path
    with_p = apply_top_k_top_p(
        torch.cat([x, x[:1]]), torch.cat([k, k[:1]]), torch.tensor([1.0, 1.0, 1.0, 1.0, 0.5])
    )  # one extra row with top-p forces the sort path for every row
    assert torch.equal(only_k, with_p[:4])
    assert [len(kept(only_k[i : i + 1])) for i in range(4)] == [5, 2, 50, 49]
    assert kept(only_k[1:2]) == {10, 11}


def test_top_k_through_sampler():
    probs = [0.3, 0.25, 0.2, 0.15, 0.1]
    assert sampled_set(probs, top_k=3) == {0, 1, 2}
    assert sampled_set(probs, top_k=1) == {0}


@pytest.mark.parametrize(
    "p, expected",
    [
        (0.49, {0}),
        (0.51, {0, 1}),
        (0.79, {0, 1}),
        (0.81, {0, 1, 2}),
        (0.94, {0, 1, 2}),
        (0.96, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_boundary(p, expected):
    # The smallest highest-probability set with cumulative probability >= p.
    x = logits_of([0.5, 0.3, 0.15, 0.05])
    assert kept(apply_top_k_top_p(x, torch.tensor([0]), torch.tensor([p], dtype=x.dtype))) == expected


def test_top_p_always_keeps_one_and_works_unsorted():
    x = logits_of([0.05, 0.15, 0.5, 0.3])
    assert kept(apply_top_k_top_p(x, torch.tensor([0]), torch.tensor([1e-9], dtype=x.dtype))) == {2}
    assert kept(apply_top_k_top_p(x, torch.tensor([0]), torch.tensor([0.79], dtype=x.dtype))) == {2, 3}


def test_top_p_applies_to_top_k_renormalised_distribution():
    x = logits_of([0.4, 0.3, 0.2, 0.1])
    p = torch.tensor([0.55], dtype=x.dtype)
    assert kept(apply_top_k_top_p(x, torch.tensor([0]), p)) == {0, 1}  # 0.4 < 0.55
    assert kept(apply_top_k_top_p(x, torch.tensor([2]), p)) == {0}  # 4/7 >= 0.55 after top-2


def test_top_k_top_p_rows_independent():
    x = torch.cat([logits_of([0.5, 0.3, 0.15, 0.05]), logits_of([0.1, 0.2, 0.3, 0.4])])
    out = apply_top_k_top_p(x, torch.tensor([0, 1]), torch.tensor([0.79, 1.0], dtype=x.dtype))
    assert kept(out[:1]) == {0, 1} and kept(out[1:]) == {3}


@pytest.mark.parametrize(
    "min_p, expected",
    [
        (0.0, {0, 1, 2, 3}),
        (0.09, {0, 1, 2, 3}),
        (0.11, {0, 1, 2}),
        (0.29, {0, 1, 2}),
        (0.31, {0, 1}),
        (0.61, {0}),
        (1.0, {0}),
    ],
)
def test_min_p(min_p, expected):
    # threshold = min_p * max_prob = min_p * 0.5
    x = logits_of([0.5, 0.3, 0.15, 0.05])
    assert kept(apply_min_p(x, torch.tensor([min_p], dtype=x.dtype))) == expected


def test_min_p_through_sampler_and_after_temperature():
    probs = [0.5, 0.3, 0.15, 0.05]
    assert sampled_set(probs, min_p=0.31) == {0, 1}
    # temperature 2 flattens to sqrt-probs: ratios 1, .775, .548, .316 -> min_p .5 keeps three
    assert sampled_set(probs, min_p=0.5, temperature=2.0) == {0, 1, 2}


def test_min_p_applies_before_top_p_like_vllm():
    # min-p 0.5 keeps {0.5, 0.3} -> renormalised 0.625 >= top_p 0.6 -> only token 0 survives.
    # (top-p first would keep {0, 1}.)
    assert sampled_set([0.5, 0.3, 0.2], min_p=0.5, top_p=0.6) == {0}
    assert sampled_set([0.5, 0.3, 0.2], top_p=0.6) == {0, 1}


# ---------------------------------------------------------------- penalties


BASE = [2.0, -2.0, 1.0, -1.0, 0.5]


@pytest.mark.parametrize(
    "kw, expected",
    [
        # repetition 2 on prompt {0} + output {1, 2}: positive / 2, negative * 2
        (dict(repetition_penalty=2.0), [1.0, -4.0, 0.5, -1.0, 0.5]),
        # frequency 0.5 * output counts {1: 2, 2: 1}; prompt tokens not counted
        (dict(frequency_penalty=0.5), [2.0, -3.0, 0.5, -1.0, 0.5]),
        # presence 0.25 on output tokens {1, 2}
        (dict(presence_penalty=0.25), [2.0, -2.25, 0.75, -1.0, 0.5]),
        (
            dict(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
            [1.0, -5.25, -0.25, -1.0, 0.5],
        ),
        (dict(frequency_penalty=-0.5), [2.0, -1.0, 1.5, -1.0, 0.5]),
    ],
)
def test_penalty_formulas(kw, expected):
    x = torch.tensor([BASE, BASE], dtype=torch.float64)
    sts = [state(prompt=[0], output=[1, 2, 1], **kw), state(prompt=[0], output=[1, 2, 1])]
    apply_penalties(x, sts)
    assert x[0].tolist() == pytest.approx(expected)
    assert x[1].tolist() == BASE  # the row without penalties is untouched


def test_penalties_vectorised_over_rows_of_different_lengths():
    x = torch.zeros(3, 6, dtype=torch.float64) + 1.0
    sts = [
        state(output=[5], frequency_penalty=1.0),
        state(),
        state(output=[0, 0, 0, 4], frequency_penalty=0.5),
    ]
    apply_penalties(x, sts)
    assert x[0].tolist() == [1, 1, 1, 1, 1, 0]
    assert x[1].tolist() == [1] * 6
    assert x[2].tolist() == [-0.5, 1, 1, 1, 0.5, 1]


def test_token_counts_drops_out_of_range_ids():
    c = token_counts([[1, 1, 3, -1, 7, 6], [], [0, 5, 5]], 6, torch.device("cpu"))
    assert c.tolist() == [[0, 2, 0, 1, 0, 0], [0] * 6, [1, 0, 0, 0, 0, 2]]
    assert token_counts([[], []], 4, torch.device("cpu")).tolist() == [[0] * 4, [0] * 4]


def test_penalty_changes_greedy_choice():
    x = torch.tensor([[3.0, 2.0, 0.0]])
    s = Sampler(seed=0)
    assert s(x, [state(temperature=0.0, output=[0, 0, 0])]).token_ids == [0]
    assert s(x, [state(temperature=0.0, output=[0, 0, 0], frequency_penalty=0.5)]).token_ids == [1]
    assert s(x, [state(temperature=0.0, prompt=[0], repetition_penalty=1.6)]).token_ids == [1]


# ---------------------------------------------------------------- logit_bias and min_tokens


def test_logit_bias_added_per_row():
    x = torch.zeros(2, 4, dtype=torch.float64)
    apply_logit_bias(x, [state(logit_bias={1: 2.5, 3: -100.0, 99: 5.0}), state()])
    assert x.tolist() == [[0.0, 2.5, 0.0, -100.0], [0.0] * 4]
    out = Sampler(seed=0)(torch.tensor([[1.0, 0.0, 0.5]]), [state(temperature=0.0, logit_bias={2: 0.6})])
    assert out.token_ids == [2]


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_ids(ignore_eos):
    x = torch.tensor([[0.0, 1.0, 9.0, 8.0, 7.0]])  # eos=2 highest, stop id 3 second

    def run(n_out, **kw):
        st = state(
            temperature=0.0, eos=2, output=[1] * n_out, stop_token_ids=[3], ignore_eos=ignore_eos, **kw
        )
        return Sampler(seed=0)(x, [st]).token_ids[0]

    assert run(0, min_tokens=2) == 4
    assert run(1, min_tokens=2) == 4
    assert run(2, min_tokens=2) == 2  # min_tokens reached: nothing masked any more
    assert run(0) == 2


def test_min_tokens_mask_values():
    x = torch.zeros(2, 5)
    apply_min_tokens(
        x, [state(eos=4, min_tokens=1, stop_token_ids=[0, 7]), state(eos=4, output=[1], min_tokens=1)]
    )
    assert x[0].tolist() == [float("-inf"), 0, 0, 0, float("-inf")]
    assert x[1].tolist() == [0.0] * 5


# ---------------------------------------------------------------- token id caches


def test_token_id_cache_tracks_appends_and_edits():
    cache = TokenIdCache()
    ids = [3, 1]
    assert cache.view(ids).tolist() == [3, 1]
    for t in range(40):  # growth past the initial capacity
        ids.append(t)
        assert cache.view(ids).tolist() == ids
    ids[-1] = 99  # edit of the last cached id
    assert cache.view(ids).tolist() == ids
    del ids[5:]  # shrink
    assert cache.view(ids).tolist() == ids
    other = [7, 7, 7, 7, 7, 7]  # a different list object of a longer length
    assert cache.view(other).tolist() == other
    assert cache.view([]).tolist() == []


def test_penalties_follow_a_growing_output():
    st = state(prompt=[0], frequency_penalty=1.0, repetition_penalty=2.0)
    for toks in ([1], [1, 2], [1, 2, 2, 3]):
        st.output_token_ids.extend(toks[len(st.output_token_ids) :])
        x = torch.ones(1, 5)
        apply_penalties(x, [st])
        fresh = torch.ones(1, 5)
        apply_penalties(
            fresh, [state(prompt=[0], output=toks, frequency_penalty=1.0, repetition_penalty=2.0)]
        )
        assert torch.equal(x, fresh)
    assert x[0].tolist() == [0.5, -0.5, -1.5, -0.5, 1.0]
