"""MLA (multi-head latent attention), reference form (design doc §1.4), for one sequence.

Notation: h heads, dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim, r = kv_lora_rank.
The latent cache entry of a token is `[c_kv (normalized, r) | k_pe (dr, rotated when RoPE is on)]`.

* `mla_project(x, w, cfg, positions)` -> (q_nope, q_pe, c_kv, k_pe): everything a layer computes before
  attention (and what a paged cache stores).
* `mla_attend_expanded(...)`: expand c_kv through kv_b_proj into per-head k_nope / v and attend.
* `mla_attend_absorbed(...)`: the weight-absorbed decode form (q_lat = q_nope W_UK, attend in latent
  space, project back with W_UV); mathematically equal to the expanded form.
* `mla_forward(x, w, cfg, positions, absorbed=False)`: the whole layer (gate and o_proj included).
"""

from __future__ import annotations

import torch

from .functional import LayerWeights, acc_dtype, linear, rms_norm, rope_interleaved


def mla_project(
    x: torch.Tensor, w: LayerWeights, cfg, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x `[T, H]` -> q_nope `[T, h, dn]`, q_pe `[T, h, dr]`, c_kv `[T, r]`, k_pe `[T, dr]` (model dtype)."""
    T = x.shape[0]
    h, dn, dr, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank is not None:
        c_q = rms_norm(linear(x, w["q_a_proj.weight"]), w["q_a_layernorm.weight"], cfg.rms_norm_eps)
        q = linear(c_q, w["q_b_proj.weight"])
    else:
        q = linear(x, w["q_proj.weight"])
    q = q.reshape(T, h, dn + dr)
    q_nope, q_pe = q[..., :dn], q[..., dn:]
    kv_a = linear(x, w["kv_a_proj_with_mqa.weight"])
    c_kv = rms_norm(kv_a[:, :r], w["kv_a_layernorm.weight"], cfg.rms_norm_eps)
    k_pe = kv_a[:, r:]
    if not cfg.mla_use_nope and dr > 0:
        q_pe = rope_interleaved(q_pe, positions, cfg.rope_theta)
        k_pe = rope_interleaved(k_pe, positions, cfg.rope_theta)
    return q_nope, q_pe, c_kv, k_pe


def _causal_softmax(scores: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """scores `[h, Tq, S]` -> probabilities (acc dtype), keys after the query's position masked out."""
    acc = acc_dtype(scores.dtype)
    mask = k_positions[None, :] > q_positions[:, None]  # [Tq, S]
    s = scores.to(acc).masked_fill(mask[None], float("-inf"))
    return torch.softmax(s, dim=-1)


def _query_positions(tq: int, s: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries are the last tq of the s cached tokens: query i sits at position s - tq + i."""
    return torch.arange(s - tq, s, device=device), torch.arange(s, device=device)


def mla_attend_expanded(
    q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, kv_b: torch.Tensor, cfg
) -> torch.Tensor:
    """Expanded attention. q_nope `[Tq, h, dn]`, q_pe `[Tq, h, dr]` for the LAST Tq of S tokens whose latents
    are c_kv `[S, r]`, k_pe `[S, dr]`; kv_b = kv_b_proj.weight `[h*(dn+dv), r]`. Returns o `[Tq, h, dv]`.

    score = (q_nope·k_nope + q_pe·k_pe) * (dn+dr)^-1/2, causal softmax (acc dtype), o = sum p·v.
    """
    h, dn, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    S = c_kv.shape[0]
    kv = linear(c_kv, kv_b).reshape(S, h, dn + dv)
    k_nope, v = kv[..., :dn], kv[..., dn:]
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    scores = torch.einsum("qhd,shd->hqs", q_nope, k_nope) + torch.einsum("qhd,sd->hqs", q_pe, k_pe)
    qp, kp = _query_positions(q_nope.shape[0], S, c_kv.device)
    p = _causal_softmax(scores * scale, qp, kp).to(v.dtype)
    return torch.einsum("hqs,shd->qhd", p, v)


def mla_attend_absorbed(
    q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, kv_b: torch.Tensor, cfg
) -> torch.Tensor:
    """Weight-absorbed attention (the decode form); same contract as `mla_attend_expanded`.

    kv_b splits per head into W_UK `[dn, r]` and W_UV `[dv, r]`. q_lat = q_nope W_UK (r per head);
    score = (q_lat·c_kv + q_pe·k_pe) * (dn+dr)^-1/2; o_lat = sum p·c_kv; o = o_lat W_UVᵀ.
    """
    h, dn, dv, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    S = c_kv.shape[0]
    wkv = kv_b.to(q_nope.dtype).reshape(h, dn + dv, r)
    w_uk, w_uv = wkv[:, :dn, :], wkv[:, dn:, :]
    q_lat = torch.einsum("qhd,hdr->qhr", q_nope, w_uk)
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    scores = torch.einsum("qhr,sr->hqs", q_lat, c_kv) + torch.einsum("qhd,sd->hqs", q_pe, k_pe)
    qp, kp = _query_positions(q_nope.shape[0], S, c_kv.device)
    p = _causal_softmax(scores * scale, qp, kp).to(c_kv.dtype)
    o_lat = torch.einsum("hqs,sr->qhr", p, c_kv)
    return torch.einsum("qhr,hvr->qhv", o_lat, w_uv)


def mla_output(o: torch.Tensor, x: torch.Tensor, w: LayerWeights, cfg) -> torch.Tensor:
    """o `[T, h, dv]` -> `[T, H]`: optional sigmoid output gate g_proj(x) (acc dtype), then o_proj."""
    T = o.shape[0]
    o = o.reshape(T, -1)
    if cfg.mla_use_output_gate:
        acc = acc_dtype(o.dtype)
        o = (o.to(acc) * torch.sigmoid(linear(x, w["g_proj.weight"]).to(acc))).to(x.dtype)
    return linear(o, w["o_proj.weight"])


def mla_forward(
    x: torch.Tensor, w: LayerWeights, cfg, positions: torch.Tensor | None = None, absorbed: bool = False
) -> torch.Tensor:
    """One MLA layer on one whole sequence (causal). x `[T, H]` (the normed layer input) -> `[T, H]`."""
    if positions is None:
        positions = torch.arange(x.shape[0], device=x.device)
    q_nope, q_pe, c_kv, k_pe = mla_project(x, w, cfg, positions)
    attend = mla_attend_absorbed if absorbed else mla_attend_expanded
    o = attend(q_nope, q_pe, c_kv, k_pe, w["kv_b_proj.weight"], cfg)
    return mla_output(o, x, w, cfg)
