"""Greedy tokens taken from the decode step's own argmax (ModelRunner.take_greedy_ids) instead of the sampler.

Fixed-shape decode steps (CUDA graphs on CUDA; `static_decode=True` on the CPU runs the same path) compute each
row's argmax inside the step; the engine takes those ids when every row of the step is plain greedy
(workers/sample/sampler.py `plain_greedy`) and calls the sampler otherwise. The float64 reference forward is the
oracle; the sampler path (model_runner.GRAPH_GREEDY off) is the second one, with ties.
"""

from __future__ import annotations

import pytest
import torch
from _engine_helpers import engine_outputs, random_prompts, reference_outputs

from k3serve.sampling_params import SamplingParams
from k3serve.workers.engine import model_runner
from k3serve.workers.llm import LLM
from k3serve.workers.sampler import SamplingState, plain_greedy

MAX_NEW = 6


def _llm(model_dir, **kw):
    return LLM(
        str(model_dir),
        dtype="float64",
        skip_tokenizer_init=True,
        max_model_len=64,
        block_size=16,
        max_num_seqs=16,
        static_decode=True,
        **kw,
    )


def _count_sampler_calls(llm) -> list[int]:
    calls = []
    real = llm.engine.sampler

    def counted(logits, states):
        calls.append(len(states))
        return real(logits, states)

    llm.engine.sampler = counted
    return calls


def test_greedy_ids_equal_reference_and_skip_the_sampler(tiny_model_dir):
    prompts = random_prompts(5, 11, 576, 1, 30)  # 11 sequences -> padded to the capture size 16
    refs = reference_outputs(tiny_model_dir, prompts, MAX_NEW)
    llm = _llm(tiny_model_dir)
    calls = _count_sampler_calls(llm)
    assert engine_outputs(llm, prompts, MAX_NEW) == refs
    runner = llm.engine.runner
    assert runner.num_greedy_steps >= MAX_NEW - 1
    assert runner.num_greedy_steps == runner.num_static_decode_steps  # every decode step took the step's ids
    assert sum(calls) == len(prompts)  # the sampler ran for the prefill rows only (one first token each)


def test_rows_that_need_the_sampler_take_it(tiny_model_dir):
    """One row with logprobs (greedy tokens unchanged, logprobs returned) and one with a logit bias that forces
    a token: while either is in the batch no step takes the argmax ids; the other rows still equal the oracle."""
    prompts = random_prompts(6, 5, 576, 1, 30)
    refs = reference_outputs(tiny_model_dir, prompts, MAX_NEW)
    llm = _llm(tiny_model_dir)
    calls = _count_sampler_calls(llm)
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with_lp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    biased = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logit_bias={7: 100.0})
    outs = llm.generate(prompts, [with_lp, biased, plain, plain, plain])
    toks = [o.outputs[0].token_ids for o in outs]
    assert toks[0] == refs[0] and toks[2:] == refs[2:]
    assert toks[1] == [7] * MAX_NEW
    assert len(outs[0].outputs[0].logprobs) == MAX_NEW
    assert llm.engine.runner.num_static_decode_steps >= MAX_NEW - 1
    assert llm.engine.runner.num_greedy_steps == 0
    assert len(calls) >= MAX_NEW  # every step sampled


@pytest.mark.parametrize(
    "change",
    [
        dict(temperature=0.7),
        dict(logprobs=0),
        dict(logit_bias={3: 1.0}),
        dict(min_tokens=2),
        dict(repetition_penalty=1.1),
        dict(frequency_penalty=0.5),
        dict(presence_penalty=0.5),
    ],
)
def test_plain_greedy_rule(change):
    base = dict(temperature=0.0, max_tokens=4)
    assert plain_greedy(SamplingState.new(SamplingParams(**base), [1, 2]))
    st = SamplingState.new(SamplingParams(**{**base, **change}), [1, 2])
    assert not plain_greedy(st)
    if "min_tokens" in change:  # once min_tokens tokens are out, nothing is banned any more
        st.output_token_ids.extend([5, 6])
        assert plain_greedy(st)


def test_ties_go_where_the_sampler_sends_them(tiny_model_dir, monkeypatch):
    """Logits of small integers (many exact ties, the maximum often shared): the step's argmax and the sampler's
    give the same tokens, step for step."""
    prompts = random_prompts(8, 6, 576, 1, 20)

    def tied(llm):
        model = llm.engine.runner.model
        real = model.forward

        def forward(b):
            x = real(b)
            return torch.round(x * 0.5).clamp(-2, 2)  # values in {-2..2}: ties everywhere

        model.forward = forward
        return llm

    monkeypatch.setattr(model_runner, "GRAPH_GREEDY", False)
    off = tied(_llm(tiny_model_dir))
    want = engine_outputs(off, prompts, MAX_NEW)
    assert off.engine.runner.num_greedy_steps == 0
    monkeypatch.setattr(model_runner, "GRAPH_GREEDY", True)
    on = tied(_llm(tiny_model_dir))
    assert engine_outputs(on, prompts, MAX_NEW) == want
    assert on.engine.runner.num_greedy_steps >= MAX_NEW - 1
