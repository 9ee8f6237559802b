"""Plain data passed between the engine and the sampler: per-sequence state in, sampled ids out."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3serve.sampling_params import SamplingParams

# One logprob entry: (token_id, logprob, rank), rank = 1 + number of tokens with a strictly higher logprob.
LogprobEntry = tuple[int, float, int]


def make_generator(seed: int) -> torch.Generator:
    """A CPU `torch.Generator` seeded with `seed`; one per seeded sequence, reused across steps."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


class TokenIdCache:
    """A CPU int64 tensor mirroring a Python token list that normally only grows by appending.

    `view(ids)` converts only the ids appended since the last call. It starts over when `ids` is a
    different list object, got shorter, or its last cached id changed, so other edits are safe but
    cost a full conversion.
    """

    __slots__ = ("_buf", "_n", "_src", "_last")

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.long)
        self._n = 0
        self._src = -1
        self._last: int | None = None

    def view(self, ids: list[int]) -> torch.Tensor:
        """Tensor[len(ids)] int64 on the CPU with the same values as `ids` (valid until the next call)."""
        n = len(ids)
        if self._src != id(ids) or n < self._n or (self._n and ids[self._n - 1] != self._last):
            self._n, self._src = 0, id(ids)
        if n > self._n:
            if n > self._buf.numel():
                grown = torch.empty(max(n, 2 * self._buf.numel(), 16), dtype=torch.long)
                grown[: self._n] = self._buf[: self._n]
                self._buf = grown
            self._buf[self._n : n] = torch.tensor(ids[self._n : n], dtype=torch.long)
            self._n, self._last = n, ids[n - 1]
        return self._buf[:n]


@dataclass
class SamplingState:
    """Per running sequence, owned by the engine and reused across steps.

    The engine appends each sampled token to `output_token_ids` after the step. `generator` is
    `make_generator(params.seed)` when `params.seed` is set, else None (the sampler's global
    generator is used). `eos_token_id` is masked while `len(output_token_ids) < params.min_tokens`.
    `prompt_cache` / `output_cache` are the sampler's (not constructor arguments): they let the
    penalties convert only newly appended token ids each step.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None
    eos_token_id: int | None = None
    # k3serve.workers.structured.matcher.GrammarState of a constrained request (attached when its
    # grammar is compiled; workers/sample/constraints.py applies and advances it)
    structured: object | None = None
    prompt_cache: TokenIdCache = field(default_factory=TokenIdCache, init=False, repr=False, compare=False)
    output_cache: TokenIdCache = field(default_factory=TokenIdCache, init=False, repr=False, compare=False)

    @classmethod
    def new(
        cls, params: SamplingParams, prompt_token_ids: list[int], eos_token_id: int | None = None
    ) -> SamplingState:
        """Convenience constructor: empty output, generator made from `params.seed` when set."""
        gen = make_generator(params.seed) if params.seed is not None else None
        return cls(params, list(prompt_token_ids), [], gen, eos_token_id)

    def prompt_ids(self) -> torch.Tensor:
        """Tensor[P] int64 (CPU) of prompt_token_ids, cached."""
        return self.prompt_cache.view(self.prompt_token_ids)

    def output_ids(self) -> torch.Tensor:
        """Tensor[O] int64 (CPU) of output_token_ids, extended incrementally."""
        return self.output_cache.view(self.output_token_ids)


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
