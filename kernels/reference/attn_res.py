"""Block Attention Residuals: the learned softmax mixture over depth-wise sources (design doc §1.2)."""

from __future__ import annotations

import torch

from ._varlen import compute_dtype
from .norms import rms_norm


def attn_res(
    partial: torch.Tensor,
    delta: torch.Tensor | None,
    blocks: torch.Tensor,
    w_norm: torch.Tensor,
    w_q: torch.Tensor,
    w_out: torch.Tensor | None,
    n: int,
    write_idx: int,
    eps: float,
    eps_out: float | None = None,
    round_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """AttnRes(partial, delta, blocks, w_norm, w_q, w_out, n, write_idx).

    partial [T, H] and blocks [T, NB, H] are updated IN PLACE:
      1. delta [T, H] given: partial <- partial + delta (fp32 sum, rounded through `round_dtype` if
         given, then stored in partial's dtype);
      2. write_idx >= 0: blocks[:, write_idx] <- partial.
    Sources s_0..s_{n-1} = blocks[:, :n] and s_n = partial (n + 1 sources, 0 <= n <= NB).
    ℓ_i = Σ_d w_q[d]·w_norm[d]·s_i[d] / sqrt(mean_d(s_i²) + eps); α = softmax_i(ℓ) in fp32;
    m = Σ_i α_i s_i over the RAW sources; returns rms_norm(m, w_out, eps_out or eps) if w_out is not
    None else m, as [T, H] in partial's dtype. w_norm [H]; w_q [H] or [1, H]; w_out [H] or None.
    """
    T, H = partial.shape
    if not 0 <= n <= blocks.shape[1] or write_idx >= blocks.shape[1]:
        raise ValueError(f"attn_res: n={n}, write_idx={write_idx} for {blocks.shape[1]} blocks")
    dt = compute_dtype(partial, blocks)
    if delta is not None:
        new = partial.to(dt) + delta.to(dt)
        if round_dtype is not None:
            new = new.to(round_dtype)
        partial.copy_(new)
    if write_idx >= 0:
        blocks[:, write_idx].copy_(partial)
    src = torch.cat([blocks[:, :n].to(dt), partial.to(dt)[:, None, :]], dim=1)  # [T, n+1, H]
    wqn = w_q.reshape(-1).to(dt) * w_norm.to(dt)
    logits = (src * wqn).sum(-1) * torch.rsqrt(src.square().mean(-1) + eps)  # [T, n+1]
    alpha = torch.softmax(logits, dim=-1)
    m = (alpha[..., None] * src).sum(1)
    if w_out is not None:
        m = rms_norm(m, w_out, eps if eps_out is None else eps_out)
    return m.to(partial.dtype)
