"""KDA (Kimi Delta Attention), reference form (design doc §1.3), for one sequence.

Pieces are public so kernels and the engine can test against them:
`kda_short_conv`, `kda_decay_gate`, `kda_recurrence`, and the whole layer `kda_forward`.
State layouts: conv state `[K-1, 3P]` (the last K-1 raw pre-conv inputs of [q|k|v], oldest first);
recurrent state `[h, V, K]` = `[h, d, d]` indexed [head][v][k], in the accumulation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .functional import LayerWeights, acc_dtype, gated_rms_norm, linear


def kda_short_conv(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU: `y_t[c] = SiLU(sum_j w[c, j] * x_{t-K+1+j}[c])`.

    x `[T, C]` (model dtype), weight `[C, K]`, state `[K-1, C]` or None (zeros: a fresh request).
    Returns `(y [T, C] in x's dtype, new_state [K-1, C] in x's dtype)`; computed in the acc dtype.
    """
    T, C = x.shape
    K = weight.shape[1]
    acc = acc_dtype(x.dtype)
    if state is None:
        state = torch.zeros(K - 1, C, dtype=x.dtype, device=x.device)
    full = torch.cat([state.to(x.dtype), x], dim=0).to(acc)  # [K-1+T, C]
    w = weight.to(acc)
    y = torch.zeros(T, C, dtype=acc, device=x.device)
    for j in range(K):
        y = y + w[:, j] * full[j : j + T]
    new_state = torch.cat([state.to(x.dtype), x], dim=0)[T:]  # last K-1 raw inputs
    return F.silu(y).to(x.dtype), new_state


def kda_decay_gate(
    raw_g: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None
) -> torch.Tensor:
    """Per-channel log-decay g `[T, h, d]` (acc dtype) from raw_g = f_b(f_a(x)) `[T, h, d]`.

    z = raw_g + dt_bias; a_h = exp(A_log[h]).
    Bounded (K3): g = lb * sigmoid(a_h * z). Unbounded: g = -a_h * softplus(z) (softplus linear above 20).
    """
    acc = acc_dtype(raw_g.dtype)
    T, h, d = raw_g.shape
    z = raw_g.to(acc) + dt_bias.to(acc).view(1, h, d)
    a = torch.exp(a_log.to(acc)).view(1, h, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * z)
    return -a * F.softplus(z, beta=1.0, threshold=20.0)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(||x||^2 + eps) over the last dim."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta-rule recurrence, token by token, in the acc dtype.

    q, k `[T, h, K]`, v `[T, h, V]` (post-conv, NOT normalized), g `[T, h, K]` log-decay, beta `[T, h]`
    (already sigmoid-ed), state `[h, V, K]` or None (zeros). q̂ = l2norm(q) * K^-1/2, k̂ = l2norm(k).
    Per token: S' = S diag(exp g_t); u = beta (v - S' k̂); S = S' + u k̂ᵀ; o = S q̂.
    Returns `(o [T, h, V] in q's dtype, final state [h, V, K] in the acc dtype)`.
    """
    acc = acc_dtype(q.dtype)
    T, h, dk = q.shape
    dv = v.shape[-1]
    qh = l2_normalize(q.to(acc)) * dk**-0.5
    kh = l2_normalize(k.to(acc))
    vv, gg, bb = v.to(acc), g.to(acc), beta.to(acc)
    S = torch.zeros(h, dv, dk, dtype=acc, device=q.device) if state is None else state.to(acc).clone()
    out = torch.empty(T, h, dv, dtype=acc, device=q.device)
    for t in range(T):
        S = S * torch.exp(gg[t])[:, None, :]
        u = bb[t][:, None] * (vv[t] - torch.einsum("hvk,hk->hv", S, kh[t]))
        S = S + u[:, :, None] * kh[t][:, None, :]
        out[t] = torch.einsum("hvk,hk->hv", S, qh[t])
    return out.to(q.dtype), S


def kda_output_gate(x: torch.Tensor, w: LayerWeights) -> torch.Tensor:
    """The output gate pre-activation `[T, P]`: full rank `g_proj` (K3) or low rank `g_b(g_a(x))` (Kimi-Linear)."""
    if "g_proj.weight" in w:
        return linear(x, w["g_proj.weight"])
    return linear(linear(x, w["g_a_proj.weight"]), w["g_b_proj.weight"])


def kda_forward(
    x: torch.Tensor,
    w: LayerWeights,
    cfg,
    conv_state: torch.Tensor | None = None,
    recurrent_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One KDA layer on one sequence. x `[T, H]` (the normed layer input, model dtype).

    Returns `(y [T, H], conv_state [K-1, 3P], recurrent_state [h, d, d])`; the states start at zero when None.
    """
    T = x.shape[0]
    h, d = cfg.kda_num_heads, cfg.kda_head_dim
    P = h * d
    qkv = torch.cat([linear(x, w["q_proj.weight"]), linear(x, w["k_proj.weight"]), linear(x, w["v_proj.weight"])], -1)
    conv_w = torch.cat([w["q_conv1d.weight"], w["k_conv1d.weight"], w["v_conv1d.weight"]], 0)  # [3P, K]
    qkv, conv_state = kda_short_conv(qkv, conv_w, conv_state)
    q, k, v = (t.reshape(T, h, d) for t in qkv.split(P, dim=-1))
    raw_g = linear(linear(x, w["f_a_proj.weight"]), w["f_b_proj.weight"]).reshape(T, h, d)
    g = kda_decay_gate(raw_g, w["A_log"], w["dt_bias"], cfg.gate_lower_bound)
    beta = torch.sigmoid(linear(x, w["b_proj.weight"]).to(acc_dtype(x.dtype)))
    o, recurrent_state = kda_recurrence(q, k, v, g, beta, recurrent_state)
    gate = kda_output_gate(x, w).reshape(T, h, d)
    y = gated_rms_norm(o, w["o_norm.weight"], gate, cfg.rms_norm_eps).reshape(T, P)
    return linear(y, w["o_proj.weight"]), conv_state, recurrent_state
