"""Block Attention Residuals in Triton: residual update, block write, depth-wise softmax mixing over up
to NB+1 sources and the output RMSNorm, fused in one pass (one program per token row).

Each source row is read once; the softmax over sources runs online (running max and sum), so the
mixture needs no second pass. Contract: `k3serve.kernels.reference.attn_res`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import TL_DTYPE, next_pow2


@triton.jit
def _attn_res_kernel(partial_ptr, delta_ptr, blocks_ptr, wn_ptr, wq_ptr, wo_ptr, out_ptr, n, write_idx, eps,
                     eps_out, p_stride, d_stride, b_stride, o_stride, D: tl.constexpr, NB: tl.constexpr,
                     BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_OUT: tl.constexpr,
                     ROUND: tl.constexpr, ROUND_DT: tl.constexpr, P16: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BLOCK)
    m = r < D
    p_ptrs = partial_ptr + t * p_stride + r
    p = tl.load(p_ptrs, mask=m, other=0.0)
    if HAS_DELTA:
        new = p.to(tl.float32) + tl.load(delta_ptr + t * d_stride + r, mask=m, other=0.0).to(tl.float32)
        if ROUND:  # round-to-nearest-even, as torch's casts do (a 16-bit ROUND_DT only)
            new = new.to(ROUND_DT, fp_downcast_rounding="rtne").to(tl.float32)
        if P16:
            p = new.to(partial_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        else:
            p = new.to(partial_ptr.dtype.element_ty)
        tl.store(p_ptrs, p, mask=m)
    brow = blocks_ptr + t * b_stride
    pb = p.to(blocks_ptr.dtype.element_ty)
    if write_idx >= 0:
        tl.store(brow + write_idx * D + r, pb, mask=m)
    wqn = tl.load(wq_ptr + r, mask=m, other=0.0).to(tl.float32) * tl.load(wn_ptr + r, mask=m, other=0.0).to(tl.float32)
    pf = p.to(tl.float32)
    mx = tl.sum(pf * wqn, axis=0) * tl.rsqrt(tl.sum(pf * pf, axis=0) / D + eps)
    acc = pf
    den = 1.0
    for i in tl.static_range(NB):  # unrolled so that every source row's load can be in flight at once
        valid = i < n
        s = tl.load(brow + i * D + r, mask=m & valid, other=0.0)
        s = tl.where(i == write_idx, pb, s).to(tl.float32)
        logit = tl.sum(s * wqn, axis=0) * tl.rsqrt(tl.sum(s * s, axis=0) / D + eps)
        logit = tl.where(valid, logit, float("-inf"))
        m_new = tl.maximum(mx, logit)
        a = tl.exp(mx - m_new)
        b = tl.exp(logit - m_new)
        acc = acc * a + s * b
        den = den * a + b
        mx = m_new
    mix = acc / den
    if HAS_OUT:
        mix = mix * tl.rsqrt(tl.sum(mix * mix, axis=0) / D + eps_out)
        mix = mix * tl.load(wo_ptr + r, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * o_stride + r, mix.to(out_ptr.dtype.element_ty), mask=m)


def supported(partial, delta, blocks, round_dtype) -> bool:
    f64 = any(t is not None and t.dtype == torch.float64 for t in (partial, delta, blocks))
    rd = round_dtype is None or round_dtype in TL_DTYPE
    rows = partial.stride(-1) == 1 and (blocks.shape[0] == 0 or blocks[0].is_contiguous())
    return not f64 and rd and rows and (delta is None or delta.stride(-1) == 1) and partial.shape[1] <= 65536


def attn_res_triton(partial, delta, blocks, w_norm, w_q, w_out, n, write_idx, eps, eps_out=None, round_dtype=None):
    """Triton implementation of `reference.attn_res` (same arguments and result; partial/blocks in place)."""
    T, D = partial.shape
    NB = blocks.shape[1]
    if not 0 <= n <= NB or write_idx >= NB:
        raise ValueError(f"attn_res: n={n}, write_idx={write_idx} for {NB} blocks")
    out = torch.empty(T, D, dtype=partial.dtype, device=partial.device)
    if T == 0:
        return out
    BLOCK = next_pow2(D)
    _attn_res_kernel[(T,)](
        partial, delta if delta is not None else partial, blocks, w_norm, w_q.reshape(-1), w_out if w_out is not None
        else w_norm, out, int(n), int(write_idx), float(eps), float(eps if eps_out is None else eps_out),
        partial.stride(0), delta.stride(0) if delta is not None else 0, blocks.stride(0), out.stride(0),
        D=D, NB=NB, BLOCK=BLOCK, HAS_DELTA=delta is not None, HAS_OUT=w_out is not None,
        ROUND=round_dtype in (torch.bfloat16, torch.float16), ROUND_DT=TL_DTYPE.get(round_dtype, tl.bfloat16),
        P16=partial.dtype in (torch.bfloat16, torch.float16),
        num_warps=16 if BLOCK >= 8192 else (8 if BLOCK >= 2048 else 4),
    )
    return out
