"""Checks of token ids in requests against the model's vocabulary (shared by the HTTP and gRPC front ends)."""

from __future__ import annotations

from collections.abc import Iterable


def check_token_ids(ids: Iterable[int], vocab_size: int, param: str) -> None:
    """ValueError naming `param` if any id is outside [0, vocab_size)."""
    for t in ids:
        if not 0 <= int(t) < vocab_size:
            raise ValueError(f"{param}: token id {t} is outside the vocabulary [0, {vocab_size})")


def check_params_token_ids(params, vocab_size: int) -> None:
    """The token ids inside SamplingParams (logit_bias keys, stop_token_ids) must exist in the model."""
    check_token_ids((params.logit_bias or {}).keys(), vocab_size, "logit_bias")
    check_token_ids(params.stop_token_ids or [], vocab_size, "stop_token_ids")
