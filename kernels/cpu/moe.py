"""Routed experts on the CPU: grouped by expert in one pass, or dense over every expert at decode sizes.

Same contract as `k3serve.kernels.reference.moe_experts` (see it). Two exact evaluation orders:

* grouped: the (token, slot) pairs sorted by expert once (one argsort, one gather of the inputs), then
  float32: both projections of every expert as ONE `torch._grouped_mm` each over the expert-sorted rows;
  float64 (which `_grouped_mm` does not take): one GEMM pair per active expert on a contiguous slice; one
  weighted `index_add_` at the end (the reference does a `nonzero`, a gather and an `index_add_` per expert);
* dense (up to `DENSE_MAX_TOKENS` tokens; in float32 only with more than one thread): every expert on every
  token in three batched products (gate|up for all experts, the down projections, the routing weights —
  zero for unchosen experts), chosen when the experts nobody routes to cost fewer weight bytes than the
  per-expert loop's fixed cost per active expert (`LOOP_COST_BYTES`). With one thread the grouped form is
  faster at decode sizes (11.4 vs 13.3 ms per decode forward of benchmarks/vs_transformers.py's model);
  with two the dense form is (~10-11 vs ~13 ms): its large products use both cores, the grouped form's
  per-expert ones cannot.

Packed (MXFP4) or non-float32/float64 weights go to the reference op. Any strides are accepted; the CPU
engine stores each expert K-major (workers/engine/k3_forward.py `_prepare`), so that `w13.transpose(1, 2)`
is contiguous and every product is a plain NN GEMM (about 30 % less time per decode-sized product).
"""

from __future__ import annotations

import torch

from ..reference import moe_experts as _reference
from ..reference._varlen import cast, compute_dtype
from ..reference.activations import silu_and_mul, situ_and_mul

LOOP_COST_BYTES = 256 * 1024
"""The grouped loop's fixed cost per active expert (about ten small ops), as the weight bytes that would be
read in the same time at memory bandwidth; the dense form is used when (unrouted experts) x (bytes per
expert) is at most (active experts) x this."""

DENSE_MAX_TOKENS = 64
"""The dense form computes E/top_k times the routed products: only for decode-sized batches."""

def _grouped_mm_works() -> bool:
    """torch._grouped_mm exists and runs on CPU float32 tensors (older torch builds have it for CUDA only)."""
    try:
        x, w = torch.ones(2, 4), torch.ones(1, 4, 4)
        return bool(torch._grouped_mm(x, w, offs=torch.tensor([2], dtype=torch.int32)).eq(4).all())
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


GROUPED_MM = _grouped_mm_works()


def _aligned(t: torch.Tensor) -> bool:
    """`torch._grouped_mm` needs every non-unit stride to be a multiple of 16 bytes."""
    return all(s == 1 or s * t.element_size() % 16 == 0 for s in t.stride())


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
    dt = compute_dtype(z)
    if (w13 is None or w2 is None or z.dim() != 2 or w13.dtype != dt or w2.dtype != dt or z.dtype != dt
            or activation not in ("situ", "silu") or topk_ids.shape != topk_weights.shape):
        return _reference(z, topk_weights, topk_ids, w13=w13, w2=w2, w13_packed=w13_packed, w13_scale=w13_scale,
                          w2_packed=w2_packed, w2_scale=w2_scale, activation=activation, situ_beta=situ_beta,
                          situ_linear_beta=situ_linear_beta)

    def act(h: torch.Tensor) -> torch.Tensor:
        if activation == "situ":
            return situ_and_mul(h, situ_beta, situ_linear_beta)
        return silu_and_mul(h)

    T, k = topk_ids.shape
    E, two_i, d_in = w13.shape
    d_out = w2.shape[1]
    ids = cast(topk_ids, torch.long)
    valid = ids >= 0
    if T == 0 or not bool(valid.any()):
        return torch.zeros(T, d_out, dtype=dt)
    if int(ids.max()) >= E:
        raise IndexError(f"moe_experts: expert id {int(ids.max())} out of range for {E} experts")
    counts = torch.bincount(ids[valid], minlength=E)
    wts = cast(topk_weights, dt)
    grouped_mm = (GROUPED_MM and dt == torch.float32 and _aligned(w13.transpose(1, 2)) and _aligned(w2.transpose(1, 2))
                  and d_in % 4 == 0 and (two_i // 2) % 4 == 0)
    # the dense form: float64 (no grouped_mm), or with several threads (grouped_mm's per-expert products are too
    # small to split; the dense form's three large ones are not)
    dense_ok = T <= DENSE_MAX_TOKENS and (not grouped_mm or torch.get_num_threads() > 1)
    active = int((counts > 0).sum()) if dense_ok else 0
    bytes_per_expert = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    if dense_ok and (E - active) * bytes_per_expert <= active * LOOP_COST_BYTES:
        h = act(torch.bmm(z.expand(E, T, d_in), w13.transpose(1, 2)))  # [E, T, I]
        y = torch.bmm(h, w2.transpose(1, 2))  # [E, T, d_out]
        dense_w = torch.zeros(T, E, dtype=dt).scatter_add_(1, ids.clamp(min=0), torch.where(valid, wts, 0))
        return torch.bmm(dense_w.unsqueeze(1), y.transpose(0, 1)).squeeze(1)  # [T, d_out]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)[int((~valid).sum()):]  # by expert; ignored (negative) ids first
    tok = order // k
    x = z.index_select(0, tok)
    if grouped_mm:
        offs = counts.cumsum(0).to(torch.int32)
        h = act(torch._grouped_mm(x, w13.transpose(1, 2), offs=offs))
        ys = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
        return torch.zeros(T, d_out, dtype=dt).index_add_(0, tok, ys * wts.reshape(-1)[order, None])
    ys = torch.empty(order.numel(), d_out, dtype=dt)
    start = 0
    for e, c in enumerate(counts.tolist()):
        if c:
            torch.mm(act(x[start:start + c] @ w13[e].t()), w2[e].t(), out=ys[start:start + c])
            start += c
    return torch.zeros(T, d_out, dtype=dt).index_add_(0, tok, ys * wts.reshape(-1)[order, None])
