"""Row normalisations: RMSNorm (alone, after a residual add, or gated) and L2 normalisation over the last dimension."""

from __future__ import annotations

import torch

from ._varlen import cast, compute_dtype


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`x[..., D] * rsqrt(mean(x^2) + eps) * weight[D]`; fp32 math (fp64 for fp64 x); returns x's dtype.

    `weight` None means no affine scale.
    """
    dt = compute_dtype(x)
    xf = cast(x, dt)
    y = xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * cast(weight, dt)
    return cast(y, x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and the RMSNorm of its result: returns (`rms_norm(s, weight, eps)`, s) with s = x + residual
    in their (common) dtype — the sum rounded once to it, the norm taken of the rounded sum, as the two ops apart."""
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} "
                         f"{residual.dtype} must match")
    s = x + residual
    return rms_norm(s, weight, eps), s


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None, eps: float,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """KDA's gated output norm: `rms_norm(x, weight, eps) * sigmoid(gate)` (gate: x's shape), in fp32 (fp64 if x,
    gate or weight is fp64), rounded once to `out_dtype` (default x's dtype)."""
    if gate.shape != x.shape:
        raise ValueError(f"rms_norm_gated: gate {tuple(gate.shape)} must have x's shape {tuple(x.shape)}")
    dt = compute_dtype(x, gate, weight)
    y = rms_norm(cast(x, dt), None if weight is None else cast(weight, dt), eps)
    return cast(y * torch.sigmoid(cast(gate, dt)), out_dtype or x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x[..., D] / sqrt(sum(x^2) + eps)` over the last dim; fp32 math (fp64 for fp64 x); returns x's dtype."""
    dt = compute_dtype(x)
    xf = cast(x, dt)
    return cast(xf * torch.rsqrt(xf.square().sum(dim=-1, keepdim=True) + eps), x.dtype)
