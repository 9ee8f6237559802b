"""The MTP drafter layer's reference forward and greedy drafting, and the prompt-lookup n-gram proposer."""

import random

import pytest
import torch

from k3serve.workers.model.mtp import mtp_layer_forward, mtp_propose
from k3serve.workers.model.ngram_proposer import NgramProposer
from k3serve.workers.model.reference import ReferenceModel, greedy_generate
from k3serve.workers.model.spec import expected_weights
from k3serve.workers.model.testing import random_config, write_random_model

torch.set_num_threads(1)
MTP_SEEDS = [s for s in range(40) if random_config(s).num_nextn_predict_layers][:4]


@pytest.fixture(scope="module", params=MTP_SEEDS)
def model(request, tmp_path_factory):
    cfg, w = write_random_model(tmp_path_factory.mktemp("mtp"), request.param, dtype=torch.float64)
    return ReferenceModel(cfg, w, torch.float64)


def _ids(model, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist()


def test_checkpoint_carries_the_mtp_layer(model):
    L = model.cfg.num_hidden_layers
    names = set(expected_weights(model.cfg))
    for leaf in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                 "self_attn.kv_b_proj.weight", "input_layernorm.weight"):
        assert f"model.layers.{L}.{leaf}" in names and f"model.layers.{L}.{leaf}" in model.w
    assert not model.cfg.is_kda_layer(L)


def test_position_zero_embedding_is_masked_and_the_layer_is_causal(model):
    T = 9
    ids = _ids(model, T + 1, 1)
    h = model.hidden_states(ids)
    logits, h_next = mtp_layer_forward(model, 0, h[:T], ids[1 : T + 1])
    assert logits.shape == (T, model.cfg.vocab_size) and h_next.shape == (T, model.cfg.hidden_size)
    other = list(ids[1 : T + 1])
    other[0] = (other[0] + 1) % model.cfg.vocab_size  # the token at position 0 is not seen at all
    l2, h2 = mtp_layer_forward(model, 0, h[:T], other)
    assert torch.equal(l2, logits) and torch.equal(h2, h_next)
    changed = list(ids[1 : T + 1])
    changed[5] = (changed[5] + 3) % model.cfg.vocab_size  # a later token changes only positions >= 5
    l3, _ = mtp_layer_forward(model, 0, h[:T], changed)
    assert torch.equal(l3[:5], logits[:5])
    assert not torch.allclose(l3[5:], logits[5:])


def test_propose_is_the_layer_run_step_by_step(model):
    ids = _ids(model, 7, 2)
    target_next, drafts = mtp_propose(model, ids, 3)
    assert target_next == greedy_generate(model, ids, 1)[0]
    assert len(drafts) == 3 and all(0 <= d < model.cfg.vocab_size for d in drafts)
    h = model.hidden_states(ids)
    hs, toks = list(h.unbind(0)), ids[1:] + [target_next]
    for d in drafts:  # each draft: argmax at the last position over the pairs so far
        logits, hn = mtp_layer_forward(model, 0, torch.stack(hs), toks)
        assert int(logits[-1].argmax()) == d
        hs.append(hn[-1])
        toks.append(d)
    assert mtp_propose(model, ids, 3) == (target_next, drafts)  # deterministic
    assert mtp_propose(model, ids, 0) == (target_next, [])


def test_mtp_errors(tmp_path):
    seed = next(s for s in range(40) if random_config(s).num_nextn_predict_layers == 0)
    cfg, w = write_random_model(tmp_path, seed, dtype=torch.float64)
    m = ReferenceModel(cfg, w, torch.float64)
    with pytest.raises(ValueError, match="no MTP layer"):
        mtp_propose(m, [1, 2, 3], 2)
    with pytest.raises(ValueError, match="does not exist"):
        mtp_layer_forward(m, 0, torch.zeros(2, cfg.hidden_size, dtype=torch.float64), [1, 2])


# ------------------------------------------------------------------------------------------ n-gram
def test_ngram_longest_then_latest_match():
    p = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    #      0  1  2  3  4  5  6  7  8  9
    seq = [5, 6, 7, 1, 9, 6, 7, 2, 8, 6, 7]
    assert p.match(seq) == (2, 5)  # "6 7" occurs at 1 and 5: the latest wins; no 3-gram "9 6 7"/"8 6 7" match
    assert p.propose(seq) == [2, 8, 6]
    seq2 = [1, 2, 3, 4, 0, 2, 3, 4, 9, 1, 2, 3, 4]
    assert p.match(seq2) == (3, 5)  # the 3-gram "2 3 4" beats the later 1-gram "4"
    assert p.propose(seq2) == [9, 1, 2]
    assert NgramProposer(5, 1, 3).propose([4, 4]) == [4]  # overlapping occurrence, fewer than k follow
    assert p.propose([1, 2, 3]) == [] and p.propose([7]) == [] and p.propose([]) == []
    assert NgramProposer(2, 2, 2).propose([1, 2, 3, 1, 3]) == []  # only 1-gram matches, below the minimum


def test_ngram_proposals_continue_a_real_occurrence():
    r = random.Random(0)
    for _ in range(200):
        seq = [r.randrange(4) for _ in range(r.randint(1, 30))]
        p = NgramProposer(r.randint(1, 5), r.randint(1, 2), r.randint(2, 4))
        m, out = p.match(seq), p.propose(seq)
        if m is None:
            assert out == []
            for n in range(p.prompt_lookup_min, min(p.prompt_lookup_max, len(seq) - 1) + 1):
                assert all(seq[s : s + n] != seq[-n:] for s in range(len(seq) - n))
            continue
        n, start = m
        assert seq[start : start + n] == seq[-n:] and start + n < len(seq)
        assert out == seq[start + n : start + n + p.num_speculative_tokens] and 1 <= len(out)
        for longer in range(n + 1, min(p.prompt_lookup_max, len(seq) - 1) + 1):
            assert all(seq[s : s + longer] != seq[-longer:] for s in range(len(seq) - longer))
        assert all(seq[s : s + n] != seq[-n:] for s in range(start + 1, len(seq) - n))


@pytest.mark.parametrize("kw", [dict(num_speculative_tokens=0), dict(num_speculative_tokens=2, prompt_lookup_min=0),
                                dict(num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2),
                                dict(num_speculative_tokens=True)])
def test_ngram_bad_arguments(kw):
    with pytest.raises(ValueError):
        NgramProposer(**kw)
