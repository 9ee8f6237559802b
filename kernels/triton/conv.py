"""Depthwise causal short convolution over a variable-length batch in Triton (the KDA layers' q/k/v conv in
prefill and mixed steps). Contract: `k3serve.kernels.reference.causal_conv1d_varlen`.

Three launches, no host synchronisation:
1. `_conv_out_kernel`, grid (token blocks, channel blocks): each output reads its K-1 predecessors from x
   when they lie inside its sequence, else from the sequence's slot in the state pool (zeros without an
   initial state); padded sequences (slot < 0) give zero rows.
2. `_conv_gather_kernel`, one program per state write (every sequence's final state, then every checkpoint):
   the K-1 raw inputs ending at the write's offset, built like the outputs' windows, into a scratch buffer —
   so every history is read before any slot is written, as the contract requires.
3. `_conv_scatter_kernel`, per channel block: copies the scratch rows to their slots in order (finals first,
   then checkpoints; a negative target is skipped).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import any_f64, next_pow2


@triton.jit
def _window_value(x_ptr, hist_ptr, rel, start, rc, mc, x_stride, h_c, h_k, has_hist, KM1: tl.constexpr):
    """Raw input at position `rel` (relative to the sequence start; negative = history) for channels rc."""
    inseq = rel >= 0
    xv = tl.load(x_ptr + (start + rel).to(tl.int64) * x_stride + rc, mask=mc & inseq, other=0.0).to(tl.float32)
    hv = tl.load(hist_ptr + rc * h_c + (KM1 + rel) * h_k, mask=mc & (rel < 0) & (rel >= -KM1) & has_hist,
                 other=0.0).to(tl.float32)
    return tl.where(inseq, xv, hv)


@triton.jit
def _conv_out_kernel(x_ptr, w_ptr, cs_ptr, y_ptr, cu_ptr, tseq_ptr, slot_ptr, init_ptr, T, C, x_stride, y_stride,
                     s_slot, s_c, s_k, w_stride, KW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                     SILU: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    rc = pid_c * BC + tl.arange(0, BC)
    mc = rc < C
    for i in range(BT):
        t = pid_t * BT + i
        if t < T:
            b = tl.load(tseq_ptr + t)
            start = tl.load(cu_ptr + b)
            slot = tl.load(slot_ptr + b).to(tl.int64)
            has_hist = (slot >= 0) & (tl.load(init_ptr + b) != 0)
            hist = cs_ptr + tl.maximum(slot, 0) * s_slot
            rel = t - start
            acc = tl.zeros([BC], dtype=tl.float32)
            for j in tl.static_range(KW):
                xv = _window_value(x_ptr, hist, rel - (KW - 1) + j, start, rc, mc, x_stride, s_c, s_k, has_hist,
                                   KW - 1)
                acc += xv * tl.load(w_ptr + rc * w_stride + j, mask=mc, other=0.0).to(tl.float32)
            if SILU:
                acc = acc * tl.sigmoid(acc)
            acc = tl.where(slot >= 0, acc, 0.0)
            tl.store(y_ptr + t.to(tl.int64) * y_stride + rc, acc.to(y_ptr.dtype.element_ty), mask=mc)


@triton.jit
def _conv_gather_kernel(x_ptr, cs_ptr, tmp_ptr, cu_ptr, slot_ptr, init_ptr, wseq_ptr, woff_ptr, C, x_stride,
                        s_slot, s_c, s_k, KM1: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
    w = tl.program_id(0)
    pid_c = tl.program_id(1)
    b = tl.load(wseq_ptr + w)
    off = tl.load(woff_ptr + w)
    start = tl.load(cu_ptr + b)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    has_hist = (slot >= 0) & (tl.load(init_ptr + b) != 0)
    hist = cs_ptr + tl.maximum(slot, 0) * s_slot
    rc = pid_c * BC + tl.arange(0, BC)
    mc = rc < C
    rk = tl.arange(0, BK)
    mk = rk < KM1
    rel = off - KM1 + rk  # [BK] window positions
    inseq = rel >= 0
    m2 = mc[:, None] & mk[None, :]
    xv = tl.load(x_ptr + (start + rel).to(tl.int64)[None, :] * x_stride + rc[:, None], mask=m2 & inseq[None, :],
                 other=0.0)
    hv = tl.load(hist + rc[:, None] * s_c + (KM1 + rel)[None, :] * s_k,
                 mask=m2 & (~inseq)[None, :] & (rel >= -KM1)[None, :] & has_hist, other=0.0)
    val = tl.where(inseq[None, :], xv.to(tl.float32), hv.to(tl.float32))
    tl.store(tmp_ptr + (w.to(tl.int64) * C + rc[:, None]) * KM1 + rk[None, :], val, mask=m2)


@triton.jit
def _conv_scatter_kernel(tmp_ptr, cs_ptr, tgt_ptr, NW, C, s_slot, s_c, s_k, KM1: tl.constexpr, BC: tl.constexpr,
                         BK: tl.constexpr):
    pid_c = tl.program_id(0)
    rc = pid_c * BC + tl.arange(0, BC)
    rk = tl.arange(0, BK)
    m2 = (rc < C)[:, None] & (rk < KM1)[None, :]
    for w in range(NW):  # in order: a later write to the same slot wins, as in the reference
        tgt = tl.load(tgt_ptr + w).to(tl.int64)
        if tgt >= 0:
            v = tl.load(tmp_ptr + (w * C + rc[:, None]).to(tl.int64) * KM1 + rk[None, :], mask=m2, other=0.0)
            tl.store(cs_ptr + tgt * s_slot + rc[:, None] * s_c + rk[None, :] * s_k,
                     v.to(cs_ptr.dtype.element_ty), mask=m2)


def supported(x, weight, conv_states) -> bool:
    K = weight.shape[-1]
    return not any_f64(x, weight, conv_states) and x.dim() == 2 and x.stride(-1) == 1 and 2 <= K <= 8


def causal_conv1d_varlen_triton(x, weight, conv_states, state_indices, cu_seqlens, has_initial_state, *,
                                activation="silu", checkpoint_seq=None, checkpoint_offsets=None,
                                checkpoint_slots=None):
    """Triton implementation of `reference.causal_conv1d_varlen` (same arguments and result; states in place).

    Inputs are trusted to be consistent (offsets within their sequences, slots within the pool): the engine
    builds them; the reference op validates them for other callers."""
    if activation not in ("silu", None, "none", "identity"):
        raise ValueError(f"unsupported activation {activation!r}")
    if weight.dim() == 3:
        weight = weight.squeeze(1)
    C, K = weight.shape
    if x.shape[1] != C or tuple(conv_states.shape[1:]) != (C, K - 1):
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"conv_states {tuple(conv_states.shape)}")
    given = [t is not None for t in (checkpoint_seq, checkpoint_offsets, checkpoint_slots)]
    if any(given) and not all(given):
        raise ValueError("checkpoint_seq, checkpoint_offsets and checkpoint_slots go together")
    T = x.shape[0]
    B = cu_seqlens.numel() - 1
    dev = x.device
    y = torch.empty_like(x)
    if B == 0:
        return y
    cu = cu_seqlens.to(device=dev, dtype=torch.int64)
    slots = state_indices.to(device=dev, dtype=torch.int64)
    if has_initial_state is None:  # no sequence has a history
        init = torch.zeros(B, dtype=torch.bool, device=dev)
    else:
        init = has_initial_state.to(device=dev)
    KM1 = K - 1
    BC = min(256, next_pow2(C))
    s_slot, s_c, s_k = conv_states.stride()
    if T > 0:
        tok = torch.arange(T, device=dev, dtype=torch.int64)
        tseq = torch.searchsorted(cu, tok, right=True) - 1
        BT = 8
        _conv_out_kernel[(triton.cdiv(T, BT), triton.cdiv(C, BC))](
            x, weight, conv_states, y, cu, tseq, slots, init, T, C, x.stride(0), y.stride(0), s_slot, s_c, s_k,
            weight.stride(0), KW=K, BT=BT, BC=BC, SILU=activation == "silu",
        )
    # state writes: every sequence's final state (target = its slot; -1 skipped), then the checkpoints
    seqs = torch.arange(B, device=dev, dtype=torch.int64)
    offs = cu[1:] - cu[:-1]
    tgts = slots
    if all(given) and checkpoint_seq.numel():
        seqs = torch.cat([seqs, checkpoint_seq.to(device=dev, dtype=torch.int64)])
        offs = torch.cat([offs, checkpoint_offsets.to(device=dev, dtype=torch.int64)])
        tgts = torch.cat([tgts, checkpoint_slots.to(device=dev, dtype=torch.int64)])
    NW = seqs.numel()
    tmp = torch.empty(NW, C, KM1, dtype=torch.float32, device=dev)
    BK = next_pow2(KM1)
    _conv_gather_kernel[(NW, triton.cdiv(C, BC))](
        x, conv_states, tmp, cu, slots, init, seqs, offs, C, x.stride(0), s_slot, s_c, s_k, KM1=KM1, BC=BC, BK=BK,
    )
    _conv_scatter_kernel[(triton.cdiv(C, BC),)](tmp, conv_states, tgts, NW, C, s_slot, s_c, s_k, KM1=KM1, BC=BC,
                                                BK=BK)
    return y
