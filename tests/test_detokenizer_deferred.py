"""DeferredDetokenizer (k3serve/detokenizer.py): the text read at any point, the flush and the token count equal
the token-by-token IncrementalDetokenizer's; the engine's outputs do not change with LLMEngine.defer_detokenization."""

from __future__ import annotations

import random

import pytest

from k3serve.detokenizer import DeferredDetokenizer, IncrementalDetokenizer
from k3serve.sampling_params import SamplingParams
from k3serve.tokenizer import K3Tokenizer, write_tokenizer_files
from k3serve.workers.llm import LLM


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok"))
    write_tokenizer_files(d)
    return K3Tokenizer.from_dir(d)


@pytest.mark.parametrize("skip", [True, False])
def test_same_text_at_every_read(tok, skip):
    rng = random.Random(3 + skip)
    special = [i for i in range(tok.vocab_size) if tok.is_special(i)][:4]
    assert special
    for _ in range(200):
        inc, dfr = IncrementalDetokenizer(tok, skip), DeferredDetokenizer(tok, skip)
        pool = [
            *range(256),
            *special,
            *range(256, min(tok.vocab_size, 600)),
        ]  # bytes (split UTF-8), specials, merges
        for _ in range(rng.randrange(1, 20)):
            ids = [rng.choice(pool) for _ in range(rng.randrange(1, 4))]
            inc.push(ids)
            assert dfr.push(ids) == ""
            if rng.random() < 0.3:
                assert dfr.text == inc.text and dfr.num_tokens == inc.num_tokens
        inc.flush()
        dfr.flush()
        assert (
            dfr.text == inc.text
            and dfr.num_tokens == inc.num_tokens
            and dfr.finished
            and dfr.stopped_by is None
        )
        dfr.push([ord("x")])  # after the flush: ignored, as the incremental one does
        assert dfr.text == inc.text


def test_engine_outputs_unchanged(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64, max_num_seqs=8)
    eng = llm.engine
    params = [
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=2, n=2, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, stop=["e"], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, skip_special_tokens=False),
    ]
    prompts = [[5, 9, 17, 33], [40, 2, 8], [70, 71, 72, 73, 74], [3, 4]]

    made = []
    real = eng._detokenizer
    eng._detokenizer = lambda p: made.append(type(d := real(p)).__name__) or d

    def texts(defer: bool, final_only: bool):
        eng.defer_detokenization = defer
        llm.final_outputs_only = final_only
        made.clear()
        outs = llm.generate(prompts, params)
        assert made.count("DeferredDetokenizer") == (4 if defer else 0)  # all but the stop-string request's
        return [[(o.text, o.token_ids, o.finish_reason) for o in r.outputs] for r in outs]

    want = texts(False, False)
    assert any(t for r in want for t, _i, _f in r)  # some text came out
    assert texts(True, True) == want and texts(True, False) == want
