"""Argmax-invariant shaping for randomly sampled rows: temperature, min-p, top-k, top-p.

Every function takes `logits: Tensor[M, V]` (float32 or float64; the M random rows) and per-row
parameter tensors of shape [M], and returns a new tensor of the same shape in which removed tokens
are -inf. Parameter tensors may live on the CPU (preferred: the branch decisions are then taken
without a device sync) or on the logits' device.
Order used by `Sampler` (vLLM v1): temperature, min-p, then top-k and top-p.
"""

from __future__ import annotations

import torch


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits / temperature per row; temperature: Tensor[M] > 0 (greedy rows never get here)."""
    return logits / temperature.to(device=logits.device, dtype=logits.dtype, non_blocking=True).unsqueeze(1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is < min_p * (max probability of the row); min_p: Tensor[M].

    Rows with min_p == 0 are unchanged (every probability is >= 0).
    """
    probs = torch.softmax(logits, dim=-1)
    min_p = min_p.to(device=logits.device, dtype=logits.dtype, non_blocking=True)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p; one descending sort per row when any row uses top-p, else one topk.

    top_k: Tensor[M] int64, 0 = disabled; keeps every token whose logit is >= the k-th largest
      (ties at the boundary are kept, as in vLLM, so exactly k survive when values are distinct).
    top_p: Tensor[M] in (0, 1], 1 = disabled; on the top-k-renormalised distribution keeps the
      smallest highest-probability prefix whose cumulative probability is >= p (always >= 1 token).
    Surviving tokens keep their exact logit values, so a row's result does not depend on the batch.
    """
    vocab = logits.shape[1]
    k = torch.where((top_k <= 0) | (top_k > vocab), torch.full_like(top_k, vocab), top_k)
    if not bool((top_p < 1.0).any()):
        return apply_top_k(logits, k)
    k = k.to(logits.device, non_blocking=True)
    top_p = top_p.to(device=logits.device, dtype=logits.dtype, non_blocking=True)
    use_p = top_p < 1.0
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    cum = torch.cumsum(probs, dim=-1)
    mass_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)  # exclusive prefix sum
    drop = (mass_before >= top_p.unsqueeze(1)) & use_p.unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Top-k alone: k: Tensor[M] int64 in [1, V] (V = disabled); same tie rule as apply_top_k_top_p.

    Uses one `topk` of the largest k among the rows that filter, instead of a full sort.
    """
    vocab = logits.shape[1]
    active = k < vocab
    if not bool(active.any()):
        return logits
    max_k = int(torch.where(active, k, torch.ones_like(k)).max())
    k, active = k.to(logits.device, non_blocking=True), active.to(logits.device, non_blocking=True)
    top_vals = logits.topk(max_k, dim=-1).values
    kth = top_vals.gather(1, (k.clamp(max=max_k) - 1).unsqueeze(1))
    kth = torch.where(active.unsqueeze(1), kth, torch.full_like(kth, float("-inf")))
    return logits.masked_fill(logits < kth, float("-inf"))
