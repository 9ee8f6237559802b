"""Plain data passed between the engine and the sampler: per-sequence state in, sampled ids out."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling_params import SamplingParams

# One logprob entry: (token_id, logprob, rank), rank = 1 + number of tokens with a strictly higher logprob.
LogprobEntry = tuple[int, float, int]


def make_generator(seed: int) -> torch.Generator:
    """A CPU `torch.Generator` seeded with `seed`; one per seeded sequence, reused across steps."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


@dataclass
class SamplingState:
    """Per running sequence, owned by the engine and reused across steps.

    The engine appends each sampled token to `output_token_ids` after the step. `generator` is
    `make_generator(params.seed)` when `params.seed` is set, else None (the sampler's global
    generator is used). `eos_token_id` is masked while `len(output_token_ids) < params.min_tokens`.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None
    eos_token_id: int | None = None

    @classmethod
    def new(
        cls, params: SamplingParams, prompt_token_ids: list[int], eos_token_id: int | None = None
    ) -> SamplingState:
        """Convenience constructor: empty output, generator made from `params.seed` when set."""
        gen = make_generator(params.seed) if params.seed is not None else None
        return cls(params, list(prompt_token_ids), [], gen, eos_token_id)


@dataclass
class SamplerOutput:
    """The result of one sampler call over N rows.

    token_ids: N sampled ids (Python ints), in row order.
    logprobs: None when no row asked for logprobs; otherwise a list of N entries, each None for a
        row whose `params.logprobs` is None, else `[chosen, top_1, ..., top_n]` with every item an
        `(id, logprob, rank)` tuple (n = params.logprobs; the chosen token may repeat in the top-n).
    """

    token_ids: list[int]
    logprobs: list[list[LogprobEntry] | None] | None = None
