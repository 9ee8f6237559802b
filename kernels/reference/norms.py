"""Row normalisations: RMSNorm and L2 normalisation over the last dimension."""

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


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x[..., D] / sqrt(sum(x^2) + eps)` over the last dim; fp32 math (fp64 for fp64 x); returns x's dtype."""
    dt = compute_dtype(x)
    xf = cast(x, dt)
    return cast(xf * torch.rsqrt(xf.square().sum(dim=-1, keepdim=True) + eps), x.dtype)
