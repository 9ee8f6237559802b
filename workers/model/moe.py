"""Dense MLP and (Latent)MoE, reference form (design doc §1.5), token-major `[T, H]` inputs.

* `dense_mlp(x, w, cfg)`: down(act(gate(x), up(x))).
* `route(x, gate_w, bias, cfg)`: sigmoid (or softmax) router; the correction bias is used only to
  SELECT experts (grouped top-k: a group scores the sum of its top-2 biased scores, the best
  `topk_group` groups stay); weights are the unbiased scores at the chosen ids, renormalized to sum 1
  when `moe_renormalize`, times `routed_scaling_factor`.
* `expert_weights(w, e, dtype)`: expert e's `(w13 [2I, Din], w2 [Dout, I])`, dequantized from MXFP4 when needed.
* `moe_forward(x, w, cfg)`: routed experts (in latent space under LatentMoE, then optional RMSNorm and the
  up-projection) plus shared experts on the original x.
"""

from __future__ import annotations

import torch

from k3serve.kernels.reference.mxfp4 import mxfp4_dequantize

from .functional import LayerWeights, acc_dtype, act_and_mul, linear, rms_norm


def dense_mlp(x: torch.Tensor, w: LayerWeights, cfg) -> torch.Tensor:
    """`[T, H]` -> `[T, H]` with gate_proj/up_proj `[I, H]`, down_proj `[H, I]`."""
    return linear(act_and_mul(linear(x, w["gate_proj.weight"]), linear(x, w["up_proj.weight"]), cfg),
                  w["down_proj.weight"])


def route(
    x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor | None, cfg
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router. x `[T, H]`, gate_w `[E, H]`, bias `[E]` or None -> (ids int64 `[T, k]`, weights `[T, k]` acc dtype).

    Router logits are computed in the acc dtype (fp32, fp64 for float64 models).
    """
    acc = acc_dtype(x.dtype)
    logits = x.to(acc) @ gate_w.to(acc).T
    scores = torch.sigmoid(logits) if cfg.router_activation == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores + bias.to(acc) if bias is not None else scores
    T, E = choice.shape
    G = cfg.num_expert_group
    if G > 1:
        grouped = choice.view(T, G, E // G)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(cfg.topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
    ids = choice.topk(cfg.num_experts_per_token, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.moe_renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights * cfg.routed_scaling_factor


def expert_weights(w: LayerWeights, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e's `(w13 [2I, Din], w2 [Dout, I])` in `dtype` (rows 0..I-1 of w13 = gate/w1, I..2I-1 = up/w3)."""
    if "experts.w13_packed" in w:
        w13 = mxfp4_dequantize(w["experts.w13_packed"][e], w["experts.w13_scale"][e], dtype)
        w2 = mxfp4_dequantize(w["experts.w2_packed"][e], w["experts.w2_scale"][e], dtype)
        return w13, w2
    return w["experts.w13"][e].to(dtype), w["experts.w2"][e].to(dtype)


def routed_experts(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: LayerWeights, cfg) -> torch.Tensor:
    """r = sum_k weights[:, k] * expert_{ids[:, k]}(z). z `[T, Din]` (model dtype) -> `[T, Dout]` (acc dtype)."""
    acc = acc_dtype(z.dtype)
    out = torch.zeros(z.shape[0], z.shape[1], dtype=acc, device=z.device)
    inter = cfg.moe_intermediate_size
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        w13, w2 = expert_weights(w, e, z.dtype)
        hidden = linear(z[tok], w13)
        y = linear(act_and_mul(hidden[:, :inter], hidden[:, inter:], cfg), w2)
        out.index_add_(0, tok, y.to(acc) * weights[tok, slot][:, None])
    return out


def moe_forward(x: torch.Tensor, w: LayerWeights, cfg) -> torch.Tensor:
    """The MoE block on `[T, H]` (the normed layer input) -> `[T, H]` (model dtype)."""
    bias = w["gate.e_score_correction_bias"] if "gate.e_score_correction_bias" in w else None
    ids, weights = route(x, w["gate.weight"], bias, cfg)
    if cfg.routed_expert_hidden_size is not None:
        z = linear(x, w["routed_expert_down_proj.weight"])
        r = routed_experts(z, ids, weights, w, cfg).to(x.dtype)
        if cfg.latent_moe_use_norm:
            r = rms_norm(r, w["routed_expert_norm.weight"], cfg.rms_norm_eps)
        y = linear(r, w["routed_expert_up_proj.weight"])
    else:
        y = routed_experts(x, ids, weights, w, cfg).to(x.dtype)
    if cfg.num_shared_experts > 0:
        y = y + dense_mlp(x, w.sub("shared_experts."), cfg)
    return y
