"""Shared helpers for the engine's differential tests (float64 engine vs the reference)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from k3serve.sampling_params import SamplingParams
from k3serve.workers.llm import LLM
from k3serve.workers.model.reference import greedy_generate, load_reference_model
from k3serve.workers.model.testing import write_random_model


def random_model_dir(tmp: Path, seed: int) -> Path:
    d = tmp / f"random-{seed}"
    if not (d / "config.json").exists():
        write_random_model(d, seed=seed, dtype=torch.float64)
    return d


def random_prompts(seed: int, n: int, vocab: int, lo: int = 1, hi: int = 48) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def reference_outputs(model_dir, prompts, max_new: int) -> list[list[int]]:
    """The oracle: the plain reference forward (no caches), greedy, float64; loaded once."""
    model = load_reference_model(str(model_dir), dtype=torch.float64)
    return [greedy_generate(model, p, max_new) for p in prompts]


def engine_outputs(llm: LLM, prompts, max_new: int) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]


def tight_kv_budget(model_dir, max_model_len: int, extra_blocks: int, **kw) -> int:
    """Bytes for the minimum pool plus `extra_blocks` pages: forces preemption under load."""
    probe = LLM(str(model_dir), dtype="float64", max_model_len=max_model_len, skip_tokenizer_init=True, **kw)
    eng = probe.engine
    per_block = eng.layout.bytes_per_block
    minimum = eng.layout.min_blocks_for(max_model_len, bool(kw.get("enable_prefix_caching")))
    return (minimum + extra_blocks) * per_block
