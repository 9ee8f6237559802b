"""KDA per-channel log-decay gate."""

from __future__ import annotations

import torch

from ._varlen import cast, compute_dtype


def kda_gate(
    raw_g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None = None
) -> torch.Tensor:
    """Log-decay of KDA from the raw gate projection.

    raw_g [T, H, D]; A_log [H]; dt_bias [H*D]. With z = raw_g + dt_bias.view(H, D) and a = exp(A_log):
    lower_bound set -> g = lower_bound * sigmoid(a * z) (in (lower_bound, 0));
    else g = -a * softplus(z) (softplus linear above 20).
    Returns g [T, H, D] in fp32 (fp64 if any input is fp64).
    """
    T, H, D = raw_g.shape
    if A_log.numel() != H or dt_bias.numel() != H * D:
        raise ValueError(
            f"kda_gate: A_log {tuple(A_log.shape)} / dt_bias {tuple(dt_bias.shape)} vs raw_g {(T, H, D)}"
        )
    dt = compute_dtype(raw_g, A_log, dt_bias)
    z = cast(raw_g, dt) + cast(dt_bias, dt).view(H, D)
    a = torch.exp(cast(A_log, dt)).view(H, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * z)
    return -a * torch.nn.functional.softplus(z, beta=1.0, threshold=20.0)
