"""Absorbed MLA attention over the paged latent cache, in Triton (flash-decoding with split KV).

Work item = (one query token, a block of up to BM heads); all heads of an item share the latent KV rows,
so each KV row is read once per item. Per item, the key range [0, qpos] is split into NS pieces
processed by separate programs (online softmax in each), then merged by their log-sum-exp weights.
Items and splits are derived on the device only (no host sync; capturable in a CUDA graph).
Contract: `k3serve.kernels.reference.mla_paged_attention`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import dot_precision, next_pow2


@triton.jit
def _mla_split_kernel(ql_ptr, qp_ptr, kv_ptr, bt_ptr, sl_ptr, cu_ptr, tseq_ptr, o_ptr, pacc_ptr, pml_ptr,
                      scale, kv_s0, kv_s1, bt_s0, Hh, nhb, bs,
                      L: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      NS: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr):
    item = tl.program_id(0)
    s = tl.program_id(1)
    t = item // nhb
    hb0 = (item % nhb) * BM
    b = tl.load(tseq_ptr + t)
    nq = tl.load(cu_ptr + b + 1) - tl.load(cu_ptr + b)
    qpos = tl.load(sl_ptr + b) - nq + (t - tl.load(cu_ptr + b))  # last key position this token may see
    kv_hi = qpos + 1
    size = tl.cdiv(tl.cdiv(kv_hi, NS), BN) * BN
    lo = s * size
    hi = tl.minimum(lo + size, kv_hi)
    rm = tl.arange(0, BM)
    heads = hb0 + rm
    mrow = heads < Hh
    rl = tl.arange(0, L)
    rr = tl.arange(0, R)
    qrow = t.to(tl.int64) * Hh + heads
    qa = tl.load(ql_ptr + qrow[:, None] * L + rl[None, :], mask=mrow[:, None], other=0.0)
    qp = tl.load(qp_ptr + qrow[:, None] * R + rr[None, :], mask=mrow[:, None], other=0.0)
    m_i = tl.full([BM], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, L], dtype=tl.float32)
    rn = tl.arange(0, BN)
    for j in range(lo, hi, BN):
        kk = j + rn
        km = kk < hi
        page = tl.load(bt_ptr + b.to(tl.int64) * bt_s0 + kk // bs, mask=km, other=0).to(tl.int64)
        row = page * kv_s0 + (kk % bs).to(tl.int64) * kv_s1
        c = tl.load(kv_ptr + row[:, None] + rl[None, :], mask=km[:, None], other=0.0)
        kp = tl.load(kv_ptr + row[:, None] + L + rr[None, :], mask=km[:, None], other=0.0)
        sc = (tl.dot(qa, tl.trans(c.to(qa.dtype)), input_precision=PREC)
              + tl.dot(qp, tl.trans(kp.to(qp.dtype)), input_precision=PREC))
        sc = tl.where(km[None, :], sc * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        p = tl.exp(sc - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        acc = acc * alpha[:, None] + tl.dot(p.to(qa.dtype), c.to(qa.dtype), input_precision=PREC)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    if SPLIT:
        pbase = (item.to(tl.int64) * NS + s) * BM + rm
        tl.store(pacc_ptr + pbase[:, None] * L + rl[None, :], acc)
        tl.store(pml_ptr + pbase * 2, m_i)
        tl.store(pml_ptr + pbase * 2 + 1, l_i)
    else:
        o = acc / l_i[:, None]
        tl.store(o_ptr + qrow[:, None] * L + rl[None, :], o.to(o_ptr.dtype.element_ty), mask=mrow[:, None])


@triton.jit
def _mla_merge_kernel(o_ptr, pacc_ptr, pml_ptr, Hh, nhb, L: tl.constexpr, BL: tl.constexpr, BM: tl.constexpr,
                      NS: tl.constexpr):
    item = tl.program_id(0)
    t = item // nhb
    hb0 = (item % nhb) * BM
    rm = tl.arange(0, BM)
    rl = tl.program_id(1) * BL + tl.arange(0, BL)
    heads = hb0 + rm
    m_all = tl.full([BM], -1e30, dtype=tl.float32)
    for s in range(NS):
        pbase = (item.to(tl.int64) * NS + s) * BM + rm
        m_all = tl.maximum(m_all, tl.load(pml_ptr + pbase * 2))
    acc = tl.zeros([BM, BL], dtype=tl.float32)
    den = tl.zeros([BM], dtype=tl.float32)
    for s in range(NS):
        pbase = (item.to(tl.int64) * NS + s) * BM + rm
        w = tl.exp(tl.load(pml_ptr + pbase * 2) - m_all)
        acc += tl.load(pacc_ptr + pbase[:, None] * L + rl[None, :]) * w[:, None]
        den += tl.load(pml_ptr + pbase * 2 + 1) * w
    qrow = t.to(tl.int64) * Hh + heads
    tl.store(o_ptr + qrow[:, None] * L + rl[None, :], (acc / den[:, None]).to(o_ptr.dtype.element_ty),
             mask=(heads < Hh)[:, None])


def supported(q_lat, q_pe, kv_cache, kv_lora_rank) -> bool:
    L, R = kv_lora_rank, q_pe.shape[-1]
    dims = all(d >= 16 and (d & (d - 1)) == 0 for d in (L, R)) and L <= 1024
    f64 = any(t.dtype == torch.float64 for t in (q_lat, q_pe, kv_cache))
    return dims and not f64 and kv_cache.stride(-1) == 1


def mla_paged_attention_triton(q_lat, q_pe, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, *,
                               kv_lora_rank, num_splits=None, block_n=64, num_stages=3, min_split_keys=256):
    """Triton implementation of `reference.mla_paged_attention` (same arguments and result).

    Tuning knobs (not part of the op contract): `num_splits` fixes the number of KV splits per item
    (default: enough programs for two waves on 132 SMs, each split >= `min_split_keys` keys of the longest
    possible context, at most 128); `block_n` keys per inner step; `num_stages` software-pipelining depth
    (defaults 64 and 3: the fastest of the four measured on the H200 for 32 heads, B = 1 and B = 32).
    """
    T, Hh, L = q_lat.shape
    R = q_pe.shape[-1]
    if L != kv_lora_rank or kv_cache.shape[-1] != L + R:
        raise ValueError(f"mla: q_lat {tuple(q_lat.shape)}, q_pe {tuple(q_pe.shape)}, cache {tuple(kv_cache.shape)}")
    out = torch.empty(T, Hh, L, dtype=q_lat.dtype, device=q_lat.device)
    if T == 0:
        return out
    dev = q_lat.device
    ql, qp = q_lat.contiguous(), q_pe.contiguous()
    cu = cu_seqlens_q.to(device=dev, dtype=torch.int32)
    tok = torch.arange(T, device=dev, dtype=torch.int32)
    tseq = (torch.searchsorted(cu, tok, right=True) - 1).to(torch.int32)
    BM = 16 if Hh <= 16 else 32
    nhb = triton.cdiv(Hh, BM)
    NI = T * nhb
    bs = kv_cache.shape[1]
    max_ctx = block_tables.shape[1] * bs
    if num_splits is None:
        num_splits = max(1, min(triton.cdiv(264, NI), triton.cdiv(max_ctx, min_split_keys), 128))
    NS = next_pow2(num_splits) if num_splits > 1 else 1
    bt = block_tables.to(dtype=torch.int32)
    sl = seq_lens.to(device=dev, dtype=torch.int32)
    split = NS > 1
    pacc = torch.empty(NI * NS * BM, L, dtype=torch.float32, device=dev) if split else out
    pml = torch.empty(NI * NS * BM, 2, dtype=torch.float32, device=dev) if split else out
    nw = 8
    _mla_split_kernel[(NI, NS)](
        ql, qp, kv_cache, bt, sl, cu, tseq, out, pacc, pml, float(scale), kv_cache.stride(0), kv_cache.stride(1),
        bt.stride(0), Hh, nhb, bs, L=L, R=R, BM=BM, BN=block_n, NS=NS, SPLIT=split, PREC=dot_precision(q_lat.dtype),
        num_warps=nw, num_stages=num_stages,
    )
    if split:
        BL = min(L, 128)
        _mla_merge_kernel[(NI, L // BL)](out, pacc, pml, Hh, nhb, L=L, BL=BL, BM=BM, NS=NS, num_warps=4)
    return out
