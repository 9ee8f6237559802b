"""The dense projection `x @ weight.T`, with an optional compute dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._varlen import cast


def linear(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`x[..., K] @ weight[N, K]^T` with both operands cast to `dtype` (default: x's dtype) first; returns
    `dtype`. `dtype=None` is `k3serve.workers.model.functional.linear` exactly."""
    dt = dtype or x.dtype
    return F.linear(cast(x, dt), cast(weight, dt))
