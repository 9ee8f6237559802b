"""Gated MLP activations on a fused [gate | up] input."""

from __future__ import annotations

import torch

from ._varlen import cast, compute_dtype


def _split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape[-1] % 2:
        raise ValueError(f"gated activation needs an even last dimension, got {tuple(x.shape)}")
    dt = compute_dtype(x)
    n = x.shape[-1] // 2
    return cast(x[..., :n], dt), cast(x[..., n:], dt)


def situ_and_mul(x: torch.Tensor, beta: float = 4.0, linear_beta: float | None = None) -> torch.Tensor:
    """SiTU gated activation: `x[..., 2n]` = gate | up -> `[..., n]` in x's dtype (fp32/fp64 math).

    gate' = beta * tanh(gate / beta) * sigmoid(gate); up' = linear_beta * tanh(up / linear_beta) if
    linear_beta is set, else up; output gate' * up'.
    """
    gate, up = _split(x)
    g = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    if linear_beta is not None:
        up = linear_beta * torch.tanh(up / linear_beta)
    return cast(g * up, x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: `x[..., 2n]` = gate | up -> `silu(gate) * up`, `[..., n]` in x's dtype (fp32/fp64 math)."""
    gate, up = _split(x)
    return cast(torch.nn.functional.silu(gate) * up, x.dtype)
