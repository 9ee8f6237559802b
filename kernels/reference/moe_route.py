"""MoE router: sigmoid/softmax scores, bias-corrected (noaux_tc) top-k selection with optional groups."""

from __future__ import annotations

import torch

from ._varlen import cast


def _topk_lowest_id_first(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row; ties go to the lowest index (stable descending sort)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def moe_route(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    *,
    num_expert_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    scoring: str = "sigmoid",
    shared_experts: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick top_k experts per token.

    router_logits [T, E]; correction_bias [E] or None. s = sigmoid(logits) ("sigmoid") or
    softmax over E ("softmax"), in fp32 (fp64 for fp64 logits). Selection uses s + bias. With
    num_expert_group > 1 the E experts form equal contiguous groups; a group's score is the sum of its
    top-2 biased scores (top-1 if a group has one expert), the best topk_group groups are kept and the
    others masked out. weights = unbiased s at the chosen ids, divided by their sum if `renormalize`,
    times routed_scaling_factor. Ties (groups and experts): lowest id first.
    Returns (weights fp32 [T, top_k] (fp64 for fp64 logits), ids int64 [T, top_k]), ids in selection order.
    shared_experts = n > 0 appends n columns to both: ids E, ..., E + n - 1 and weight exactly 1 (shared experts
    stored after the routed ones and computed in the same expert pass: workers/engine/k3_forward.py
    `SHARED_EXPERT_FUSION`); they are neither renormalized nor scaled.
    """
    T, E = router_logits.shape
    if shared_experts < 0:
        raise ValueError(f"shared_experts must be >= 0, got {shared_experts}")
    dt = torch.float64 if router_logits.dtype == torch.float64 else torch.float32
    logits = cast(router_logits, dt)
    if scoring == "sigmoid":
        s = torch.sigmoid(logits)
    elif scoring == "softmax":
        s = torch.softmax(logits, dim=-1)
    else:
        raise ValueError(f"unknown scoring {scoring!r}")
    sel = s if correction_bias is None else s + cast(correction_bias, dt)
    if num_expert_group > 1:
        if E % num_expert_group or not 1 <= topk_group <= num_expert_group:
            raise ValueError(f"E={E}, num_expert_group={num_expert_group}, topk_group={topk_group}")
        per = E // num_expert_group
        grouped = sel.view(T, num_expert_group, per)
        group_score = grouped.topk(min(2, per), dim=-1).values.sum(-1)  # [T, G]
        keep_groups = _topk_lowest_id_first(group_score, topk_group)
        keep = torch.zeros(T, num_expert_group, dtype=torch.bool, device=sel.device)
        keep.scatter_(1, keep_groups, True)
        sel = sel.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
    eligible = E if num_expert_group <= 1 else topk_group * (E // num_expert_group)
    if not 1 <= top_k <= eligible:
        raise ValueError(f"top_k={top_k} but only {eligible} experts are eligible")
    ids = _topk_lowest_id_first(sel, top_k)
    weights = s.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    weights, ids = weights * routed_scaling_factor, cast(ids, torch.int64)
    if shared_experts:
        dev = ids.device
        ids = torch.cat([ids, torch.arange(E, E + shared_experts, device=dev).expand(T, shared_experts)], 1)
        weights = torch.cat([weights, torch.ones(T, shared_experts, dtype=weights.dtype, device=dev)], 1)
    return weights, ids
