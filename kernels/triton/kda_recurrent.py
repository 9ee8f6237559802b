"""KDA token-serial recurrence in Triton (decode-shaped batches and the `kda_recurrent` op).

One program per (sequence, head, V block) keeps its [BV, K] slice of the state in fp32 registers and walks
the sequence's tokens: S <- S diag(e^g); u = β (v - S k̂); S <- S + u k̂ᵀ; o = S q̂. No host sync:
cu_seqlens, slots and flags are read on the device, so a launch can be captured in a CUDA graph.
Checkpoints come as a per-token slot map (ckpt_tok[t] = slot to receive the state after token t, or -1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2
from .kda_chunk import check_pool


@triton.jit(do_not_specialize=["H"])
def _kda_recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, pool_ptr, slot_ptr, init_ptr, cu_ptr,
                          ckpt_ptr, scale, pool_stride, H, K: tl.constexpr, V: tl.constexpr,
                          BV: tl.constexpr, L2NORM: tl.constexpr, HAS_INIT: tl.constexpr,
                          HAS_CKPT: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    t_lo = tl.load(cu_ptr + b).to(tl.int64)
    t_hi = tl.load(cu_ptr + b + 1).to(tl.int64)
    rk = tl.arange(0, K)
    rv = vb * BV + tl.arange(0, BV)
    mv = rv < V
    if slot >= 0:
        if HAS_INIT:
            init = tl.load(init_ptr + b)
        else:
            init = 0
        pool_row = pool_ptr + slot * pool_stride + h * V * K
        S = tl.load(pool_row + rv[:, None] * K + rk[None, :], mask=(init != 0) & mv[:, None], other=0.0).to(tl.float32)
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
            if HAS_CKPT:
                ck = tl.load(ckpt_ptr + t).to(tl.int64)
                if ck >= 0:
                    tl.store(pool_ptr + ck * pool_stride + h * V * K + rv[:, None] * K + rk[None, :],
                             S.to(pool_ptr.dtype.element_ty), mask=mv[:, None])
        tl.store(pool_row + rv[:, None] * K + rk[None, :], S.to(pool_ptr.dtype.element_ty), mask=mv[:, None])
    else:
        for t in range(t_lo, t_hi):
            tl.store(o_ptr + (t * H + h) * V + rv, tl.zeros([BV], dtype=tl.float32).to(o_ptr.dtype.element_ty),
                     mask=mv)


def checkpoint_token_map(T: int, cu_seqlens: torch.Tensor, checkpoint_seq, checkpoint_offsets,
                         checkpoint_slots, device) -> torch.Tensor | None:
    """ckpt_tok [T] int32: slot receiving the state after each token (-1: none), built on the device.

    Only one checkpoint per token position is kept (callers never ask for two at one offset).
    """
    if checkpoint_seq is None:
        return None
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    seq = checkpoint_seq.to(device=device, dtype=torch.int64)
    tok = cu[seq] + checkpoint_offsets.to(device=device, dtype=torch.int64) - 1
    m = torch.full((T,), -1, dtype=torch.int32, device=device)
    m[tok] = checkpoint_slots.to(device=device, dtype=torch.int32)
    return m


def kda_recurrent_triton(q, k, v, g, beta, state_pool, state_indices, cu_seqlens, has_initial_state, *,
                         scale=None, use_qk_l2norm=True, checkpoint_seq=None, checkpoint_offsets=None,
                         checkpoint_slots=None):
    """Triton implementation of `reference.kda_recurrent` (same arguments and result).

    No host synchronisation and no validation of cu_seqlens / checkpoint values (the caller's contract).
    """
    T, H, K = q.shape
    V = v.shape[-1]
    if tuple(state_pool.shape[1:]) != (H, V, K):
        raise ValueError(f"state_pool {tuple(state_pool.shape)} must be [num_slots, {H}, {V}, {K}]")
    check_pool(state_pool)
    dev = q.device
    B = cu_seqlens.numel() - 1
    scale = K**-0.5 if scale is None else float(scale)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    o = torch.zeros(v.shape, dtype=v.dtype, device=dev) if T else torch.empty(v.shape, dtype=v.dtype, device=dev)
    if B == 0:
        return o
    cu = cu_seqlens.to(device=dev, dtype=torch.int32)
    slots = state_indices.to(device=dev, dtype=torch.int32)
    init = None if has_initial_state is None else has_initial_state.to(device=dev, dtype=torch.int32)
    ck = checkpoint_token_map(T, cu_seqlens, checkpoint_seq, checkpoint_offsets, checkpoint_slots, dev)
    BV = min(32, next_pow2(V))
    _kda_recurrent_kernel[(B, H, triton.cdiv(V, BV))](
        q, k, v, g, beta, o, state_pool, slots, init if init is not None else slots, cu,
        ck if ck is not None else slots, scale, state_pool.stride(0), H=H, K=K, V=V, BV=BV, L2NORM=bool(use_qk_l2norm),
        HAS_INIT=init is not None, HAS_CKPT=ck is not None, num_warps=4,
    )
    return o
