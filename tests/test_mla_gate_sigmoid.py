"""The MLA output gate's sigmoid in the 16-bit activation dtype (workers/engine/k3_forward.py GATE_SIGMOID_16BIT):
bit for bit the reference form sigmoid(g.float()).to(g.dtype) on every bf16 and fp16 value, and the engine's
tokens and logits do not change with it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _engine_helpers import random_prompts

from k3serve.sampling_params import SamplingParams
from k3serve.workers.engine import k3_forward
from k3serve.workers.engine.k3_forward import K3ForwardModel
from k3serve.workers.llm import LLM


def every_value(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16bit_value(dtype):
    g = every_value(dtype)
    got = K3ForwardModel._gate_sigmoid(SimpleNamespace(acc=torch.float32), g, dtype)
    want = torch.sigmoid(g.float()).to(dtype)
    assert got.dtype == dtype
    same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
    assert bool(same.all()), f"{int((~same).sum())} values differ"


def test_fp32_and_fp64_keep_the_reference_form():
    g = torch.randn(5, 3, dtype=torch.float64)
    out = K3ForwardModel._gate_sigmoid(SimpleNamespace(acc=torch.float64), g, torch.float64)
    assert torch.equal(out, torch.sigmoid(g))


def test_engine_tokens_and_logits_unchanged(tiny_model_dir, monkeypatch):
    prompts = random_prompts(9, 4, 576, 4, 24)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    runs, calls = [], []
    real = K3ForwardModel._gate_sigmoid
    monkeypatch.setattr(
        K3ForwardModel, "_gate_sigmoid", lambda self, g, dt: calls.append(g.dtype) or real(self, g, dt)
    )
    for on in (False, True):
        monkeypatch.setattr(k3_forward, "GATE_SIGMOID_16BIT", on)
        llm = LLM(str(tiny_model_dir), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=64)
        outs = llm.generate(prompts, sp)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    assert calls and set(calls) == {torch.bfloat16}  # the tiny preset has output-gated MLA layers
    assert runs[0] == runs[1]
