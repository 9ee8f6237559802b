"""Routed experts: gated MLP per chosen expert, weighted sum; dense or MXFP4 weights."""

from __future__ import annotations

import torch

from ._varlen import compute_dtype
from .activations import silu_and_mul, situ_and_mul


def _expert_weight(
    dense: torch.Tensor | None,
    packed: torch.Tensor | None,
    scale: torch.Tensor | None,
    e: int,
    dt: torch.dtype,
    what: str,
) -> torch.Tensor:
    """Expert e's weight [N, K] in dtype dt, from a dense [E, N, K] tensor or MXFP4 packed/scale tensors."""
    if dense is not None:
        return dense[e].to(dt)
    if packed is None or scale is None:
        raise ValueError(f"moe_experts: give {what} or both {what}_packed and {what}_scale")
    from .mxfp4 import mxfp4_dequantize  # imported lazily: only the MXFP4 path needs it

    return mxfp4_dequantize(packed[e], scale[e], dt)


def moe_experts(
    z: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13: torch.Tensor | None = None,
    w2: torch.Tensor | None = None,
    w13_packed: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_packed: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    activation: str = "situ",
    situ_beta: float = 4.0,
    situ_linear_beta: float | None = None,
) -> torch.Tensor:
    """out[t] = Σ_k topk_weights[t,k] · (act(z[t] W13_eᵀ) W2_eᵀ), e = topk_ids[t,k].

    z [T, Din]; topk_weights [T, k]; topk_ids [T, k] (ids < 0 are ignored).
    Dense: w13 [E, 2I, Din] (rows 0..I-1 gate/w1, I..2I-1 up/w3), w2 [E, Dout, I].
    MXFP4: w13_packed uint8 [E, 2I, Din/2] + w13_scale uint8 [E, 2I, Din/32], w2_packed [E, Dout, I/2] +
    w2_scale [E, Dout, I/32] (see `mxfp4`); dense and MXFP4 may be mixed per matrix.
    activation "situ" (situ_and_mul(.., situ_beta, situ_linear_beta)) or "silu" (silu_and_mul).
    Only experts some token routes to are dequantized/computed. Math in fp32 (fp64 if z is fp64);
    returns [T, Dout] in z's dtype.
    """
    if activation == "situ":

        def act(h: torch.Tensor) -> torch.Tensor:
            return situ_and_mul(h, situ_beta, situ_linear_beta)
    elif activation == "silu":
        act = silu_and_mul
    else:
        raise ValueError(f"unknown activation {activation!r}")
    if w2 is not None:
        d_out = w2.shape[1]
    elif w2_packed is not None:
        d_out = w2_packed.shape[1]
    else:
        raise ValueError("moe_experts: give w2 or w2_packed/w2_scale")
    dt = compute_dtype(z)
    zf = z.to(dt)
    out = torch.zeros(z.shape[0], d_out, dtype=dt, device=z.device)
    ids = topk_ids.to(torch.long)
    for e in torch.unique(ids[ids >= 0]).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        W13 = _expert_weight(w13, w13_packed, w13_scale, e, dt, "w13")
        W2 = _expert_weight(w2, w2_packed, w2_scale, e, dt, "w2")
        y = act(zf[tok] @ W13.t()) @ W2.t()
        out.index_add_(0, tok, y * topk_weights[tok, slot].to(dt)[:, None])
    return out.to(z.dtype)
