"""RecoverSSM in Triton: the verify (outputs + corrections, no state write) and the fold (commit).

Same contracts as kernels/kda_recover.py's reference functions (which dispatch here on CUDA). Both are
token-serial like kernels/triton/kda_recurrent.py: one program per (row, head, V block) keeps its
[BV, K] state slice in fp32 registers.
  verify: S <- S diag(e^g); u = β (v - S k̂); record u; o = S q̂ (+ u k̂ᵀq̂); S <- S + u k̂ᵀ. S0 never stored.
  fold:   from S0, for t < c: S <- S diag(e^{g_t}) + u_t k̂_tᵀ, then store S into the out slot.
The fold reads S0 from a gathered copy, so an out slot may be any row's checkpoint. No host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2
from .kda_chunk import check_pool


def supported(*tensors, K: int, V: int) -> bool:
    """fp32/bf16/fp16 CUDA (or interpreter) tensors, K and V powers of two in [16, 256]."""
    ok_dim = all(d >= 16 and (d & (d - 1)) == 0 and d <= 256 for d in (K, V))
    return ok_dim and not any(t.dtype == torch.float64 for t in tensors)


@triton.jit(do_not_specialize=["H"])
def _verify_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, u_ptr, pool_ptr, slot_ptr, init_ptr, cu_ptr,
                   scale, pool_stride, u_stride, H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                   L2NORM: tl.constexpr, HAS_INIT: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    t_lo = tl.load(cu_ptr + b).to(tl.int64)
    t_hi = tl.load(cu_ptr + b + 1).to(tl.int64)
    rk = tl.arange(0, K)
    rv = vb * BV + tl.arange(0, BV)
    mv = rv < V
    if HAS_INIT:
        init = tl.load(init_ptr + b)
    else:
        init = 0
    pool_row = pool_ptr + slot * pool_stride + h * V * K
    S = tl.load(pool_row + rv[:, None] * K + rk[None, :], mask=(init != 0) & mv[:, None], other=0.0).to(tl.float32)
    u_row = u_ptr + b.to(tl.int64) * u_stride
    for t in range(t_lo, t_hi):
        base = t * H + h
        qx = tl.load(q_ptr + base * K + rk).to(tl.float32)
        kx = tl.load(k_ptr + base * K + rk).to(tl.float32)
        if L2NORM:
            qx = qx * tl.rsqrt(tl.sum(qx * qx, axis=0) + 1e-6)
            kx = kx * tl.rsqrt(tl.sum(kx * kx, axis=0) + 1e-6)
        qx = qx * scale
        gx = tl.load(g_ptr + base * K + rk).to(tl.float32)
        bx = tl.load(b_ptr + base).to(tl.float32)
        vx = tl.load(v_ptr + base * V + rv, mask=mv, other=0.0).to(tl.float32)
        ex = tl.exp(gx)
        uu = bx * (vx - tl.sum(S * (ex * kx)[None, :], axis=1))
        ox = tl.sum(S * (ex * qx)[None, :], axis=1) + uu * tl.sum(kx * qx, axis=0)
        S = S * ex[None, :] + uu[:, None] * kx[None, :]
        tl.store(o_ptr + base * V + rv, ox.to(o_ptr.dtype.element_ty), mask=mv)
        tl.store(u_row + ((t - t_lo) * H + h) * V + rv, uu.to(u_ptr.dtype.element_ty), mask=mv)


@triton.jit(do_not_specialize=["H"])
def _fold_kernel(s0_ptr, k_ptr, g_ptr, u_ptr, n_ptr, out_ptr, pool_ptr, pool_stride,
                 ks_n, ks_t, ks_h, gs_n, gs_t, gs_h, us_n, us_t, us_h, H,
                 K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    rk = tl.arange(0, K)
    rv = vb * BV + tl.arange(0, BV)
    mv = rv < V
    S = tl.load(s0_ptr + (n * H + h) * V * K + rv[:, None] * K + rk[None, :], mask=mv[:, None], other=0.0)
    S = S.to(tl.float32)
    c = tl.load(n_ptr + n)
    for t in range(0, c):
        kx = tl.load(k_ptr + n * ks_n + t * ks_t + h * ks_h + rk).to(tl.float32)
        if L2NORM:
            kx = kx * tl.rsqrt(tl.sum(kx * kx, axis=0) + 1e-6)
        gx = tl.load(g_ptr + n * gs_n + t * gs_t + h * gs_h + rk).to(tl.float32)
        ux = tl.load(u_ptr + n * us_n + t * us_t + h * us_h + rv, mask=mv, other=0.0).to(tl.float32)
        S = S * tl.exp(gx)[None, :] + ux[:, None] * kx[None, :]
    out = tl.load(out_ptr + n).to(tl.int64)
    tl.store(pool_ptr + out * pool_stride + h * V * K + rv[:, None] * K + rk[None, :],
             S.to(pool_ptr.dtype.element_ty), mask=mv[:, None])


def kda_recover_verify_triton(q, k, v, g, beta, state_pool, state_indices, cu_seqlens, has_initial_state,
                              corrections, *, scale=None, use_qk_l2norm=True, chunk_size=64):
    """Triton `kda_recover_verify` (chunk_size is accepted for the signature; the walk is token-serial)."""
    T, H, K = q.shape
    V = v.shape[-1]
    check_pool(state_pool)
    if corrections.stride(-1) != 1 or corrections.stride(-2) != V or corrections.stride(-3) != H * V:
        raise ValueError("corrections rows must be contiguous [Tmax, H, V]")
    dev = q.device
    B = cu_seqlens.numel() - 1
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    o = torch.zeros(v.shape, dtype=v.dtype, device=dev)
    if B == 0 or T == 0:
        return o
    cu = cu_seqlens.to(device=dev, dtype=torch.int32)
    slots = state_indices.to(device=dev, dtype=torch.int32)
    init = None if has_initial_state is None else has_initial_state.to(device=dev, dtype=torch.int32)
    BV = min(32, next_pow2(V))
    _verify_kernel[(B, H, triton.cdiv(V, BV))](
        q, k, v, g, beta, o, corrections, state_pool, slots, init if init is not None else slots, cu,
        scale, state_pool.stride(0), corrections.stride(0), H=H, K=K, V=V, BV=BV, L2NORM=bool(use_qk_l2norm),
        HAS_INIT=init is not None, num_warps=4,
    )
    return o


def kda_recover_fold_triton(state_pool, state_indices, has_initial_state, k, g, corrections, num_tokens,
                            out_slots, *, use_qk_l2norm=True):
    """Triton `kda_recover_fold`: S0 rows are gathered first (one copy), then one launch folds them."""
    N, tmax, H, K = k.shape
    V = corrections.shape[-1]
    check_pool(state_pool)
    if N == 0:
        return
    for t in (k, g, corrections):
        if t.stride(-1) != 1:
            raise ValueError("records must be contiguous in their last dimension")
    dev = state_pool.device
    slots = state_indices.to(device=dev, dtype=torch.long)
    S0 = state_pool.index_select(0, slots)
    if has_initial_state is not None:
        keep = has_initial_state.to(device=dev, dtype=torch.bool).view(N, 1, 1, 1)
        S0 = torch.where(keep, S0, torch.zeros((), dtype=S0.dtype, device=dev))
    counts = num_tokens.to(device=dev, dtype=torch.int32)
    outs = out_slots.to(device=dev, dtype=torch.int32)
    BV = min(32, next_pow2(V))
    _fold_kernel[(N, H, triton.cdiv(V, BV))](
        S0.contiguous(), k, g, corrections, counts, outs, state_pool, state_pool.stride(0),
        k.stride(0), k.stride(1), k.stride(2), g.stride(0), g.stride(1), g.stride(2),
        corrections.stride(0), corrections.stride(1), corrections.stride(2), H,
        K=K, V=V, BV=BV, L2NORM=bool(use_qk_l2norm), num_warps=4,
    )


@triton.jit(do_not_specialize=["H"])
def _commit_state_kernel(kg_ptr, u_ptr, alog_ptr, bias_ptr, pool_ptr, counts_ptr, outs_ptr, s0_ptr, init_ptr,
                         rec_ptr, seg_ptr, lower_bound, pool_stride, kg_sn, kg_st, kg_sh, u_sn, u_st, u_sh, H,
                         K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
                         HAS_LB: tl.constexpr):
    """Request r's commit at one layer: gate from the recorded raw gate, fold, a store at each length.

    One program per (request, head, V block) walks the request's tokens once (up to its longest length:
    entries seg[r]..seg[r+1], counts ascending) and after each token stores its slice into the entries
    whose length ends there; the checkpoint slice is read before the program's first store and no other
    program touches it, so the last out slot may be the checkpoint's own. (No loop bound is carried
    from one entry to the next: that form passed the interpreter but not the H200.)
    """
    r = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    rk = tl.arange(0, K)
    rv = vb * BV + tl.arange(0, BV)
    mv = rv < V
    slice_off = h * V * K + rv[:, None] * K + rk[None, :]
    s0 = tl.load(s0_ptr + r).to(tl.int64)
    init = tl.load(init_ptr + r)
    rec = tl.load(rec_ptr + r).to(tl.int64)
    e0 = tl.load(seg_ptr + r)
    e1 = tl.load(seg_ptr + r + 1)
    kg_row = kg_ptr + rec * kg_sn
    u_row = u_ptr + rec * u_sn
    S = tl.load(pool_ptr + s0 * pool_stride + slice_off, mask=(init != 0) & mv[:, None], other=0.0).to(tl.float32)
    a = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    bias = tl.load(bias_ptr + h * K + rk).to(tl.float32)
    for n in range(e0, e1):  # lengths 0: the checkpoint itself
        out = tl.load(outs_ptr + n).to(tl.int64)
        keep = tl.load(counts_ptr + n) == 0
        tl.store(pool_ptr + out * pool_stride + slice_off, S.to(pool_ptr.dtype.element_ty), mask=mv[:, None] & keep)
    c_max = tl.load(counts_ptr + e1 - 1, mask=e1 > e0, other=0)  # counts ascending: the request's longest
    for t in range(0, c_max):
        kx = tl.load(kg_row + t * kg_st + h * kg_sh + rk).to(tl.float32)
        if L2NORM:
            kx = kx * tl.rsqrt(tl.sum(kx * kx, axis=0) + 1e-6)
        z = tl.load(kg_row + t * kg_st + h * kg_sh + K + rk).to(tl.float32) + bias
        if HAS_LB:
            gx = lower_bound * tl.sigmoid(a * z)
        else:
            gx = -a * tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))
        ux = tl.load(u_row + t * u_st + h * u_sh + rv, mask=mv, other=0.0).to(tl.float32)
        S = S * tl.exp(gx)[None, :] + ux[:, None] * kx[None, :]
        for n in range(e0, e1):  # the lengths that end at this token
            out = tl.load(outs_ptr + n).to(tl.int64)
            keep = tl.load(counts_ptr + n) == t + 1
            tl.store(pool_ptr + out * pool_stride + slice_off, S.to(pool_ptr.dtype.element_ty),
                     mask=mv[:, None] & keep)


@triton.jit(do_not_specialize=["C"])
def _commit_conv_kernel(conv_ptr, x_ptr, counts_ptr, outs_ptr, s0_ptr, init_ptr, rec_ptr, seg_ptr, conv_stride,
                        x_sn, x_st, C, W: tl.constexpr, BC: tl.constexpr):
    """Conv windows after each of request r's lengths: columns c..c+W-1 of [history | inputs], per
    channel block. The out slot of the last (longest) length may be the history's own: each column is
    loaded before any column it could overwrite is stored, and channel blocks are disjoint."""
    r = tl.program_id(0)
    cb = tl.program_id(1)
    rc = cb * BC + tl.arange(0, BC)
    mc = rc < C
    init = tl.load(init_ptr + r)
    hist = conv_ptr + tl.load(s0_ptr + r).to(tl.int64) * conv_stride + rc * W
    x_row = x_ptr + tl.load(rec_ptr + r).to(tl.int64) * x_sn
    for n in range(tl.load(seg_ptr + r), tl.load(seg_ptr + r + 1)):
        c = tl.load(counts_ptr + n)
        dst = conv_ptr + tl.load(outs_ptr + n).to(tl.int64) * conv_stride + rc * W
        for w in tl.static_range(W):
            col = c + w
            vh = tl.load(hist + col, mask=mc & (col < W) & (init != 0), other=0.0)
            vx = tl.load(x_row + (col - W).to(tl.int64) * x_st + rc, mask=mc & (col >= W), other=0.0)
            tl.store(dst + w, (vh + vx).to(conv_ptr.dtype.element_ty), mask=mc)


def kda_recover_commit_rows_triton(state_pool, conv_states, s0_slots, inits, rec_rows, seg, key_gate, corrections,
                                   conv_inputs, A_log, dt_bias, lower_bound, counts, outs, *, use_qk_l2norm=True):
    """Triton `kda_recover_commit_rows` (see kernels/kda_recover.py): two launches, no host sync."""
    R = s0_slots.numel()
    _, T, H, K2 = key_gate.shape
    K = K2 // 2
    V = corrections.shape[-1]
    if R == 0 or counts.numel() == 0:
        return
    check_pool(state_pool)
    check_pool(conv_states)
    if key_gate.stride(-1) != 1 or corrections.stride(-1) != 1 or conv_inputs.stride(-1) != 1:
        raise ValueError("records must be contiguous in their last dimension")
    dev = state_pool.device
    i32 = dict(device=dev, dtype=torch.int32)
    counts, outs, seg = counts.to(**i32), outs.to(**i32), seg.to(**i32)
    s0_slots, inits, rec_rows = s0_slots.to(**i32), inits.to(**i32), rec_rows.to(**i32)
    BV = min(32, next_pow2(V))
    _commit_state_kernel[(R, H, triton.cdiv(V, BV))](
        key_gate, corrections, A_log, dt_bias, state_pool, counts, outs, s0_slots, inits, rec_rows, seg,
        0.0 if lower_bound is None else float(lower_bound), state_pool.stride(0), key_gate.stride(0),
        key_gate.stride(1), key_gate.stride(2), corrections.stride(0), corrections.stride(1), corrections.stride(2),
        H, K=K, V=V, BV=BV, L2NORM=bool(use_qk_l2norm), HAS_LB=lower_bound is not None, num_warps=4,
    )
    C, W = conv_states.shape[1], conv_states.shape[2]
    if W > 0:
        BC = 256
        _commit_conv_kernel[(R, triton.cdiv(C, BC))](
            conv_states, conv_inputs, counts, outs, s0_slots, inits, rec_rows, seg, conv_states.stride(0),
            conv_inputs.stride(0), conv_inputs.stride(1), C, W=W, BC=BC, num_warps=4,
        )
