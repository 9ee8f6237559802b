"""A prompt that is entirely in the prefix cache (an exact repeat, dense KDA retention, block-aligned
length): the lookup must leave at least one prompt token to compute (its logits give the first output
token), so the repeat runs and equals the reference token for token (float64, greedy)."""

from __future__ import annotations

import random

import pytest
from _engine_helpers import random_model_dir

from k3serve.sampling_params import SamplingParams
from k3serve.workers.llm import LLM
from k3serve.workers.model.reference import reference_generate

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=3)


@pytest.mark.parametrize("model,unit", [("tiny", 16), ("tiny", 4), ("random", 8)])
def test_exact_repeat_of_a_fully_cached_prompt(tiny_model_dir, tmp_path_factory, model, unit):
    d = tiny_model_dir if model == "tiny" else random_model_dir(tmp_path_factory.mktemp("full-hit"), seed=11)
    llm = LLM(str(d), dtype="float64", skip_tokenizer_init=True, max_model_len=128, block_size=16,
              enable_prefix_caching=True, prefix_match_unit=unit, prefix_cache_retention_interval="dense")
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(unit)
    for length in (32, 48, 33):  # block-aligned (every token hashable) and one past a boundary
        prompt = [rng.randrange(vocab) for _ in range(length)]
        want = list(reference_generate(d, prompt, GREEDY.max_tokens))
        first = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
        hits0 = llm.engine.stats()["prefix_cache_hits"]
        again = llm.generate([prompt], GREEDY)  # the whole prompt is cached now
        assert list(first) == want and list(again[0].outputs[0].token_ids) == want, length
        hit = llm.engine.stats()["prefix_cache_hits"] - hits0
        assert (length - 1) // unit * unit - unit < hit <= length - 1, (length, hit)  # hit, but never all
