"""MoE in Triton: router (sigmoid/softmax, correction bias, grouped top-k) and routed experts as a grouped
GEMM that reads MXFP4-packed (or dense) weights directly, with the activation fused into the first GEMM
and the weighted combine (finalize) fused into the second one (fp32 atomic adds).

Routed pairs (token, k) are sorted by expert on the device; a "block" is up to BM consecutive sorted pairs
of ONE expert, and the grid is static (number of pairs x N tiles; surplus programs exit), so nothing syncs
with the host. Contracts: `k3serve.kernels.reference.moe_route` and `moe_experts`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import dot_precision, next_pow2

BM = 16


@triton.jit
def _moe_route_kernel(lg_ptr, bias_ptr, w_ptr, id_ptr, E, per, topk_group, scaling, lg_stride,
                      TOPK: tl.constexpr, BK: tl.constexpr, BE: tl.constexpr, BG: tl.constexpr,
                      BP: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTMAX: tl.constexpr,
                      GROUPED: tl.constexpr, RENORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    re = tl.arange(0, BE)
    me = re < E
    x = tl.load(lg_ptr + t * lg_stride + re, mask=me, other=float("-inf")).to(tl.float32)
    if SOFTMAX:
        xmax = tl.max(x, axis=0)
        ex = tl.exp(x - xmax)
        ssum = tl.sum(ex, axis=0)
        s = ex / ssum
    else:
        s = tl.sigmoid(x)
    sel = s
    if HAS_BIAS:
        sel = sel + tl.load(bias_ptr + re, mask=me, other=0.0).to(tl.float32)
    sel = tl.where(me, sel, float("-inf"))
    if GROUPED:
        rg = tl.arange(0, BG)
        rp = tl.arange(0, BP)
        idx2 = rg[:, None] * per + rp[None, :]
        m2 = (rg[:, None] * per < E) & (rp[None, :] < per)
        x2 = tl.load(lg_ptr + t * lg_stride + idx2, mask=m2, other=float("-inf")).to(tl.float32)
        if SOFTMAX:
            s2 = tl.exp(x2 - xmax) / ssum
        else:
            s2 = tl.sigmoid(x2)
        if HAS_BIAS:
            s2 = s2 + tl.load(bias_ptr + idx2, mask=m2, other=0.0).to(tl.float32)
        s2 = tl.where(m2, s2, float("-inf"))
        top1 = tl.max(s2, axis=1)
        arg1 = tl.min(tl.where(s2 == top1[:, None], rp[None, :], BP), axis=1)
        top2 = tl.max(tl.where(rp[None, :] == arg1[:, None], float("-inf"), s2), axis=1)
        gs = tl.where(per >= 2, top1 + top2, top1)
        gs = tl.where(rg * per < E, gs, float("-inf"))
        keep = re < 0
        for _j in range(topk_group):
            gm = tl.max(gs, axis=0)
            gi = tl.min(tl.where(gs == gm, rg, BG), axis=0)
            keep = keep | ((re // per) == gi)
            gs = tl.where(rg == gi, float("-inf"), gs)
        sel = tl.where(keep, sel, float("-inf"))
    rk = tl.arange(0, BK)
    wv = tl.zeros([BK], dtype=tl.float32)
    iv = tl.zeros([BK], dtype=tl.int64)
    for j in tl.static_range(TOPK):
        mx = tl.max(sel, axis=0)
        i = tl.min(tl.where(sel == mx, re, BE), axis=0)
        wj = tl.sum(tl.where(re == i, s, 0.0), axis=0)
        wv = tl.where(rk == j, wj, wv)
        iv = tl.where(rk == j, i.to(tl.int64), iv)
        sel = tl.where(re == i, float("-inf"), sel)
    if RENORM:
        wv = wv / tl.sum(wv, axis=0)
    mk = rk < TOPK
    tl.store(w_ptr + t * TOPK + rk, wv * scaling, mask=mk)
    tl.store(id_ptr + t * TOPK + rk, iv, mask=mk)


def moe_route_triton(router_logits, correction_bias, top_k, *, num_expert_group=1, topk_group=1, renormalize=True,
                     routed_scaling_factor=1.0, scoring="sigmoid"):
    """Triton implementation of `reference.moe_route` (same arguments and result)."""
    T, E = router_logits.shape
    if scoring not in ("sigmoid", "softmax"):
        raise ValueError(f"unknown scoring {scoring!r}")
    grouped = num_expert_group > 1
    if grouped and (E % num_expert_group or not 1 <= topk_group <= num_expert_group):
        raise ValueError(f"E={E}, num_expert_group={num_expert_group}, topk_group={topk_group}")
    eligible = E if not grouped else topk_group * (E // num_expert_group)
    if not 1 <= top_k <= eligible:
        raise ValueError(f"top_k={top_k} but only {eligible} experts are eligible")
    dev = router_logits.device
    w = torch.empty(T, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=dev)
    if T == 0:
        return w, ids
    lg = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    per = E // num_expert_group if grouped else E
    G = num_expert_group if grouped else 1
    BE = next_pow2(E)
    _moe_route_kernel[(T,)](
        lg, correction_bias if correction_bias is not None else lg, w, ids, E, per, topk_group,
        float(routed_scaling_factor), lg.stride(0), TOPK=top_k, BK=next_pow2(top_k), BE=BE, BG=next_pow2(G),
        BP=next_pow2(per), HAS_BIAS=correction_bias is not None, SOFTMAX=scoring == "softmax", GROUPED=grouped,
        RENORM=bool(renormalize), num_warps=4 if BE <= 1024 else 8,
    )
    return w, ids


@triton.jit
def _e2m1_bits(c):
    """FP4 E2M1 nibble codes (int32 0..15) -> the fp32 value, built from bits (no transcendental ops).

    Magnitude code (e, m) = (bits 2..1, bit 0): e == 0 -> 0.5·m, else (1 + m/2)·2^(e-1); bit 3 is the sign.
    """
    e = (c >> 1) & 3
    m = c & 1
    bits = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22))
    bits = bits | ((c & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fp4_tile(w_ptr, s_ptr, e, rn, kh, mask, w_e, w_n, s_e, s_n, DT: tl.constexpr):
    """Dequantize MXFP4 weights rows `rn`, packed columns `kh`: (low nibbles, high nibbles) as DT tiles.

    Low nibble of byte j is element 2j, high nibble element 2j+1; scale byte (2j)//32 = j//16 applies
    (value 2^(s-127), built as the fp32 with exponent field s; s = 0 gives 0).
    """
    b = tl.load(w_ptr + e * w_e + rn[:, None] * w_n + kh[None, :], mask=mask, other=0).to(tl.int32)
    sc = tl.load(s_ptr + e * s_e + rn[:, None] * s_n + (kh // 16)[None, :], mask=mask, other=127).to(tl.int32)
    mult = (sc << 23).to(tl.float32, bitcast=True)
    lo_v = _e2m1_bits(b & 15) * mult
    hi_v = _e2m1_bits(b >> 4) * mult
    return lo_v.to(DT), hi_v.to(DT)


@triton.jit
def _block_rows(sid_ptr, order_ptr, start_ptr, blk, P, TOPK):
    st = tl.load(start_ptr + blk)
    st_c = tl.maximum(st, 0)
    e = tl.load(sid_ptr + st_c).to(tl.int64)
    r = st_c + tl.arange(0, 16)
    rm = (r < P) & (st >= 0)
    ids_r = tl.load(sid_ptr + r, mask=rm, other=-1)
    rm = rm & (ids_r == e)
    pair = tl.load(order_ptr + r, mask=rm, other=0).to(tl.int64)
    return st, e, r, rm, pair, pair // TOPK


@triton.jit
def _gemm_rows(x_ptr, x_stride, rows, rm, w_ptr, s_ptr, e, rn, mn, rn2, KIN, w_e, w_n, s_e, s_n,
               BN: tl.constexpr, BK: tl.constexpr, FP4: tl.constexpr, PREC: tl.constexpr, TWO: tl.constexpr):
    """acc[BM, BN] = x[rows, :KIN] @ W_e[rn, :KIN]ᵀ (and, if TWO, acc2 for rows rn2) with W dense or MXFP4.

    Both weight row sets stream in the same K loop, so their loads are in flight together.
    """
    acc = tl.zeros([16, BN], dtype=tl.float32)
    acc2 = tl.zeros([16, BN], dtype=tl.float32)
    DT = x_ptr.dtype.element_ty
    if FP4:
        rkh = tl.arange(0, BK // 2)
        for k0 in range(0, KIN, BK):
            kh = k0 // 2 + rkh
            km = kh < KIN // 2
            xm = rm[:, None] & km[None, :]
            xe = tl.load(x_ptr + rows[:, None] * x_stride + 2 * kh[None, :], mask=xm, other=0.0)
            xo = tl.load(x_ptr + rows[:, None] * x_stride + 2 * kh[None, :] + 1, mask=xm, other=0.0)
            lo, hi = _fp4_tile(w_ptr, s_ptr, e, rn, kh, mn[:, None] & km[None, :], w_e, w_n, s_e, s_n, DT)
            if TWO:
                lo2, hi2 = _fp4_tile(w_ptr, s_ptr, e, rn2, kh, mn[:, None] & km[None, :], w_e, w_n, s_e, s_n, DT)
                acc2 += tl.dot(xe, tl.trans(lo2), input_precision=PREC)
                acc2 += tl.dot(xo, tl.trans(hi2), input_precision=PREC)
            acc += tl.dot(xe, tl.trans(lo), input_precision=PREC)
            acc += tl.dot(xo, tl.trans(hi), input_precision=PREC)
    else:
        rk = tl.arange(0, BK)
        for k0 in range(0, KIN, BK):
            kk = k0 + rk
            km = kk < KIN
            xt = tl.load(x_ptr + rows[:, None] * x_stride + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
            wt = tl.load(w_ptr + e * w_e + rn[:, None] * w_n + kk[None, :], mask=mn[:, None] & km[None, :], other=0.0)
            if TWO:
                wt2 = tl.load(w_ptr + e * w_e + rn2[:, None] * w_n + kk[None, :], mask=mn[:, None] & km[None, :],
                              other=0.0)
                acc2 += tl.dot(xt, tl.trans(wt2.to(DT)), input_precision=PREC)
            acc += tl.dot(xt, tl.trans(wt.to(DT)), input_precision=PREC)
    return acc, acc2


@triton.jit
def _moe_gemm1_kernel(z_ptr, sid_ptr, order_ptr, start_ptr, w_ptr, s_ptr, h_ptr, P, DIN, I, TOPK, z_stride,
                      w_e, w_n, s_e, s_n, situ_beta, lin_beta, BN: tl.constexpr, BK: tl.constexpr,
                      FP4: tl.constexpr, SITU: tl.constexpr, HAS_LIN: tl.constexpr, PREC: tl.constexpr):
    blk = tl.program_id(0)
    nt = tl.program_id(1)
    st, e, r, rm, pair, tok = _block_rows(sid_ptr, order_ptr, start_ptr, blk, P, TOPK)
    if st >= 0:
        rn = nt * BN + tl.arange(0, BN)
        mn = rn < I
        g, u = _gemm_rows(z_ptr, z_stride, tok, rm, w_ptr, s_ptr, e, rn, mn, rn + I, DIN, w_e, w_n, s_e, s_n, BN, BK,
                          FP4, PREC, True)
        if SITU:
            g = situ_beta * (2.0 * tl.sigmoid(2.0 * g / situ_beta) - 1.0) * tl.sigmoid(g)
            if HAS_LIN:
                u = lin_beta * (2.0 * tl.sigmoid(2.0 * u / lin_beta) - 1.0)
        else:
            g = g * tl.sigmoid(g)
        tl.store(h_ptr + r.to(tl.int64)[:, None] * I + rn[None, :], (g * u).to(h_ptr.dtype.element_ty),
                 mask=rm[:, None] & mn[None, :])


@triton.jit
def _moe_gemm2_kernel(h_ptr, sid_ptr, order_ptr, start_ptr, w_ptr, s_ptr, tw_ptr, out_ptr, P, I, DOUT, TOPK,
                      w_e, w_n, s_e, s_n, BN: tl.constexpr, BK: tl.constexpr, FP4: tl.constexpr,
                      PREC: tl.constexpr):
    blk = tl.program_id(0)
    nt = tl.program_id(1)
    st, e, r, rm, pair, tok = _block_rows(sid_ptr, order_ptr, start_ptr, blk, P, TOPK)
    if st >= 0:
        rn = nt * BN + tl.arange(0, BN)
        mn = rn < DOUT
        acc, _ = _gemm_rows(h_ptr, I, r.to(tl.int64), rm, w_ptr, s_ptr, e, rn, mn, rn, I, w_e, w_n, s_e, s_n, BN,
                            BK, FP4, PREC, False)
        wt = tl.load(tw_ptr + pair, mask=rm, other=0.0).to(tl.float32)
        tl.atomic_add(out_ptr + tok[:, None] * DOUT + rn[None, :], acc * wt[:, None], mask=rm[:, None] & mn[None, :])


def route_blocks(topk_ids: torch.Tensor, E: int):
    """Sort routed pairs by expert and cut them into blocks of <= 16 pairs of one expert, on the device.

    Returns (sorted expert ids int32 [P] (invalid ids sorted last as E), pair order int32 [P] (pair = t*k + j),
    block starts int32 [P] (position of each block's first pair, -1 past the last block)).
    """
    P = topk_ids.numel()
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).to(torch.int64)
    ids = torch.where(ids >= 0, ids, torch.full_like(ids, E))
    sid, order = torch.sort(ids)
    pos = torch.arange(P, device=dev)
    new = torch.ones(P, dtype=torch.bool, device=dev)
    new[1:] = sid[1:] != sid[:-1]
    first = torch.cummax(torch.where(new, pos, torch.zeros_like(pos)), 0).values
    is_start = ((pos - first) % BM == 0) & (sid < E)
    bidx = torch.cumsum(is_start.to(torch.int64), 0) - 1
    starts = torch.full((P + 1,), -1, dtype=torch.int64, device=dev)
    starts.scatter_(0, torch.where(is_start, bidx, torch.full_like(bidx, P)), pos)
    return sid.to(torch.int32), order.to(torch.int32), starts[:P].to(torch.int32)


def _weights(dense, packed, scale, what):
    if dense is not None:
        return dense, dense, False
    if packed is None or scale is None:
        raise ValueError(f"moe_experts: give {what} or both {what}_packed and {what}_scale")
    return packed, scale, True


def supported(z, w13, w2) -> bool:
    return z.dtype != torch.float64 and all(w is None or w.dtype != torch.float64 for w in (w13, w2))


def moe_experts_triton(z, topk_weights, topk_ids, *, w13=None, w2=None, w13_packed=None, w13_scale=None,
                       w2_packed=None, w2_scale=None, activation="situ", situ_beta=4.0, situ_linear_beta=None):
    """Triton implementation of `reference.moe_experts` (same arguments and result)."""
    if activation not in ("situ", "silu"):
        raise ValueError(f"unknown activation {activation!r}")
    W1, S1, fp4_1 = _weights(w13, w13_packed, w13_scale, "w13")
    W2, S2, fp4_2 = _weights(w2, w2_packed, w2_scale, "w2")
    T, DIN = z.shape
    E = W1.shape[0]
    I = W1.shape[1] // 2
    DOUT = W2.shape[1]
    TOPK = topk_ids.shape[1]
    P = T * TOPK
    dev = z.device
    out = torch.zeros(T, DOUT, dtype=torch.float32, device=dev)
    if P == 0:
        return out.to(z.dtype)
    zc = z.contiguous()
    W1, S1, W2, S2 = (t.contiguous() for t in (W1, S1, W2, S2))
    sid, order, starts = route_blocks(topk_ids, E)
    hdt = zc.dtype
    h = torch.empty(P, I, dtype=hdt, device=dev)
    prec = dot_precision(zc.dtype)
    BN1 = min(32, max(16, next_pow2(I)))
    _moe_gemm1_kernel[(P, triton.cdiv(I, BN1))](
        zc, sid, order, starts, W1, S1, h, P, DIN, I, TOPK, zc.stride(0), W1.stride(0), W1.stride(1),
        S1.stride(0) if fp4_1 else 0, S1.stride(1) if fp4_1 else 0, float(4.0 if situ_beta is None else situ_beta),
        float(situ_linear_beta or 1.0), BN=BN1, BK=128 if DIN >= 128 else max(32, next_pow2(DIN)), FP4=fp4_1,
        SITU=activation == "situ", HAS_LIN=situ_linear_beta is not None, PREC=prec, num_warps=8,
    )
    BN2 = min(32, max(16, next_pow2(DOUT)))
    tw = topk_weights.reshape(-1).contiguous()
    _moe_gemm2_kernel[(P, triton.cdiv(DOUT, BN2))](
        h, sid, order, starts, W2, S2, tw, out, P, I, DOUT, TOPK, W2.stride(0), W2.stride(1),
        S2.stride(0) if fp4_2 else 0, S2.stride(1) if fp4_2 else 0, BN=BN2,
        BK=128 if I >= 128 else max(32, next_pow2(I)), FP4=fp4_2, PREC=prec, num_warps=8,
    )
    return out.to(z.dtype)
