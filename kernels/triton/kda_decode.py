"""Fused KDA decode step in Triton: one launch per layer for conv-state update + short conv + SiLU +
L2 norm + decay gate + beta + delta-rule update + output + per-head gated RMSNorm.

One program per (sequence, head) owns that head's q/k/v conv channels and its whole [V, K] state (fp32 in
registers), so the in-place updates of conv state and recurrent state need no cross-program ordering.
No host sync; capturable in a CUDA graph. Contract: `k3serve.kernels.reference.kda_decode`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2


@triton.jit
def _conv_step(x_row_ptr, cw_ptr, cs_ptr, ch, init, W: tl.constexpr, WB: tl.constexpr):
    """Short conv of one new input over channels `ch`, with SiLU. Returns (y, the rolled conv state of `ch`)."""
    rw = tl.arange(0, WB)
    xn = tl.load(x_row_ptr + ch).to(tl.float32)
    hist_m = (rw[None, :] < W - 1) & (init != 0)
    hist = tl.load(cs_ptr + ch[:, None] * (W - 1) + rw[None, :], mask=hist_m, other=0.0).to(tl.float32)
    wt = tl.load(cw_ptr + ch[:, None] * W + rw[None, :], mask=rw[None, :] < W, other=0.0).to(tl.float32)
    win = tl.where(rw[None, :] == W - 1, xn[:, None], hist)
    y = tl.sum(win * wt, axis=1)
    y = y * tl.sigmoid(y)
    shifted_m = (rw[None, :] + 1 < W - 1) & (init != 0)
    shifted = tl.load(cs_ptr + ch[:, None] * (W - 1) + rw[None, :] + 1, mask=shifted_m, other=0.0)
    new = tl.where(rw[None, :] == W - 2, xn[:, None].to(shifted.dtype), shifted)
    return y, new


@triton.jit
def _conv_store(cs_ptr, ch, new, W: tl.constexpr, WB: tl.constexpr):
    rw = tl.arange(0, WB)
    tl.store(cs_ptr + ch[:, None] * (W - 1) + rw[None, :], new.to(cs_ptr.dtype.element_ty), mask=rw[None, :] < W - 1)


@triton.jit(do_not_specialize=["H"])
def _kda_decode_kernel(qkv_ptr, cw_ptr, cs_ptr, rg_ptr, alog_ptr, dtb_ptr, bl_ptr, gate_ptr, onw_ptr, pool_ptr,
                       slot_ptr, init_ptr, out_ptr, scr_ptr, qkv_stride, cs_stride, pool_stride, scale, lower_bound, eps,
                       H, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, WB: tl.constexpr,
                       HAS_INIT: tl.constexpr, HAS_LB: tl.constexpr, BR: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    rk = tl.arange(0, K)
    rv = tl.arange(0, V)
    out_off = (n.to(tl.int64) * H + h) * V + rv
    if slot >= 0:
        if HAS_INIT:
            init = tl.load(init_ptr + n).to(tl.int32)
        else:
            init = 0
        # the first state slice is requested before the conv work so that its latency overlaps it
        pool_row = pool_ptr + slot * pool_stride + h * V * K
        rr = tl.arange(0, BR)
        S_next = tl.load(pool_row + rr[:, None] * K + rk[None, :])
        x_row = qkv_ptr + n.to(tl.int64) * qkv_stride
        cs = cs_ptr + slot * cs_stride
        q, q_st = _conv_step(x_row, cw_ptr, cs, h * K + rk, init, W, WB)
        k, k_st = _conv_step(x_row, cw_ptr, cs, H * K + h * K + rk, init, W, WB)
        v, v_st = _conv_step(x_row, cw_ptr, cs, 2 * H * K + h * V + rv, init, W, WB)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        z = tl.load(rg_ptr + (n.to(tl.int64) * H + h) * K + rk).to(tl.float32)
        z = z + tl.load(dtb_ptr + h * K + rk).to(tl.float32)
        a = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
        if HAS_LB:
            g = lower_bound * tl.sigmoid(a * z)
        else:
            g = -a * tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))
        beta = tl.sigmoid(tl.load(bl_ptr + n.to(tl.int64) * H + h).to(tl.float32))
        # The state is walked in BR-row slices (S' k̂ = S (e⊙k̂) and S_new q̂ = S (e⊙q̂) + u (k̂·q̂), so each
        # slice is read once and written once, the next slice's load in flight while this one is
        # processed); unnormalised outputs go through a small fp32 scratch row so that the per-head
        # RMSNorm can see the whole of o.
        e = tl.exp(g)
        ek = e * k
        eq = e * q
        kq = tl.sum(k * q, axis=0)
        ss = 0.0
        for j in range(0, V, BR):
            rows = j + rr
            S = tl.where(init != 0, S_next.to(tl.float32), 0.0)
            S_next = tl.load(pool_row + (rows[:, None] + BR) * K + rk[None, :], mask=(rows[:, None] + BR) < V,
                             other=0.0)
            vj = tl.sum(tl.where(rv[None, :] == rows[:, None], v[None, :], 0.0), axis=1)
            u = beta * (vj - tl.sum(S * ek[None, :], axis=1))
            o = tl.sum(S * eq[None, :], axis=1) + u * kq
            tl.store(pool_row + rows[:, None] * K + rk[None, :],
                     (S * e[None, :] + u[:, None] * k[None, :]).to(pool_ptr.dtype.element_ty))
            tl.store(scr_ptr + (n.to(tl.int64) * H + h) * V + rows, o)
            ss += tl.sum(o * o, axis=0)
        _conv_store(cs, h * K + rk, q_st, W, WB)
        _conv_store(cs, H * K + h * K + rk, k_st, W, WB)
        _conv_store(cs, 2 * H * K + h * V + rv, v_st, W, WB)
        tl.debug_barrier()
        o = tl.load(scr_ptr + out_off)
        o = o * tl.rsqrt(ss / V + eps) * tl.load(onw_ptr + rv).to(tl.float32)
        gt = tl.load(gate_ptr + (n.to(tl.int64) * H + h) * V + rv).to(tl.float32)
        tl.store(out_ptr + out_off, (o * tl.sigmoid(gt)).to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptr + out_off, tl.zeros([V], dtype=tl.float32).to(out_ptr.dtype.element_ty))


def supported(qkv, raw_g, state_pool, conv_states) -> bool:
    K, V = raw_g.shape[-1], state_pool.shape[2]
    dims = all(d >= 16 and (d & (d - 1)) == 0 for d in (K, V)) and K * V <= 128 * 128
    f64 = any(t.dtype == torch.float64 for t in (qkv, raw_g, state_pool, conv_states))
    return dims and not f64 and qkv.stride(-1) == 1


def kda_decode_triton(qkv, conv_weight, conv_states, raw_g, A_log, dt_bias, beta_logit, gate, o_norm_weight,
                      state_pool, state_indices, has_initial_state, *, lower_bound=None, scale=None, eps=1e-5):
    """Triton implementation of `reference.kda_decode` (same arguments and result)."""
    N, H, K = raw_g.shape
    V = state_pool.shape[2]
    C = 2 * H * K + H * V
    cw = conv_weight.reshape(C, -1).contiguous()
    W = cw.shape[1]
    if qkv.shape != (N, C) or tuple(conv_states.shape[1:]) != (C, W - 1) or tuple(state_pool.shape[1:]) != (H, V, K):
        raise ValueError(
            f"kda_decode shapes: qkv {tuple(qkv.shape)}, conv_weight {tuple(conv_weight.shape)}, conv_states "
            f"{tuple(conv_states.shape)}, raw_g {tuple(raw_g.shape)}, state_pool {tuple(state_pool.shape)}"
        )
    if conv_states.shape[0] and not (conv_states[0].is_contiguous() and state_pool[0].is_contiguous()):
        raise ValueError("each slot of conv_states / state_pool must be contiguous")
    out = torch.empty(N, H, V, dtype=qkv.dtype, device=qkv.device)
    if N == 0:
        return out
    scratch = torch.empty(N, H, V, dtype=torch.float32, device=qkv.device)
    scale = K**-0.5 if scale is None else float(scale)
    rg = raw_g.contiguous()
    bl = beta_logit.reshape(N, H).contiguous()
    gt = gate.reshape(N, H * V).contiguous()
    slots = state_indices.to(dtype=torch.int32)
    init = None if has_initial_state is None else has_initial_state.to(dtype=torch.int32)
    _kda_decode_kernel[(N, H)](
        qkv, cw, conv_states, rg, A_log.contiguous(), dt_bias.contiguous(), bl, gt, o_norm_weight.contiguous(),
        state_pool, slots, init if init is not None else slots, out, scratch, qkv.stride(0), conv_states.stride(0),
        state_pool.stride(0), scale, 0.0 if lower_bound is None else float(lower_bound), float(eps),
        H=H, K=K, V=V, W=W, WB=next_pow2(W), HAS_INIT=init is not None, HAS_LB=lower_bound is not None,
        BR=min(32, V), num_warps=4,
    )
    return out
