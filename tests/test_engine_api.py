"""The offline engine API: seeded sampling, n > 1, stops, lengths, logprobs, abort, chat, errors."""

from __future__ import annotations

import pytest

from k3serve.sampling_params import SamplingParams
from k3serve.workers.llm import LLM


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8)


def test_seeded_sampling_independent_of_batch(llm):
    p = [5, 17, 42, 99, 100]
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([p], sp)[0].outputs[0].token_ids
    others = [[1, 2, 3], list(range(40, 80)), [7] * 9]
    mixed = llm.generate(others[:2] + [p] + others[2:],
                         [SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True)] * 2 + [sp]
                         + [SamplingParams(temperature=0.7, seed=9, max_tokens=15, ignore_eos=True)])
    assert mixed[2].outputs[0].token_ids == alone
    again = llm.generate([p], sp)[0].outputs[0].token_ids
    assert again == alone
    other_seed = llm.generate([p], SamplingParams(temperature=0.9, top_p=0.95, seed=4321, max_tokens=12,
                                                  ignore_eos=True))[0].outputs[0].token_ids
    assert other_seed != alone


def test_n_children_get_distinct_seeds(llm):
    out = llm.generate([[3, 4, 5]], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    seqs = [tuple(o.token_ids) for o in out.outputs]
    assert len(set(seqs)) == 3
    single = llm.generate([[3, 4, 5]], SamplingParams(temperature=1.0, seed=8, max_tokens=10, ignore_eos=True))
    assert tuple(single[0].outputs[0].token_ids) == seqs[1]  # child i uses seed + i


def test_lengths_stops_and_logprobs(llm):
    greedy = llm.generate([[10, 11, 12]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    toks = greedy.outputs[0].token_ids
    assert len(toks) == 8 and greedy.outputs[0].finish_reason == "length"
    # a stop token id ends the sequence at its first occurrence (kept in token_ids, reason = the id)
    stop_at = toks[3]
    first = toks.index(stop_at)
    o = llm.generate([[10, 11, 12]], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at],
                                                    ignore_eos=True))[0].outputs[0]
    assert o.token_ids == toks[: first + 1] and o.finish_reason == "stop" and o.stop_reason == stop_at
    # min_tokens suppresses that stop token until enough tokens exist
    o = llm.generate([[10, 11, 12]], SamplingParams(temperature=0, max_tokens=8, min_tokens=8,
                                                    stop_token_ids=[stop_at], ignore_eos=True))[0].outputs[0]
    assert len(o.token_ids) == 8 and stop_at not in o.token_ids
    # logprobs: chosen token first, top-N ranked; greedy choice has rank 1
    o = llm.generate([[10, 11, 12]], SamplingParams(temperature=0, max_tokens=3, logprobs=4,
                                                    ignore_eos=True))[0].outputs[0]
    assert len(o.logprobs) == 3
    for tok, entry in zip(o.token_ids, o.logprobs):
        assert entry[tok].rank == 1 and len(entry) <= 5 and entry[tok].logprob <= 0


def test_stop_string_trimmed(llm):
    base = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    text = base.text
    assert len(text) >= 4, "the tiny model's greedy text is long enough to carve a stop string from"
    stop = text[2:4]
    o = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=12, stop=[stop],
                                               ignore_eos=True))[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert o.text == text[: text.index(stop)]


def test_abort_and_errors(llm):
    eng = llm.engine
    eng.add_request("x1", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    finals = eng.abort_request("x1")
    assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in finals] == [("x1", True, "abort")]
    assert finals[0].outputs[0].token_ids  # what it had generated so far is kept
    assert eng.step() == []  # nothing stale comes out later
    assert not eng.has_unfinished_requests()
    assert eng.pool.num_free == eng.pool.num_usable  # everything freed
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request("x2", list(range(256)), SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request("x3", [10**6], SamplingParams())
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)


def test_chat_renders_and_generates(llm):
    out = llm.chat([{"role": "user", "content": "Say hi"}], SamplingParams(temperature=0, max_tokens=6))[0]
    assert out.prompt_token_ids and len(out.outputs[0].token_ids) >= 1
