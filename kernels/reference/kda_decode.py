"""Fused KDA decode step, reference composition: short conv -> gate -> beta -> delta rule -> gated RMSNorm."""

from __future__ import annotations

import torch

from .conv import causal_conv1d_varlen
from .kda_gate import kda_gate
from .kda_recurrent import kda_recurrent
from .norms import rms_norm


def kda_decode(
    qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_states: torch.Tensor,
    raw_g: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    beta_logit: torch.Tensor,
    gate: torch.Tensor,
    o_norm_weight: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    *,
    lower_bound: float | None = None,
    scale: float | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """One decode token per sequence through a whole KDA mixer core (everything between the projections).

    Shapes (N sequences, one token each; h heads, K = key dim, V = value dim, P = h·K):
    qkv [N, 2P + h·V] raw pre-conv [q | k | v]; conv_weight [2P + h·V, W] (or [C, 1, W]);
    conv_states [num_slots, C, W-1] (DS layout, updated IN PLACE); raw_g [N, h, K] (= f_b(f_a(x)));
    A_log [h]; dt_bias [h·K]; beta_logit [N, h] (pre-sigmoid); gate [N, h, V] or [N, h·V] (pre-sigmoid
    output gate); o_norm_weight [V]; state_pool [num_slots, h, V, K] (updated IN PLACE); state_indices [N]
    (negative: padded, zero output, nothing touched); has_initial_state bool [N] (None = all False).
    Computes y = rms_norm(o, o_norm_weight, eps) ⊙ sigmoid(gate) per head, where
    (q, k, v) = SiLU(conv(qkv)), g = kda_gate(raw_g, A_log, dt_bias, lower_bound), β = sigmoid(beta_logit),
    o = kda_recurrent(q, k, v, g, β, ...) with q̂ = l2norm(q)·scale, k̂ = l2norm(k) (scale default K^-0.5).
    Returns y [N, h, V] in qkv's dtype; math in fp32 (fp64 for fp64 inputs).
    """
    N = qkv.shape[0]
    _, h, K = raw_g.shape
    V = state_pool.shape[2]
    P = h * K
    cu = torch.arange(N + 1, dtype=torch.int64, device=qkv.device)
    y = causal_conv1d_varlen(qkv, conv_weight, conv_states, state_indices, cu, has_initial_state, activation="silu")
    q = y[:, :P].reshape(N, h, K)
    k = y[:, P : 2 * P].reshape(N, h, K)
    v = y[:, 2 * P :].reshape(N, h, V)
    g = kda_gate(raw_g, A_log, dt_bias, lower_bound)
    dt = g.dtype
    beta = torch.sigmoid(beta_logit.to(dt))
    o = kda_recurrent(
        q.to(dt), k.to(dt), v.to(dt), g, beta, state_pool, state_indices, cu, has_initial_state,
        scale=scale, use_qk_l2norm=True,
    )
    out = rms_norm(o, o_norm_weight.to(dt), eps) * torch.sigmoid(gate.reshape(N, h, V).to(dt))
    return out.to(qkv.dtype)
