"""KDA over short chunks in Triton (speculative verify steps): conv, gate and delta rule token by token.

Same contract as `k3serve.kernels.cpu.kda_verify.kda_verify` (o [T, H, V] in fp32 before o_norm; final
states and conv windows written back; the checkpoint exports, the state and conv window after 1..len
tokens, written to their slots), with every index read ON THE DEVICE: sequence starts (`cu_seqlens`), state
slots, has_initial_state and the checkpoint triples. No host sync and no glue kernels (one launch per
layer): a verify step that uses it can be captured in a CUDA graph (workers/engine/spec/static_verify.py).
With `gate` and `o_norm_weight` the output is the layer's gated RMSNorm of o, in qkv's dtype (as kda_decode).

Work split, as the fused one-token kernel kernels/triton/kda_decode.py: one program per (sequence, head)
holds the head's whole [V, K] state in fp32 registers and walks the sequence's tokens in order. The inputs
of a block of `TOKEN_BLOCK` tokens (conv, l2 norms, gate, beta; the output norm after the walk) are loaded
and mapped as [tokens, channels] tiles at once, so the serial walk itself does no global loads:
  conv:  y_t = SiLU(sum_w w[:, w] * z[:, t + w]) over z = [history (W-1 raw inputs) | chunk]; the history
         is read before the program writes anything (and kept in registers for the exported windows),
         chunk rows are read from qkv (read-only), so a slot written during the walk (an export into the
         sequence's own slot) never changes what later tokens read;
  gate:  g = lower_bound * sigmoid(exp(A_log) * (raw_g + dt_bias)) (or -exp(A_log) * softplus(..));
  delta: S <- S diag(e^g); u = beta (v - S k); S <- S + u k^T; o_t = S q (q, k l2-normed, q scaled).
After token t the program scans the checkpoint triples (a vector compare per block of `BCK`) for exports
of (its sequence, offset t + 1) and stores the state and the conv window after t + 1 tokens there, in the
triples' order; at the end the final state and window go to the sequence's own slot unless one of its
exports already targeted that slot (the contract: final states first, checkpoints after, so the checkpoint
wins). A sequence with slot -1 (padding) reads and writes no slot and exports nothing; its output rows, and
those past the last sequence (one extra program per head), are written as zeros.
Outside the contract: two sequences writing one slot (final or export) with different values (their
programs run in any order); the static verify batch's repeated padding exports are identical writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import interpreting, next_pow2

TOKEN_BLOCK = 8
"""Tokens whose inputs a program loads and maps at once (a verify chunk is 1 + k <= 9 tokens: one block for
k <= 7); a longer sequence walks several blocks."""


@triton.jit
def _conv_block(x_ptr, x_stride, cw_ptr, cs, ch, t0, tb0, L, init, CH: tl.constexpr, W: tl.constexpr,
                TB: tl.constexpr):
    """SiLU of the short conv over channels `ch` [CH] for the sequence's tokens tb0 .. tb0 + TB - 1 (rows past
    L are zero): y[t] = sum_w w[:, w] z[:, t + w] over z = [history | chunk], with every load issued at once
    (the history from the conv state, read before this program writes any slot, the chunk rows from qkv)."""
    rt = tb0 + tl.arange(0, TB)
    live = rt < L
    y = tl.zeros([TB, CH], dtype=tl.float32)
    for w in tl.static_range(W):
        p = rt + w  # position in z
        wc = tl.load(cw_ptr + ch * W + w).to(tl.float32)
        xm = live & (p >= W - 1)
        xv = tl.load(x_ptr + (t0 + p - (W - 1))[:, None] * x_stride + ch[None, :], mask=xm[:, None], other=0.0)
        hm = live & (p < W - 1) & (init != 0)
        hv = tl.load(cs + ch[None, :] * (W - 1) + p[:, None], mask=hm[:, None], other=0.0)
        y += (xv.to(tl.float32) + hv.to(tl.float32)) * wc[None, :]
    return y * tl.sigmoid(y)


@triton.jit
def _conv_window_store(dst_ptr, x_ptr, x_stride, hist, ch, t0, j, W: tl.constexpr, WB: tl.constexpr):
    """Store the conv window after j tokens over channels `ch`: z[:, j .. j + W - 2] (W - 1 raw inputs)."""
    rw = tl.arange(0, WB)
    win = tl.zeros_like(hist)
    for s in tl.static_range(W - 1):  # history column s lands at window column s - j
        col = tl.sum(tl.where(rw[None, :] == s, hist, 0.0), axis=1)
        win = tl.where(rw[None, :] == s - j, col[:, None], win)
    xm = (rw[None, :] + j >= W - 1) & (rw[None, :] < W - 1)
    row = t0 + j + rw[None, :] - (W - 1)
    xw = tl.load(x_ptr + row.to(tl.int64) * x_stride + ch[:, None], mask=xm, other=0.0).to(tl.float32)
    win = tl.where(rw[None, :] + j >= W - 1, xw, win)
    tl.store(dst_ptr + ch[:, None] * (W - 1) + rw[None, :], win.to(dst_ptr.dtype.element_ty),
             mask=rw[None, :] < W - 1)


@triton.jit(do_not_specialize=["H", "NCK", "B", "N"])
def _kda_verify_kernel(
    qkv_ptr, cw_ptr, cs_ptr, rg_ptr, alog_ptr, dtb_ptr, bl_ptr, pool_ptr, slot_ptr, init_ptr, cu_ptr,
    cks_ptr, cko_ptr, ckl_ptr, gate_ptr, onw_ptr, out_ptr,
    qkv_stride, cs_stride, pool_stride, bl_stride, gt_stride, scale, lower_bound, eps, H, NCK, B, N,
    K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, WB: tl.constexpr, HAS_INIT: tl.constexpr,
    HAS_LB: tl.constexpr, BCK: tl.constexpr, NORM_GATE: tl.constexpr, TB: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    rv = tl.arange(0, V)
    if b == B:  # the last program: zero outputs for the rows past the last sequence (none in the engine)
        slot = b.to(tl.int64) * 0 - 1
        z0 = tl.load(cu_ptr + B).to(tl.int64)
        z1 = N.to(tl.int64) + 0 * z0
    else:
        slot = tl.load(slot_ptr + b).to(tl.int64)
        z0 = tl.load(cu_ptr + b).to(tl.int64)
        z1 = tl.load(cu_ptr + b + 1).to(tl.int64)
    if slot < 0:  # a padding row (or the rows past the last sequence): zero outputs, no state read or written
        for r in range(z0, z1):
            tl.store(out_ptr + (r * H + h) * V + rv, tl.zeros([V], dtype=tl.float32).to(out_ptr.dtype.element_ty))
    else:
        t0 = z0
        L = z1 - z0
        if HAS_INIT:
            init = tl.load(init_ptr + b).to(tl.int32)
        else:
            init = 0
        rk = tl.arange(0, K)
        rw = tl.arange(0, WB)
        qch = h * K + rk
        kch = H * K + h * K + rk
        vch = 2 * H * K + h * V + rv
        cs = cs_ptr + slot * cs_stride
        hm = (rw[None, :] < W - 1) & (init != 0)
        hq = tl.load(cs + qch[:, None] * (W - 1) + rw[None, :], mask=hm, other=0.0).to(tl.float32)
        hk = tl.load(cs + kch[:, None] * (W - 1) + rw[None, :], mask=hm, other=0.0).to(tl.float32)
        hv = tl.load(cs + vch[:, None] * (W - 1) + rw[None, :], mask=hm, other=0.0).to(tl.float32)
        pool_off = h * V * K + rv[:, None] * K + rk[None, :]
        S = tl.load(pool_ptr + slot * pool_stride + pool_off, mask=init != 0, other=0.0).to(tl.float32)
        a = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
        dtb = tl.load(dtb_ptr + h * K + rk).to(tl.float32)
        if NORM_GATE:
            onw = tl.load(onw_ptr + rv).to(tl.float32)
        own_ck = slot * 0  # an export of this sequence went to its own slot: it replaces the final write
        rt0 = tl.arange(0, TB)
        for tb0 in range(0, L, TB):  # blocks of TB tokens: inputs of the whole block loaded and mapped at once
            rt = tb0 + rt0
            live = rt < L
            rows = t0 + rt
            q_b = _conv_block(qkv_ptr, qkv_stride, cw_ptr, cs, qch, t0, tb0, L, init, K, W, TB)
            k_b = _conv_block(qkv_ptr, qkv_stride, cw_ptr, cs, kch, t0, tb0, L, init, K, W, TB)
            v_b = _conv_block(qkv_ptr, qkv_stride, cw_ptr, cs, vch, t0, tb0, L, init, V, W, TB)
            q_b = q_b * (tl.rsqrt(tl.sum(q_b * q_b, axis=1) + 1e-6) * scale)[:, None]
            k_b = k_b * tl.rsqrt(tl.sum(k_b * k_b, axis=1) + 1e-6)[:, None]
            z = tl.load(rg_ptr + (rows * H + h)[:, None] * K + rk[None, :], mask=live[:, None], other=0.0)
            z = z.to(tl.float32) + dtb[None, :]
            if HAS_LB:
                g = lower_bound * tl.sigmoid(a * z)
            else:
                g = -a * tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))
            e_b = tl.exp(g)
            beta_b = tl.sigmoid(tl.load(bl_ptr + rows * bl_stride + h, mask=live, other=0.0).to(tl.float32))
            o_b = tl.zeros([TB, V], dtype=tl.float32)
            for t in range(tb0, tl.minimum(tb0 + TB, L)):
                sel = rt == t
                q = tl.sum(tl.where(sel[:, None], q_b, 0.0), axis=0)
                k = tl.sum(tl.where(sel[:, None], k_b, 0.0), axis=0)
                v = tl.sum(tl.where(sel[:, None], v_b, 0.0), axis=0)
                e = tl.sum(tl.where(sel[:, None], e_b, 0.0), axis=0)
                beta = tl.sum(tl.where(sel, beta_b, 0.0), axis=0)
                S = S * e[None, :]
                u = beta * (v - tl.sum(S * k[None, :], axis=1))
                S = S + u[:, None] * k[None, :]
                o = tl.sum(S * q[None, :], axis=1)
                o_b = tl.where(sel[:, None], o[None, :], o_b)
                # exports of (this sequence, offset t + 1), in the order of the triples
                for c0 in range(0, NCK, BCK):
                    jj = c0 + tl.arange(0, BCK)
                    jm = jj < NCK
                    hit = jm & (tl.load(cks_ptr + jj, mask=jm, other=-1) == b)
                    hit = hit & (tl.load(cko_ptr + jj, mask=jm, other=-1) == t + 1)
                    nhit = tl.sum(hit.to(tl.int32), axis=0)
                    while nhit > 0:
                        j = tl.min(tl.where(hit, jj, NCK + BCK), axis=0)
                        ck = tl.load(ckl_ptr + j).to(tl.int64)
                        tl.store(pool_ptr + ck * pool_stride + pool_off, S.to(pool_ptr.dtype.element_ty))
                        dst = cs_ptr + ck * cs_stride
                        _conv_window_store(dst, qkv_ptr, qkv_stride, hq, qch, t0, t + 1, W, WB)
                        _conv_window_store(dst, qkv_ptr, qkv_stride, hk, kch, t0, t + 1, W, WB)
                        _conv_window_store(dst, qkv_ptr, qkv_stride, hv, vch, t0, t + 1, W, WB)
                        own_ck = tl.where(ck == slot, 1, own_ck)
                        hit = hit & (jj != j)
                        nhit -= 1
            if NORM_GATE:  # the layer's gated RMSNorm over V, as kda_decode's output
                gt = tl.load(gate_ptr + rows[:, None] * gt_stride + h * V + rv[None, :], mask=live[:, None],
                             other=0.0).to(tl.float32)
                o_b = o_b * tl.rsqrt(tl.sum(o_b * o_b, axis=1) / V + eps)[:, None] * onw[None, :] * tl.sigmoid(gt)
            tl.store(out_ptr + (rows * H + h)[:, None] * V + rv[None, :], o_b.to(out_ptr.dtype.element_ty),
                     mask=live[:, None])
        if own_ck == 0:
            tl.store(pool_ptr + slot * pool_stride + pool_off, S.to(pool_ptr.dtype.element_ty))
            _conv_window_store(cs, qkv_ptr, qkv_stride, hq, qch, t0, L, W, WB)
            _conv_window_store(cs, qkv_ptr, qkv_stride, hk, kch, t0, L, W, WB)
            _conv_window_store(cs, qkv_ptr, qkv_stride, hv, vch, t0, L, W, WB)


def supported(qkv, conv_weight, conv_states, raw_g, state_pool) -> bool:
    """CUDA (or interpreter) fp32/bf16/fp16 tensors; K, V powers of two in [16, 128]; W >= 2; unit-strided rows."""
    K, V = raw_g.shape[-1], state_pool.shape[2]
    dims = all(16 <= d <= 128 and (d & (d - 1)) == 0 for d in (K, V))
    on = qkv.is_cuda or (interpreting() and qkv.device.type == "cpu")
    f64 = any(t.dtype == torch.float64 for t in (qkv, conv_weight, conv_states, raw_g, state_pool))
    W = conv_weight.shape[-1]
    return (on and dims and not f64 and W >= 2 and qkv.dim() == 2 and qkv.stride(-1) == 1
            and conv_states.dim() == 3 and state_pool.dim() == 4)


def kda_verify_triton(qkv, conv_weight, conv_states, raw_g, A_log, dt_bias, beta_logit, state_pool, state_indices,
                      cu_seqlens, has_initial_state, *, lower_bound=None, scale=None, checkpoint_seq=None,
                      checkpoint_offsets=None, checkpoint_slots=None, gate=None, o_norm_weight=None, eps=1e-5,
                      num_warps=None):
    """Triton implementation of `cpu.kda_verify.kda_verify` (same arguments; o [T, H, V] fp32). With `gate`
    [T, H*V] and `o_norm_weight` [V]: the layer's output RMSNorm(o) * o_norm_weight * sigmoid(gate) in qkv's
    dtype instead (fused per token, as kernels/triton/kda_decode.py; ops.kda_verify's `gate` form)."""
    N, H, K = raw_g.shape
    V = state_pool.shape[2]
    C = 2 * H * K + H * V
    cw = conv_weight.reshape(C, -1).contiguous()
    W = cw.shape[1]
    if (qkv.shape != (N, C) or tuple(conv_states.shape[1:]) != (C, W - 1)
            or tuple(state_pool.shape[1:]) != (H, V, K)):
        raise ValueError(
            f"kda_verify shapes: qkv {tuple(qkv.shape)}, conv_weight {tuple(conv_weight.shape)}, conv_states "
            f"{tuple(conv_states.shape)}, raw_g {tuple(raw_g.shape)}, state_pool {tuple(state_pool.shape)}")
    if conv_states.shape[0] and not (conv_states[0].is_contiguous() and state_pool[0].is_contiguous()):
        raise ValueError("each slot of conv_states / state_pool must be contiguous")
    given = [t is not None for t in (checkpoint_seq, checkpoint_offsets, checkpoint_slots)]
    if any(given) and not all(given):
        raise ValueError("checkpoint_seq, checkpoint_offsets and checkpoint_slots go together")
    norm_gate = gate is not None
    if norm_gate != (o_norm_weight is not None):
        raise ValueError("kda_verify: gate and o_norm_weight go together")
    B = cu_seqlens.shape[0] - 1
    if N == 0 or B <= 0:
        return torch.zeros(N, H, V, dtype=qkv.dtype if norm_gate else torch.float32, device=qkv.device)
    out = torch.empty(N, H, V, dtype=qkv.dtype if norm_gate else torch.float32, device=qkv.device)  # every row written
    slots = state_indices
    init = has_initial_state
    if init is not None and init.dtype not in (torch.bool, torch.int32, torch.int64):
        init = init.to(torch.int32)
    if all(given):
        cks, cko, ckl = checkpoint_seq, checkpoint_offsets, checkpoint_slots
        nck = cks.shape[0]
    else:
        cks = cko = ckl = slots
        nck = 0
    bl = beta_logit.reshape(N, H)
    bl = bl if bl.stride(-1) == 1 or H == 1 else bl.contiguous()
    if norm_gate:
        gt = gate.reshape(N, H * V)
        gt = gt if gt.stride(-1) == 1 else gt.contiguous()
        onw = o_norm_weight.contiguous()
    else:
        gt = onw = bl
    _kda_verify_kernel[(B + 1, H)](
        qkv, cw, conv_states, raw_g.contiguous(), A_log.contiguous(), dt_bias.contiguous(), bl, state_pool,
        slots, init if init is not None else slots, cu_seqlens, cks, cko, ckl, gt, onw, out,
        qkv.stride(0), conv_states.stride(0), state_pool.stride(0), bl.stride(0), gt.stride(0),
        K ** -0.5 if scale is None else float(scale), 0.0 if lower_bound is None else float(lower_bound),
        float(eps), H, nck, B, N,
        K=K, V=V, W=W, WB=next_pow2(W), HAS_INIT=init is not None, HAS_LB=lower_bound is not None,
        BCK=min(64, next_pow2(max(nck, 1))), NORM_GATE=norm_gate, TB=max(TOKEN_BLOCK, next_pow2(W - 1)),
        num_warps=num_warps or (8 if K * V >= 64 * 64 else 4),  # sm_90: 8 warps keep K=V=64 free of spills
    )  # fmt: skip
    return out
