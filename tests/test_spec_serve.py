"""Speculative decoding through `k3serve serve` and the official `openai` client: several tokens per engine
step flow through the output processor, the detokenizer and the streaming layer unchanged. The trained demo
model (models/k3-demo-stdlib, float64) with its MTP drafter (k = 3): streamed and non-streamed completions
(with logprobs) and chat equal the offline engine WITHOUT speculation, and /metrics shows accepted drafts."""

from __future__ import annotations

import re

import httpx
import pytest

from k3serve.workers.model.paths import DEMO_MODEL_DIR
from tests._serve_proc import serve_process

NAME = "k3-demo"
MAX_LEN = 512
PROMPTS = ["def add(a, b):\n    return", "import os\n\n\ndef read_file(path):\n", "class Stack:\n    def push(self"]
pytestmark = pytest.mark.skipif(not (DEMO_MODEL_DIR / "config.json").exists(), reason="demo model not in the tree")


@pytest.fixture(scope="module")
def server():
    spec = '{"method": "mtp", "num_speculative_tokens": 3}'
    with serve_process(DEMO_MODEL_DIR, "--served-model-name", NAME, "--max-model-len", str(MAX_LEN), "--num-threads",
                       "1", "--log-level", "warning", "--dtype", "float64", "--enable-prefix-caching",
                       "--speculative-config", spec) as (url, client):
        yield url, client


@pytest.fixture(scope="module")
def offline():
    """The same prompts through the offline engine without speculation (greedy, float64)."""
    from k3serve.sampling_params import SamplingParams
    from k3serve.workers.llm import LLM

    llm = LLM(str(DEMO_MODEL_DIR), dtype="float64", max_model_len=MAX_LEN)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, logprobs=2))
    return [o.outputs[0] for o in outs], llm.tokenizer


def test_streamed_completions_with_logprobs_equal_no_speculation(server, offline):
    url, client = server
    want, tok = offline
    for prompt, w in zip(PROMPTS, want):
        full = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, logprobs=2)
        assert full.choices[0].text == w.text
        assert full.choices[0].logprobs.tokens == [tok.decode([t]) for t in w.token_ids]
        got_lps = full.choices[0].logprobs.token_logprobs
        assert len(got_lps) == len(w.token_ids)
        for got, tid, ent in zip(got_lps, w.token_ids, w.logprobs):
            assert abs(got - ent[tid].logprob) < 1e-9
        text, lps = "", []
        for ch in client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, logprobs=2,
                                            stream=True):
            if ch.choices:
                text += ch.choices[0].text
                if ch.choices[0].logprobs is not None:
                    lps += ch.choices[0].logprobs.tokens
        assert text == w.text and lps == full.choices[0].logprobs.tokens
    metrics = httpx.get(url + "/metrics").text
    acc = re.search(r'^vllm:spec_decode_num_accepted_tokens_total\{model_name="k3-demo"\} (\S+)$', metrics, re.M)
    assert acc and float(acc.group(1)) > 0, "no draft accepted: no step produced several tokens"


def test_streamed_chat_equals_non_streamed(server):
    _url, client = server
    msgs = [{"role": "user", "content": "Write a function that returns the sum of a list of numbers."}]
    full = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=48, temperature=0)
    content, reasoning = "", ""
    for ch in client.chat.completions.create(model=NAME, messages=msgs, max_tokens=48, temperature=0, stream=True):
        if ch.choices:
            d = ch.choices[0].delta
            content += d.content or ""
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
    m = full.choices[0].message
    assert content == (m.content or "")
    assert reasoning == ((m.model_extra or {}).get("reasoning_content") or "")
    assert content or reasoning
