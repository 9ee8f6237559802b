"""Structured-output masks in the sampler (the grammar side is k3serve.workers.structured).

A row whose `SamplingState.structured` is an active GrammarState gets its grammar's bitmask applied
to the logits after logit_bias / min_tokens / penalties (so logprobs, too, are over the allowed
tokens), and its matcher advanced with the sampled token. If the other adjustments left a row with
no allowed token (SamplingParams rejects min_tokens with structured outputs, so this is a safety net),
the grammar wins: the row becomes the raw logits under the grammar's mask alone.
"""

from __future__ import annotations

import torch

from .state import SamplingState


def constrained_rows(states: list[SamplingState]) -> list[int]:
    return [i for i, st in enumerate(states) if st.structured is not None and st.structured.active]


def apply_grammar_masks(x: torch.Tensor, raw_logits: torch.Tensor, states: list[SamplingState],
                        rows: list[int]) -> None:
    """Mask `x` (the sampler's working copy, [N, V]) in place for `rows`; `raw_logits` is the caller's."""
    from k3serve.workers.structured.bitmask import apply_bitmask, unpack
    from k3serve.workers.structured.matcher import fill_bitmasks

    bitmask = fill_bitmasks([states[i].structured for i in rows], x.shape[1])
    apply_bitmask(x, bitmask, rows)
    masked = x if len(rows) == x.shape[0] else x[torch.tensor(rows, device=x.device)]
    dead = masked.amax(dim=-1) == float("-inf")
    if bool(dead.any()):
        for j in dead.nonzero().flatten().tolist():
            allowed = unpack(bitmask[j : j + 1].to(x.device), x.shape[1])[0]
            x[rows[j]] = raw_logits[rows[j]].to(x.dtype).masked_fill(~allowed, float("-inf"))


def advance_grammars(states: list[SamplingState], rows: list[int], token_ids: list[int]) -> None:
    for i in rows:
        states[i].structured.accept(token_ids[i])
