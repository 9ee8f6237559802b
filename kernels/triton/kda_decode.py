"""Fused KDA decode step in Triton: one launch per layer for conv-state update + short conv + SiLU +
L2 norm + decay gate + beta + delta-rule update + output + per-head gated RMSNorm.

Work split (knobs of `kda_decode_triton`): a program owns one (sequence, head) and V / v_splits rows of its
[V, K] state (fp32 math in registers), walked in block_v-row slices with the next slice (and the raw
inputs of its v-channel conv) in flight while the current one is processed. The delta rule is exact per
state row (S' k̂ = S (e⊙k̂), S_new q̂ = S (e⊙q̂) + u (k̂·q̂)), so a split into row blocks needs no combine
except the per-head output RMSNorm over V:
  * v_splits == 1: one program per (sequence, head) does everything, including the norm (in registers when
    block_v == V, else through a small fp32 scratch row) and every conv-state write;
  * v_splits > 1: each split writes the conv state of its v channels and its rows of the unnormalised
    output to scratch; the q/k conv channels are read by every split, so their conv state (and the norm,
    gate and output) is written after all splits are done: by a light second kernel (combine="kernel"), or
    by the last split of the head to arrive, found with an atomic arrival counter (combine="atomic").
No host sync; capturable in a CUDA graph. Contract: `k3serve.kernels.reference.kda_decode`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import is_pow2, next_pow2


@triton.jit
def _conv_load(x_row_ptr, cw_ptr, cs_ptr, ch, init, W: tl.constexpr, WB: tl.constexpr):
    """Raw inputs of the short conv over channels `ch`: new input, history, shifted history, weights."""
    rw = tl.arange(0, WB)
    xn = tl.load(x_row_ptr + ch)
    hist_m = (rw[None, :] < W - 1) & (init != 0)
    hist = tl.load(cs_ptr + ch[:, None] * (W - 1) + rw[None, :], mask=hist_m, other=0.0)
    shifted_m = (rw[None, :] + 1 < W - 1) & (init != 0)
    shifted = tl.load(cs_ptr + ch[:, None] * (W - 1) + rw[None, :] + 1, mask=shifted_m, other=0.0)
    wt = tl.load(cw_ptr + ch[:, None] * W + rw[None, :], mask=rw[None, :] < W, other=0.0)
    return xn, hist, shifted, wt


@triton.jit
def _conv_apply(xn, hist, shifted, wt, W: tl.constexpr, WB: tl.constexpr):
    """SiLU(conv) of the loaded inputs, and the rolled conv state (history shifted by one, new input last)."""
    rw = tl.arange(0, WB)
    win = tl.where(rw[None, :] == W - 1, xn.to(tl.float32)[:, None], hist.to(tl.float32))
    y = tl.sum(win * wt.to(tl.float32), axis=1)
    y = y * tl.sigmoid(y)
    new = tl.where(rw[None, :] == W - 2, xn[:, None].to(shifted.dtype), shifted)
    return y, new


@triton.jit
def _conv_step(x_row_ptr, cw_ptr, cs_ptr, ch, init, W: tl.constexpr, WB: tl.constexpr):
    """Short conv of one new input over channels `ch`, with SiLU. Returns (y, the rolled conv state of `ch`)."""
    xn, hist, shifted, wt = _conv_load(x_row_ptr, cw_ptr, cs_ptr, ch, init, W, WB)
    return _conv_apply(xn, hist, shifted, wt, W, WB)


@triton.jit
def _conv_store(cs_ptr, ch, new, W: tl.constexpr, WB: tl.constexpr):
    rw = tl.arange(0, WB)
    tl.store(
        cs_ptr + ch[:, None] * (W - 1) + rw[None, :],
        new.to(cs_ptr.dtype.element_ty),
        mask=rw[None, :] < W - 1,
    )


@triton.jit(do_not_specialize=["H"])
def _kda_decode_kernel(
    qkv_ptr,
    cw_ptr,
    cs_ptr,
    rg_ptr,
    alog_ptr,
    dtb_ptr,
    bl_ptr,
    gate_ptr,
    onw_ptr,
    pool_ptr,
    slot_ptr,
    init_ptr,
    out_ptr,
    scr_ptr,
    cnt_ptr,
    qkv_stride,
    cs_stride,
    pool_stride,
    bl_stride,
    gt_stride,
    scale,
    lower_bound,
    eps,
    H,
    K: tl.constexpr,
    V: tl.constexpr,
    W: tl.constexpr,
    WB: tl.constexpr,
    HAS_INIT: tl.constexpr,
    HAS_LB: tl.constexpr,
    BR: tl.constexpr,
    NS: tl.constexpr,
    ATOMIC: tl.constexpr,
):
    # the splits of one (sequence, head) are neighbours in launch order, so that they run together and share
    # the q/k conv inputs through L2
    n = tl.program_id(0) // NS
    h = tl.program_id(1)
    RPS: tl.constexpr = V // NS  # state rows owned by this program
    NB: tl.constexpr = RPS // BR  # slices of BR rows walked by this program
    OUT_HERE: tl.constexpr = NS == 1 or ATOMIC  # this kernel writes the output and the q/k conv state
    r0 = (tl.program_id(0) % NS) * RPS
    slot = tl.load(slot_ptr + n).to(tl.int64)
    if HAS_INIT:  # loaded alongside the slot: the first state load depends on both
        init = tl.load(init_ptr + n).to(tl.int32)
    else:
        init = 0
    rk = tl.arange(0, K)
    rr = tl.arange(0, BR)
    nh = n.to(tl.int64) * H + h
    if slot >= 0:
        # the first state slice (skipped for a fresh state) and the raw inputs of its v-channel conv are
        # requested before the q/k prologue so that their latency overlaps it
        pool_row = pool_ptr + slot * pool_stride + h * V * K + r0 * K
        S_nxt = tl.load(pool_row + rr[:, None] * K + rk[None, :], mask=init != 0, other=0.0)
        x_row = qkv_ptr + n.to(tl.int64) * qkv_stride
        cs = cs_ptr + slot * cs_stride
        vch = 2 * H * K + h * V + r0 + rr
        xv, hv, sv, wv = _conv_load(x_row, cw_ptr, cs, vch, init, W, WB)
        q, q_st = _conv_step(x_row, cw_ptr, cs, h * K + rk, init, W, WB)
        k, k_st = _conv_step(x_row, cw_ptr, cs, H * K + h * K + rk, init, W, WB)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        z = tl.load(rg_ptr + nh * K + rk).to(tl.float32)
        z = z + tl.load(dtb_ptr + h * K + rk).to(tl.float32)
        a = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
        if HAS_LB:
            g = lower_bound * tl.sigmoid(a * z)
        else:
            g = -a * tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))
        beta = tl.sigmoid(tl.load(bl_ptr + n.to(tl.int64) * bl_stride + h).to(tl.float32))
        if OUT_HERE:  # output weights requested early, out of the final latency chain
            if NS == 1 and NB == 1:
                rv = rr
            else:
                rv = tl.arange(0, V)
            gw = tl.load(onw_ptr + rv).to(tl.float32) * tl.sigmoid(
                tl.load(gate_ptr + n.to(tl.int64) * gt_stride + h * V + rv).to(tl.float32)
            )
        e = tl.exp(g)
        ek = e * k
        eq = e * q
        kq = tl.sum(k * q, axis=0)
        if NB == 1:
            S = S_nxt.to(tl.float32)
            v, v_st = _conv_apply(xv, hv, sv, wv, W, WB)
            u = beta * (v - tl.sum(S * ek[None, :], axis=1))
            o = tl.sum(S * eq[None, :], axis=1) + u * kq
            tl.store(
                pool_row + rr[:, None] * K + rk[None, :],
                (S * e[None, :] + u[:, None] * k[None, :]).to(pool_ptr.dtype.element_ty),
            )
            _conv_store(cs, vch, v_st, W, WB)
            if NS > 1:
                tl.store(scr_ptr + nh * V + r0 + rr, o)
        else:
            for j in range(0, RPS, BR):
                S = S_nxt.to(tl.float32)
                v, v_st = _conv_apply(xv, hv, sv, wv, W, WB)
                # next slice: state rows and v-channel conv inputs (masked off past the last slice)
                more = j + BR < RPS
                S_nxt = tl.load(
                    pool_row + (j + BR + rr[:, None]) * K + rk[None, :], mask=more & (init != 0), other=0.0
                )
                xv, hv, sv, wv = _conv_load(x_row, cw_ptr, cs, tl.where(more, vch + j + BR, vch), init, W, WB)
                u = beta * (v - tl.sum(S * ek[None, :], axis=1))
                o = tl.sum(S * eq[None, :], axis=1) + u * kq
                tl.store(
                    pool_row + (j + rr[:, None]) * K + rk[None, :],
                    (S * e[None, :] + u[:, None] * k[None, :]).to(pool_ptr.dtype.element_ty),
                )
                _conv_store(cs, vch + j, v_st, W, WB)
                tl.store(scr_ptr + nh * V + r0 + j + rr, o)
        if OUT_HERE:
            last = True
            if NS > 1:
                # Last-arriving split finishes the head. The scalar atomic runs in one thread between two CTA
                # barriers (Triton's lowering), the grid-sync pattern: every thread's scratch stores precede
                # the release, and the last split's reads (.cg, past L1) follow its acquire. All splits have
                # read the q/k conv state by then, so the last one may overwrite it.
                tl.debug_barrier()
                last = tl.atomic_add(cnt_ptr + nh, 1, sem="acq_rel", scope="gpu") == NS - 1
            if last:
                _conv_store(cs, h * K + rk, q_st, W, WB)
                _conv_store(cs, H * K + h * K + rk, k_st, W, WB)
                if NS == 1 and NB == 1:  # the program holds all of o: norm in registers
                    o_all = o
                else:
                    tl.debug_barrier()
                    o_all = tl.load(scr_ptr + nh * V + rv, cache_modifier=".cg")
                o_all = o_all * tl.rsqrt(tl.sum(o_all * o_all, axis=0) / V + eps) * gw
                tl.store(out_ptr + nh * V + rv, o_all.to(out_ptr.dtype.element_ty))
                if NS > 1:
                    tl.store(cnt_ptr + nh, 0)  # ready for the next launch
    else:
        if OUT_HERE and r0 == 0:
            rv = tl.arange(0, V)
            tl.store(out_ptr + nh * V + rv, tl.zeros([V], dtype=tl.float32).to(out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["H"])
def _kda_decode_epilogue(
    qkv_ptr,
    cs_ptr,
    gate_ptr,
    onw_ptr,
    slot_ptr,
    init_ptr,
    out_ptr,
    scr_ptr,
    qkv_stride,
    cs_stride,
    gt_stride,
    eps,
    H,
    K: tl.constexpr,
    V: tl.constexpr,
    W: tl.constexpr,
    WB: tl.constexpr,
    HAS_INIT: tl.constexpr,
):
    """After a v-split main kernel: q/k conv-state roll of each head, then RMSNorm(o) ⊙ sigmoid(gate)."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    nh = n.to(tl.int64) * H + h
    rv = tl.arange(0, V)
    if slot >= 0:
        if HAS_INIT:
            init = tl.load(init_ptr + n).to(tl.int32)
        else:
            init = 0
        rw = tl.arange(0, WB)
        rk = tl.arange(0, 2 * K)
        ch = tl.where(rk < K, h * K + rk, H * K + h * K + rk - K)
        x_row = qkv_ptr + n.to(tl.int64) * qkv_stride
        cs = cs_ptr + slot * cs_stride
        xn = tl.load(x_row + ch)
        shifted = tl.load(
            cs + ch[:, None] * (W - 1) + rw[None, :] + 1,
            mask=(rw[None, :] + 1 < W - 1) & (init != 0),
            other=0.0,
        )
        o = tl.load(scr_ptr + nh * V + rv)
        gt = tl.load(gate_ptr + n.to(tl.int64) * gt_stride + h * V + rv).to(tl.float32)
        o = o * tl.rsqrt(tl.sum(o * o, axis=0) / V + eps) * tl.load(onw_ptr + rv).to(tl.float32)
        tl.store(out_ptr + nh * V + rv, (o * tl.sigmoid(gt)).to(out_ptr.dtype.element_ty))
        new = tl.where(rw[None, :] == W - 2, xn[:, None].to(shifted.dtype), shifted)
        _conv_store(cs, ch, new, W, WB)
    else:
        tl.store(out_ptr + nh * V + rv, tl.zeros([V], dtype=tl.float32).to(out_ptr.dtype.element_ty))


_COUNTERS: dict[tuple, torch.Tensor] = {}


SMALL_LAUNCH = 256
"""At most this many (sequence, head) programs, the default walks the whole state in one slice with 8 warps
(H200 sweep, session 3: faster at N=1 for 12/32/96 heads; at N=32 x 12-32 heads (384+ programs) 3-5 % slower, hence the cap)."""


def _arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for combine="atomic", one per (sequence, head), kept per (device,
    stream): each launch leaves them zero again. Allocated outside any CUDA graph capture when possible
    (a first call before capture, at the largest N·H, does it)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def supported(qkv, raw_g, state_pool, conv_states) -> bool:
    K, V = raw_g.shape[-1], state_pool.shape[2]
    dims = all(d >= 16 and (d & (d - 1)) == 0 for d in (K, V)) and K * V <= 128 * 128
    f64 = any(t.dtype == torch.float64 for t in (qkv, raw_g, state_pool, conv_states))
    return dims and not f64 and qkv.stride(-1) == 1


def kda_decode_triton(
    qkv,
    conv_weight,
    conv_states,
    raw_g,
    A_log,
    dt_bias,
    beta_logit,
    gate,
    o_norm_weight,
    state_pool,
    state_indices,
    has_initial_state,
    *,
    lower_bound=None,
    scale=None,
    eps=1e-5,
    block_v=None,
    v_splits=1,
    num_warps=None,
    maxnreg=None,
    combine="kernel",
):
    """Triton implementation of `reference.kda_decode` (same arguments and result).

    Tuning knobs (results do not depend on them beyond fp32 rounding): `v_splits` programs per (sequence,
    head), each owning V / v_splits state rows (> 1 adds a light second launch for the q/k conv state and
    the output norm); `block_v` rows per slice of the walk (clamped to V / v_splits); `num_warps`;
    `maxnreg` (register cap per thread, None = compiler's choice); `combine` for v_splits > 1: "kernel" (the
    second launch writes the output and the q/k conv state) or "atomic" (the last split of each head to
    arrive does, through arrival counters kept per (device, stream): no second launch, no re-read).
    """
    N, H, K = raw_g.shape
    V = state_pool.shape[2]
    C = 2 * H * K + H * V
    if block_v is None and num_warps is None and v_splits == 1 and N * H <= SMALL_LAUNCH:
        block_v, num_warps = 128, 8  # few programs: the whole state at once (H200: N=1 10.1-11.6 -> 8.5-10.5 µs)
    block_v = block_v or 32
    num_warps = num_warps or 4
    cw = conv_weight.reshape(C, -1).contiguous()
    W = cw.shape[1]
    if (
        qkv.shape != (N, C)
        or tuple(conv_states.shape[1:]) != (C, W - 1)
        or tuple(state_pool.shape[1:]) != (H, V, K)
    ):
        raise ValueError(
            f"kda_decode shapes: qkv {tuple(qkv.shape)}, conv_weight {tuple(conv_weight.shape)}, conv_states "
            f"{tuple(conv_states.shape)}, raw_g {tuple(raw_g.shape)}, state_pool {tuple(state_pool.shape)}"
        )
    if conv_states.shape[0] and not (conv_states[0].is_contiguous() and state_pool[0].is_contiguous()):
        raise ValueError("each slot of conv_states / state_pool must be contiguous")
    if not (is_pow2(v_splits) and V % v_splits == 0 and is_pow2(block_v)):
        raise ValueError(
            f"kda_decode: v_splits {v_splits} must be a power of 2 dividing V={V}; block_v {block_v}"
            " a power of 2"
        )
    out = torch.empty(N, H, V, dtype=qkv.dtype, device=qkv.device)
    if N == 0:
        return out
    scratch = torch.empty(N, H, V, dtype=torch.float32, device=qkv.device)
    scale = K**-0.5 if scale is None else float(scale)
    rg = raw_g.contiguous()
    # beta logits and gate are read in place with a row stride (the engine passes column slices of its merged
    # input projection): a copy only when a row is not unit-strided
    bl = beta_logit.reshape(N, H)
    bl = bl if bl.stride(-1) == 1 or H == 1 else bl.contiguous()
    gt = gate.reshape(N, H * V)
    gt = gt if gt.stride(-1) == 1 else gt.contiguous()
    onw = o_norm_weight.contiguous()
    # the kernels cast what they load: int32/int64 slots and bool/int flags go in as they are (no copy kernels)
    slots = state_indices if state_indices.dtype in (torch.int32, torch.int64) else state_indices.to(torch.int32)
    init = has_initial_state
    if init is not None and init.dtype not in (torch.bool, torch.int32, torch.int64):
        init = init.to(torch.int32)
    init_arg = init if init is not None else slots
    rps = V // v_splits
    if combine not in ("kernel", "atomic"):
        raise ValueError(f"kda_decode: combine must be 'kernel' or 'atomic', not {combine!r}")
    atomic = v_splits > 1 and combine == "atomic"
    cnt = _arrival_counters(qkv.device, N * H) if atomic else slots
    opts = {"num_warps": num_warps}
    if maxnreg is not None:
        opts["maxnreg"] = maxnreg
    _kda_decode_kernel[(N * v_splits, H)](
        qkv,
        cw,
        conv_states,
        rg,
        A_log.contiguous(),
        dt_bias.contiguous(),
        bl,
        gt,
        onw,
        state_pool,
        slots,
        init_arg,
        out,
        scratch,
        cnt,
        qkv.stride(0),
        conv_states.stride(0),
        state_pool.stride(0),
        bl.stride(0),
        gt.stride(0),
        scale,
        0.0 if lower_bound is None else float(lower_bound),
        float(eps),
        H=H,
        K=K,
        V=V,
        W=W,
        WB=next_pow2(W),
        HAS_INIT=init is not None,
        HAS_LB=lower_bound is not None,
        BR=min(block_v, rps),
        NS=v_splits,
        ATOMIC=atomic,
        **opts,
    )
    if v_splits > 1 and not atomic:
        _kda_decode_epilogue[(N, H)](
            qkv,
            conv_states,
            gt,
            onw,
            slots,
            init_arg,
            out,
            scratch,
            qkv.stride(0),
            conv_states.stride(0),
            gt.stride(0),
            float(eps),
            H=H,
            K=K,
            V=V,
            W=W,
            WB=next_pow2(W),
            HAS_INIT=init is not None,
            num_warps=4,
        )
    return out
