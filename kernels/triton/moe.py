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
from .moe_route import MAX_PAIRS as route_blocks_triton_max_pairs
from .moe_route import route_blocks_sorted, route_blocks_triton

BM = 16


@triton.jit
def _moe_route_kernel(lg_ptr, bias_ptr, w_ptr, id_ptr, E, per, topk_group, scaling, lg_stride,
                      TOPK: tl.constexpr, BK: tl.constexpr, BE: tl.constexpr, BG: tl.constexpr,
                      BP: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTMAX: tl.constexpr,
                      GROUPED: tl.constexpr, RENORM: tl.constexpr, NX: tl.constexpr = 0, BX: tl.constexpr = 1):
    """One token per program: scores, (grouped) top-k, weights; NX > 0 appends NX columns (ids E..E+NX-1, weight 1:
    the shared experts, see `reference.moe_route`), so a row of the outputs is TOPK + NX long."""
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
    tl.store(w_ptr + t * (TOPK + NX) + rk, wv * scaling, mask=mk)
    tl.store(id_ptr + t * (TOPK + NX) + rk, iv, mask=mk)
    if NX > 0:
        rx = tl.arange(0, BX)
        mx = rx < NX
        tl.store(w_ptr + t * (TOPK + NX) + TOPK + rx, tl.full([BX], 1.0, tl.float32), mask=mx)
        tl.store(id_ptr + t * (TOPK + NX) + TOPK + rx, (E + rx).to(tl.int64), mask=mx)


def moe_route_triton(router_logits, correction_bias, top_k, *, num_expert_group=1, topk_group=1, renormalize=True,
                     routed_scaling_factor=1.0, scoring="sigmoid", shared_experts=0):
    """Triton implementation of `reference.moe_route` (same arguments and result)."""
    if shared_experts < 0:
        raise ValueError(f"shared_experts must be >= 0, got {shared_experts}")
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
    w = torch.empty(T, top_k + shared_experts, dtype=torch.float32, device=dev)
    ids = torch.empty(T, top_k + shared_experts, dtype=torch.int64, device=dev)
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
        RENORM=bool(renormalize), NX=shared_experts, BX=next_pow2(max(2, shared_experts)),
        num_warps=4 if BE <= 1024 else 8,
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
def _mxfp4_to_dense_kernel(w_ptr, s_ptr, out_ptr, R, KH, BR: tl.constexpr, BKH: tl.constexpr):
    """Rows [BR] x packed columns [BKH] of MXFP4 weights (flattened to R rows of KH bytes) -> 2*BKH values per
    row of the 16-bit `out` [R, 2*KH], the same values the fused kernels decode (`_fp4_tile`)."""
    rn = tl.program_id(0) * BR + tl.arange(0, BR)
    kh = tl.program_id(1) * BKH + tl.arange(0, BKH)
    m = (rn < R)[:, None] & (kh < KH)[None, :]
    lo, hi = _fp4_tile(w_ptr, s_ptr, 0, rn.to(tl.int64), kh, m, 0, KH, 0, KH // 16, out_ptr.dtype.element_ty)
    v = tl.reshape(tl.join(lo, hi), [BR, 2 * BKH])  # element 2j (low nibble) then 2j+1 (high)
    kk = tl.program_id(1) * 2 * BKH + tl.arange(0, 2 * BKH)
    tl.store(out_ptr + rn.to(tl.int64)[:, None] * (2 * KH) + kk[None, :], v,
             mask=(rn < R)[:, None] & (kk < 2 * KH)[None, :])


@triton.jit
def _block_rows(sid_ptr, order_ptr, start_ptr, blk, P, TOPK, BMR: tl.constexpr):
    st = tl.load(start_ptr + blk)
    st_c = tl.maximum(st, 0)
    e = tl.load(sid_ptr + st_c).to(tl.int64)
    r = st_c + tl.arange(0, BMR)
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
def _gated_act(g, u, situ_beta, lin_beta, SITU: tl.constexpr, HAS_LIN: tl.constexpr):
    """The experts' activation on the gate/up halves: (SiTU(g), optionally SiTU-linear(u)) or (SiLU(g), u)."""
    if SITU:
        g = situ_beta * (2.0 * tl.sigmoid(2.0 * g / situ_beta) - 1.0) * tl.sigmoid(g)
        if HAS_LIN:
            u = lin_beta * (2.0 * tl.sigmoid(2.0 * u / lin_beta) - 1.0)
    else:
        g = g * tl.sigmoid(g)
    return g, u


@triton.jit
def _moe_gemm1_kernel(z_ptr, sid_ptr, order_ptr, start_ptr, w_ptr, s_ptr, h_ptr, P, DIN, I, TOPK, z_stride,
                      w_e, w_n, s_e, s_n, situ_beta, lin_beta, BN: tl.constexpr, BK: tl.constexpr,
                      FP4: tl.constexpr, SITU: tl.constexpr, HAS_LIN: tl.constexpr, PREC: tl.constexpr):
    blk = tl.program_id(0)
    nt = tl.program_id(1)
    st, e, r, rm, pair, tok = _block_rows(sid_ptr, order_ptr, start_ptr, blk, P, TOPK, 16)
    if st >= 0:
        rn = nt * BN + tl.arange(0, BN)
        mn = rn < I
        g, u = _gemm_rows(z_ptr, z_stride, tok, rm, w_ptr, s_ptr, e, rn, mn, rn + I, DIN, w_e, w_n, s_e, s_n, BN, BK,
                          FP4, PREC, True)
        g, u = _gated_act(g, u, situ_beta, lin_beta, SITU, HAS_LIN)
        tl.store(h_ptr + r.to(tl.int64)[:, None] * I + rn[None, :], (g * u).to(h_ptr.dtype.element_ty),
                 mask=rm[:, None] & mn[None, :])


@triton.jit
def _moe_gemm2_kernel(h_ptr, sid_ptr, order_ptr, start_ptr, w_ptr, s_ptr, tw_ptr, out_ptr, P, I, DOUT, TOPK,
                      w_e, w_n, s_e, s_n, BN: tl.constexpr, BK: tl.constexpr, FP4: tl.constexpr,
                      PREC: tl.constexpr):
    blk = tl.program_id(0)
    nt = tl.program_id(1)
    st, e, r, rm, pair, tok = _block_rows(sid_ptr, order_ptr, start_ptr, blk, P, TOPK, 16)
    if st >= 0:
        rn = nt * BN + tl.arange(0, BN)
        mn = rn < DOUT
        acc, _ = _gemm_rows(h_ptr, I, r.to(tl.int64), rm, w_ptr, s_ptr, e, rn, mn, rn, I, w_e, w_n, s_e, s_n, BN,
                            BK, FP4, PREC, False)
        wt = tl.load(tw_ptr + pair, mask=rm, other=0.0).to(tl.float32)
        tl.atomic_add(out_ptr + tok[:, None] * DOUT + rn[None, :], acc * wt[:, None], mask=rm[:, None] & mn[None, :])


# ------------------------------------------------------------------ lean MXFP4 decode
# The packed weights are read as int32 words (8 nibbles = elements 8j..8j+7 of word j, element 8j+i in
# bits 4i..4i+3); a group of 32 elements (one e8m0 scale) is 4 consecutive words. One nibble decodes with
# 3 integer ops: shift it to the top, arithmetic-shift right by 6 (the sign lands in bit 31 and fills 25..30,
# the 3 magnitude bits land in 22..24), mask. Read as fp32 that is exactly value·2^-126 (code ±0.5, the
# only one with exponent bits 00, is an fp32 denormal; the kernels compile without flush-to-zero).
# The missing 2^126·2^(s-127) is multiplied in as powers of two, so every step is exact:
# * "gemv" (fp32 FMAs on the decoded values): x carries 2^64 (x·2^64, exact for |x| < 2^64; gemm1 stores h
#   pre-multiplied) and each group's partial sum gets 2^(s-65) = bits (s + 62) << 23 (s <= 192). Products
#   stay normal fp32 while |x·w| >= ~2^-64.
# * "dot" (bf16/fp32 tl.dot operands): value·2^(s-127)·2^-32 = decoded · bits((s + 94) << 23) (s <= 160), a
#   normal number for any realistic weight; the accumulator is multiplied by 2^32 at the end (products
#   underflow only below |x·w| ~ 2^-94).
X_SCALE: tl.constexpr = tl.constexpr(18446744073709551616.0)  # 2^64 ("gemv")
DOT_SCALE: tl.constexpr = tl.constexpr(4294967296.0)  # 2^32 ("dot")
_DN_MASK: tl.constexpr = tl.constexpr(0x81C00000 - (1 << 32))  # sign bit + 3 magnitude bits, as an int32


@triton.jit
def _dn(wd, i: tl.constexpr):
    """Nibble i of int32 words (element 8j+i of word j) -> fp32 value·2^-126 (see the comment above)."""
    return (((wd << (28 - 4 * i)) >> 6) & _DN_MASK).to(tl.float32, bitcast=True)


@triton.jit
def _group_factor(s, B: tl.constexpr):
    """e8m0 scale bytes (int32) -> 2^(s-127)·2^(B-1) as fp32: B = 62 for "gemv", 94 for "dot" (see above)."""
    return ((s + B) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _gemv_rows(x_ptr, w_ptr, s_ptr, e, rn, mn, KIN, w_e, w_n, s_e, s_n, BN: tl.constexpr, BK: tl.constexpr,
               FP4: tl.constexpr, X_MUL: tl.constexpr, TWO: tl.constexpr, ROW2):
    """y[BN] = W_e[rn, :KIN] · x (and, if TWO, y2 for rows rn + ROW2), one activation row x, fp32 FMAs.

    MXFP4: `w_ptr` is the packed weight as int32 words (row stride w_n words); tiles are [G groups, BN rows,
    4 words] so a lane owns whole groups (one scale each) and its rows share its x values; nibble i of
    every word is one FMA pass. x is multiplied by X_MUL (2^64, or 1 when stored pre-multiplied).
    Dense: plain [BN, BK] tiles.
    """
    if FP4:
        G: tl.constexpr = BK // 32
        rg = tl.arange(0, G)
        rw = tl.arange(0, 4)
        acc = tl.zeros([G, BN], dtype=tl.float32)
        acc2 = tl.zeros([G, BN], dtype=tl.float32)
        NG = KIN // 32
        for k0 in range(0, NG, G):
            gi = k0 + rg
            gm = gi < NG
            wi = gi[:, None] * 4 + rw[None, :]
            m2 = gm[:, None] & mn[None, :]
            woff = e * w_e + rn[None, :, None] * w_n + wi[:, None, :]
            soff = e * s_e + rn[None, :] * s_n + gi[:, None]
            wd = tl.load(w_ptr + woff, mask=m2[:, :, None], other=0)
            f = _group_factor(tl.load(s_ptr + soff, mask=m2, other=0).to(tl.int32), 62)
            part = tl.zeros([G, BN, 4], dtype=tl.float32)
            if TWO:
                wd2 = tl.load(w_ptr + woff + ROW2 * w_n, mask=m2[:, :, None], other=0)
                f2 = _group_factor(tl.load(s_ptr + soff + ROW2 * s_n, mask=m2, other=0).to(tl.int32), 62)
                part2 = tl.zeros([G, BN, 4], dtype=tl.float32)
            for i in tl.static_range(8):
                xi = tl.load(x_ptr + wi * 8 + i, mask=gm[:, None], other=0.0).to(tl.float32)
                if X_MUL != 1.0:
                    xi = xi * X_MUL
                part += _dn(wd, i) * xi[:, None, :]
                if TWO:
                    part2 += _dn(wd2, i) * xi[:, None, :]
            acc += tl.sum(part, axis=2) * f
            if TWO:
                acc2 += tl.sum(part2, axis=2) * f2
        return tl.sum(acc, axis=0), tl.sum(acc2, axis=0)
    else:
        rk = tl.arange(0, BK)
        acc = tl.zeros([BN, BK], dtype=tl.float32)
        acc2 = tl.zeros([BN, BK], dtype=tl.float32)
        for k0 in range(0, KIN, BK):
            kk = k0 + rk
            km = kk < KIN
            x = tl.load(x_ptr + kk, mask=km, other=0.0).to(tl.float32)
            m2 = mn[:, None] & km[None, :]
            woff = e * w_e + rn[:, None] * w_n + kk[None, :]
            acc += tl.load(w_ptr + woff, mask=m2, other=0.0).to(tl.float32) * x[None, :]
            if TWO:
                acc2 += tl.load(w_ptr + woff + ROW2 * w_n, mask=m2, other=0.0).to(tl.float32) * x[None, :]
        return tl.sum(acc, axis=1), tl.sum(acc2, axis=1)


@triton.jit
def _moe_gemv1_kernel(z_ptr, ids_ptr, w_ptr, s_ptr, h_ptr, out_ptr, DIN, I, DOUT, TOPK, z_stride, w_e, w_n, s_e, s_n,
                      situ_beta, lin_beta, h_mult, BN: tl.constexpr, BK: tl.constexpr, FP4: tl.constexpr,
                      SITU: tl.constexpr, HAS_LIN: tl.constexpr, ZB: tl.constexpr):
    """Decode path, gate/up: one routed pair (token, k) x one tile of BN rows of I per program (no sorting).

    h[pair, rn] = act(gate)·up (times h_mult: 2^64 when the down GEMM decodes MXFP4, see X_SCALE).
    ZB > 0: the programs of each token's first pair also zero its row of the down GEMM's fp32 accumulator
    `out` [T, DOUT], ZB elements per tile (tiles x ZB >= DOUT), so the atomic combine needs no fill kernel.
    """
    pr = tl.program_id(0)
    nt = tl.program_id(1)
    if ZB > 0:
        if pr % TOPK == 0:
            rz = nt * ZB + tl.arange(0, ZB)
            tl.store(out_ptr + (pr // TOPK).to(tl.int64) * DOUT + rz, tl.zeros([ZB], tl.float32), mask=rz < DOUT)
    e = tl.load(ids_ptr + pr)
    if e >= 0:
        tok = (pr // TOPK).to(tl.int64)
        rn = nt * BN + tl.arange(0, BN)
        mn = rn < I
        g, u = _gemv_rows(z_ptr + tok * z_stride, w_ptr, s_ptr, e, rn, mn, DIN, w_e, w_n, s_e, s_n, BN, BK, FP4,
                          X_SCALE if FP4 else 1.0, True, I)
        g, u = _gated_act(g, u, situ_beta, lin_beta, SITU, HAS_LIN)
        tl.store(h_ptr + pr.to(tl.int64) * I + rn, (g * u * h_mult).to(h_ptr.dtype.element_ty), mask=mn)


@triton.jit
def _moe_gemv2_kernel(h_ptr, ids_ptr, w_ptr, s_ptr, tw_ptr, out_ptr, I, DOUT, TOPK: tl.constexpr, w_e, w_n, s_e,
                      s_n, BN: tl.constexpr, BK: tl.constexpr, FP4: tl.constexpr, LOOP: tl.constexpr):
    """Decode path, down GEMM + combine. LOOP=0 ("atomic"): one pair x one tile of DOUT per program, fp32 atomic
    adds into out. LOOP=1 ("loop"): one token x one tile per program, its TOPK pairs summed in registers and
    stored once (out in the activation dtype, no zero fill, no atomics). LOOP=2 ("unroll"): like 1, with the
    TOPK pairs unrolled and branch-free (an invalid pair's rows masked, its term selected away), so the loads of
    all pairs can be in flight together."""
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mn = rn < DOUT
    if LOOP == 2:
        tok = tl.program_id(0).to(tl.int64)
        acc = tl.zeros([BN], dtype=tl.float32)
        for j in tl.static_range(TOPK):
            pr = tok * TOPK + j
            e = tl.load(ids_ptr + pr)
            ok = e >= 0
            y, _ = _gemv_rows(h_ptr + pr * I, w_ptr, s_ptr, tl.maximum(e, 0), rn, mn & ok, I, w_e, w_n, s_e, s_n, BN,
                              BK, FP4, 1.0, False, 0)
            acc += tl.where(ok, y * tl.load(tw_ptr + pr).to(tl.float32), 0.0)
        tl.store(out_ptr + tok * DOUT + rn, acc.to(out_ptr.dtype.element_ty), mask=mn)
    elif LOOP == 1:
        tok = tl.program_id(0).to(tl.int64)
        acc = tl.zeros([BN], dtype=tl.float32)
        for j in range(TOPK):
            pr = tok * TOPK + j
            e = tl.load(ids_ptr + pr)
            if e >= 0:
                y, _ = _gemv_rows(h_ptr + pr * I, w_ptr, s_ptr, e, rn, mn, I, w_e, w_n, s_e, s_n, BN, BK, FP4,
                                  1.0, False, 0)
                acc += y * tl.load(tw_ptr + pr).to(tl.float32)
        tl.store(out_ptr + tok * DOUT + rn, acc.to(out_ptr.dtype.element_ty), mask=mn)
    else:
        pr = tl.program_id(0).to(tl.int64)
        e = tl.load(ids_ptr + pr)
        if e >= 0:
            y, _ = _gemv_rows(h_ptr + pr * I, w_ptr, s_ptr, e, rn, mn, I, w_e, w_n, s_e, s_n, BN, BK, FP4, 1.0,
                              False, 0)
            tl.atomic_add(out_ptr + (pr // TOPK) * DOUT + rn, y * tl.load(tw_ptr + pr).to(tl.float32), mask=mn)


@triton.jit
def _dot_rows(x_ptr, x_stride, rows, rm, w_ptr, s_ptr, e, rn, mn, KIN, w_e, w_n, s_e, s_n, BN: tl.constexpr,
              BK: tl.constexpr, FP4: tl.constexpr, PREC: tl.constexpr, TWO: tl.constexpr, ROW2, BMR: tl.constexpr):
    """Like `_gemm_rows` (acc[BMR, BN] = x[rows] @ W_e[rn]ᵀ, and acc2 for rows rn + ROW2 if TWO), with the lean
    MXFP4 decode: int32 words [BN, G, 4]; nibble i of every word forms the K = BK/8 operand of one tl.dot
    (x gathered with stride 8 to match). The operand is value·2^(s-127)·2^-32 (`_group_factor`), so the
    result is multiplied by 2^32 at the end."""
    acc = tl.zeros([BMR, BN], dtype=tl.float32)
    acc2 = tl.zeros([BMR, BN], dtype=tl.float32)
    DT = x_ptr.dtype.element_ty
    # 64-row blocks (DOT_BM_LARGE): the decoded weights (in registers) as the dot's A operand, accᵀ[BN, BMR] =
    # W·xᵀ, transposed at the end (sm_90 rejects the decoded tile as a wgmma B operand: "Illegal shared layout")
    TR: tl.constexpr = BMR >= 64
    acc_t = tl.zeros([BN, BMR], dtype=tl.float32)
    acc2_t = tl.zeros([BN, BMR], dtype=tl.float32)
    if FP4:
        G: tl.constexpr = BK // 32
        W: tl.constexpr = BK // 8
        rg = tl.arange(0, G)
        rw = tl.arange(0, 4)
        rj = tl.arange(0, W)
        NG = KIN // 32
        for k0 in range(0, NG, G):
            gi = k0 + rg
            gm = gi < NG
            wi = gi[:, None] * 4 + rw[None, :]
            m2 = mn[:, None] & gm[None, :]
            woff = e * w_e + rn[:, None, None] * w_n + wi[None, :, :]
            soff = e * s_e + rn[:, None] * s_n + gi[None, :]
            wd = tl.load(w_ptr + woff, mask=m2[:, :, None], other=0)
            f = _group_factor(tl.load(s_ptr + soff, mask=m2, other=0).to(tl.int32), 94)[:, :, None]
            if TWO:
                wd2 = tl.load(w_ptr + woff + ROW2 * w_n, mask=m2[:, :, None], other=0)
                f2 = _group_factor(tl.load(s_ptr + soff + ROW2 * s_n, mask=m2, other=0).to(tl.int32),
                                   94)[:, :, None]
            kj = k0 * 4 + rj
            xm = rm[:, None] & (kj < NG * 4)[None, :]
            for i in tl.static_range(8):
                xi = tl.load(x_ptr + rows[:, None] * x_stride + kj[None, :] * 8 + i, mask=xm, other=0.0)
                vi = tl.reshape((_dn(wd, i) * f).to(DT), [BN, W])
                if TR:
                    acc_t = tl.dot(vi, tl.trans(xi), acc_t, input_precision=PREC)
                else:
                    acc = tl.dot(xi, tl.trans(vi), acc, input_precision=PREC)
                if TWO:
                    vi2 = tl.reshape((_dn(wd2, i) * f2).to(DT), [BN, W])
                    if TR:
                        acc2_t = tl.dot(vi2, tl.trans(xi), acc2_t, input_precision=PREC)
                    else:
                        acc2 = tl.dot(xi, tl.trans(vi2), acc2, input_precision=PREC)
        if TR:
            acc = tl.trans(acc_t)
            acc2 = tl.trans(acc2_t)
        acc = acc * DOT_SCALE
        acc2 = acc2 * DOT_SCALE
    else:
        rk = tl.arange(0, BK)
        for k0 in range(0, KIN, BK):
            kk = k0 + rk
            km = kk < KIN
            xt = tl.load(x_ptr + rows[:, None] * x_stride + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
            wt = tl.load(w_ptr + e * w_e + rn[:, None] * w_n + kk[None, :], mask=mn[:, None] & km[None, :], other=0.0)
            if TWO:
                wt2 = tl.load(w_ptr + e * w_e + (rn + ROW2)[:, None] * w_n + kk[None, :],
                              mask=mn[:, None] & km[None, :], other=0.0)
                acc2 += tl.dot(xt, tl.trans(wt2.to(DT)), input_precision=PREC)
            acc += tl.dot(xt, tl.trans(wt.to(DT)), input_precision=PREC)
    return acc, acc2


@triton.jit
def _moe_dot1_kernel(z_ptr, sid_ptr, order_ptr, start_ptr, nblk_ptr, w_ptr, s_ptr, h_ptr, out_ptr, P, DIN, I, TOPK,
                     z_stride, w_e, w_n, s_e, s_n, situ_beta, lin_beta, NZ, BN: tl.constexpr, BK: tl.constexpr,
                     FP4: tl.constexpr, SITU: tl.constexpr, HAS_LIN: tl.constexpr, PREC: tl.constexpr,
                     ZB: tl.constexpr, BMR: tl.constexpr):
    """Gate/up GEMM over sorted blocks, persistent: work items (block, N tile) up to the device-side block
    count, so no program is launched for a block that does not exist (graph-safe: the grid is static).
    ZB > 0: the programs first zero the down GEMM's fp32 accumulator `out` (NZ = T x DOUT elements, ZB at a time,
    strided over the programs), so the atomic combine needs no fill kernel."""
    if ZB > 0:
        for z0 in range(tl.program_id(0) * ZB, NZ, tl.num_programs(0) * ZB):
            rz = z0 + tl.arange(0, ZB)
            tl.store(out_ptr + rz, tl.zeros([ZB], tl.float32), mask=rz < NZ)
    NT = tl.cdiv(I, BN)
    nblk = tl.load(nblk_ptr)
    for w in range(tl.program_id(0), nblk * NT, tl.num_programs(0)):
        blk = w % nblk
        nt = w // nblk
        st, e, r, rm, pair, tok = _block_rows(sid_ptr, order_ptr, start_ptr, blk, P, TOPK, BMR)
        rn = nt * BN + tl.arange(0, BN)
        mn = rn < I
        g, u = _dot_rows(z_ptr, z_stride, tok, rm, w_ptr, s_ptr, e, rn, mn, DIN, w_e, w_n, s_e, s_n, BN, BK, FP4,
                         PREC, True, I, BMR)
        g, u = _gated_act(g, u, situ_beta, lin_beta, SITU, HAS_LIN)
        tl.store(h_ptr + r.to(tl.int64)[:, None] * I + rn[None, :], (g * u).to(h_ptr.dtype.element_ty),
                 mask=rm[:, None] & mn[None, :])


@triton.jit
def _moe_dot2_kernel(h_ptr, sid_ptr, order_ptr, start_ptr, nblk_ptr, w_ptr, s_ptr, tw_ptr, out_ptr, P, I, DOUT,
                     TOPK, w_e, w_n, s_e, s_n, BN: tl.constexpr, BK: tl.constexpr, FP4: tl.constexpr,
                     PREC: tl.constexpr, BMR: tl.constexpr, PER_PAIR: tl.constexpr = False):
    """Down GEMM + weighted combine (fp32 atomic adds into out [T, DOUT]) over sorted blocks, persistent like
    `_moe_dot1_kernel`; PER_PAIR: each pair's weighted row stored to out [P, DOUT] instead (no atomics), summed
    per token afterwards by `_moe_pair_sum_kernel`."""
    NT = tl.cdiv(DOUT, BN)
    nblk = tl.load(nblk_ptr)
    for w in range(tl.program_id(0), nblk * NT, tl.num_programs(0)):
        blk = w % nblk
        nt = w // nblk
        st, e, r, rm, pair, tok = _block_rows(sid_ptr, order_ptr, start_ptr, blk, P, TOPK, BMR)
        rn = nt * BN + tl.arange(0, BN)
        mn = rn < DOUT
        acc, _ = _dot_rows(h_ptr, I, r.to(tl.int64), rm, w_ptr, s_ptr, e, rn, mn, I, w_e, w_n, s_e, s_n, BN, BK,
                           FP4, PREC, False, 0, BMR)
        wt = tl.load(tw_ptr + pair, mask=rm, other=0.0).to(tl.float32)
        if PER_PAIR:
            tl.store(out_ptr + pair[:, None] * DOUT + rn[None, :], acc * wt[:, None], mask=rm[:, None] & mn[None, :])
        else:
            tl.atomic_add(out_ptr + tok[:, None] * DOUT + rn[None, :], acc * wt[:, None],
                          mask=rm[:, None] & mn[None, :])


@triton.jit
def _moe_pair_sum_kernel(y_ptr, ids_ptr, out_ptr, DOUT, TOPK: tl.constexpr, BN: tl.constexpr):
    """out[t] = the sum of y[t * TOPK + j] over token t's valid pairs (expert id >= 0: the others were never
    written), in fp32 in pair order, stored in out's dtype."""
    t = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mn = rn < DOUT
    acc = tl.zeros([BN], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        ok = tl.load(ids_ptr + t * TOPK + j) >= 0
        acc += tl.load(y_ptr + (t * TOPK + j) * DOUT + rn, mask=mn & ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * DOUT + rn, acc.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mn)


ROUTE_KERNEL = True
"""Up to `moe_route.MAX_PAIRS` routed pairs, `route_blocks` runs the one-program Triton kernel
(kernels/triton/moe_route.py) instead of PyTorch's sort/scan/scatter (False: always PyTorch, for comparisons)."""
ROUTE_SORTED = True
"""Above `moe_route.MAX_PAIRS` (with ROUTE_KERNEL), `route_blocks` takes `moe_route.route_blocks_sorted` (a stable
sort + one Triton program: ~8 launches) instead of the PyTorch form (~30 launches; False, for comparisons)."""


def route_blocks(topk_ids: torch.Tensor, E: int, count: bool = False, bm: int = BM):
    """Sort routed pairs by expert and cut them into blocks of <= `bm` pairs of one expert, on the device.

    Returns (sorted expert ids int32 [P] (invalid ids sorted last as E), pair order int32 [P] (pair = t*k + j),
    block starts int32 [P] (position of each block's first pair, -1 past the last block)); with count=True
    also the number of blocks as an int32 [1] device tensor. Pairs of one expert are in pair order with the
    Triton forms (stable sorts); the PyTorch form's sort leaves their order unspecified.
    """
    P = topk_ids.numel()
    if ROUTE_KERNEL and 1 <= P <= route_blocks_triton_max_pairs:
        res = route_blocks_triton(topk_ids, E, bm)
        return res if count else res[:3]
    if ROUTE_KERNEL and ROUTE_SORTED and P >= 1:
        res = route_blocks_sorted(topk_ids, E, bm)
        return res if count else res[:3]
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).to(torch.int64)
    ids = torch.where(ids >= 0, ids, torch.full_like(ids, E))
    sid, order = torch.sort(ids)
    pos = torch.arange(P, device=dev)
    new = torch.ones(P, dtype=torch.bool, device=dev)
    new[1:] = sid[1:] != sid[:-1]
    first = torch.cummax(torch.where(new, pos, torch.zeros_like(pos)), 0).values
    is_start = ((pos - first) % bm == 0) & (sid < E)
    bidx = torch.cumsum(is_start.to(torch.int64), 0) - 1
    starts = torch.full((P + 1,), -1, dtype=torch.int64, device=dev)
    starts.scatter_(0, torch.where(is_start, bidx, torch.full_like(bidx, P)), pos)
    res = sid.to(torch.int32), order.to(torch.int32), starts[:P].to(torch.int32)
    if count:
        return (*res, (bidx[-1:] + 1).to(torch.int32))
    return res


def _weights(dense, packed, scale, what):
    if dense is not None:
        return dense, dense, False
    if packed is None or scale is None:
        raise ValueError(f"moe_experts: give {what} or both {what}_packed and {what}_scale")
    return packed, scale, True


def supported(z, w13, w2) -> bool:
    return z.dtype != torch.float64 and all(w is None or w.dtype != torch.float64 for w in (w13, w2))


def _words(packed):
    """uint8 [E, N, K/2] packed MXFP4 -> the same bytes as int32 [E, N, K/8] (K % 32 == 0 by the format)."""
    return packed.contiguous().view(torch.int32)


def _launch_opts(num_warps, num_stages):
    return dict(num_warps=num_warps) if num_stages is None else dict(num_warps=num_warps, num_stages=num_stages)


def _gemv_path(zc, tw, topk_ids, W1, S1, fp4_1, W2, S2, fp4_2, T, DIN, I, DOUT, TOPK, act_args, tiles, warps,
               num_stages, combine):
    P = T * TOPK
    dev = zc.device
    ids = topk_ids.reshape(-1).contiguous()
    if fp4_1:
        W1 = _words(W1)
    if fp4_2:
        W2 = _words(W2)
    h = torch.empty(P, I, dtype=zc.dtype, device=dev)
    bn1, bk1, bn2, bk2 = tiles
    situ_beta, lin_beta, situ, has_lin = act_args
    loop = COMBINES.index(combine)  # 0 atomic, 1 loop, 2 unroll (the kernel's LOOP)
    n1 = triton.cdiv(I, bn1)
    zb = 0 if loop or not GEMV1_ZEROS_OUT else next_pow2(triton.cdiv(DOUT, n1))
    if loop:
        out = torch.empty(T, DOUT, dtype=zc.dtype, device=dev)
    else:  # fp32 atomic accumulator: zeroed by the gate/up kernel (zb > 0) or here
        out = _accumulator(T, DOUT, dev) if zb else torch.zeros(T, DOUT, dtype=torch.float32, device=dev)
    _moe_gemv1_kernel[(P, n1)](
        zc, ids, W1, S1, h, out, DIN, I, DOUT, TOPK, zc.stride(0), W1.stride(0), W1.stride(1),
        S1.stride(0) if fp4_1 else 0, S1.stride(1) if fp4_1 else 0, situ_beta, lin_beta,
        float(2.0**64) if fp4_2 else 1.0, BN=bn1, BK=bk1, FP4=fp4_1, SITU=situ, HAS_LIN=has_lin, ZB=zb,
        **_launch_opts(warps[0], num_stages),
    )
    _moe_gemv2_kernel[(T if loop else P, triton.cdiv(DOUT, bn2))](
        h, ids, W2, S2, tw, out, I, DOUT, TOPK, W2.stride(0), W2.stride(1), S2.stride(0) if fp4_2 else 0,
        S2.stride(1) if fp4_2 else 0, BN=bn2, BK=bk2, FP4=fp4_2, LOOP=loop, **_launch_opts(warps[1], num_stages),
    )
    return out if loop else out.to(zc.dtype)


def _accumulator(T: int, DOUT: int, dev) -> torch.Tensor:
    """The atomic combine's fp32 [T, DOUT] buffer when the gate/up kernel zeroes it (not zeroed here)."""
    return torch.empty(T, DOUT, dtype=torch.float32, device=dev)


def _num_sms(dev) -> int:
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).multi_processor_count
    return 132  # H200 (interpreter / ahead-of-time compiles)


def _dot_path(zc, tw, topk_ids, E, W1, S1, fp4_1, W2, S2, fp4_2, T, DIN, I, DOUT, TOPK, act_args, tiles, warps,
              num_stages, programs, bm=None, per_pair=False):
    """The "dot" kernels (and the "dense" variant's); `per_pair`: the down GEMM stores every pair's weighted row
    (fp32 [P, DOUT]) and one more kernel sums each token's rows, instead of fp32 atomic adds (see PAIR_SUM_MIN_PAIRS)."""
    P = T * TOPK
    dev = zc.device
    bm = bm or dot_block_rows(P, E)
    sid, order, starts, nblk = route_blocks(topk_ids, E, count=True, bm=bm)
    if fp4_1:
        W1 = _words(W1)
    if fp4_2:
        W2 = _words(W2)
    h = torch.empty(P, I, dtype=zc.dtype, device=dev)
    zb = 512 if DOT1_ZEROS_OUT and not per_pair else 0
    if per_pair:
        out = torch.empty(P, DOUT, dtype=torch.float32, device=dev)  # every valid pair's row written by dot2
    else:
        out = _accumulator(T, DOUT, dev) if zb else torch.zeros(T, DOUT, dtype=torch.float32, device=dev)
    prec = dot_precision(zc.dtype)
    bn1, bk1, bn2, bk2 = tiles
    situ_beta, lin_beta, situ, has_lin = act_args
    cap = programs or 4 * _num_sms(dev)
    _moe_dot1_kernel[(min(P * triton.cdiv(I, bn1), cap),)](
        zc, sid, order, starts, nblk, W1, S1, h, out, P, DIN, I, TOPK, zc.stride(0), W1.stride(0), W1.stride(1),
        S1.stride(0) if fp4_1 else 0, S1.stride(1) if fp4_1 else 0, situ_beta, lin_beta, T * DOUT, BN=bn1, BK=bk1,
        FP4=fp4_1, SITU=situ, HAS_LIN=has_lin, PREC=prec, ZB=zb, BMR=bm, **_launch_opts(warps[0], num_stages),
    )
    _moe_dot2_kernel[(min(P * triton.cdiv(DOUT, bn2), cap),)](
        h, sid, order, starts, nblk, W2, S2, tw, out, P, I, DOUT, TOPK, W2.stride(0), W2.stride(1),
        S2.stride(0) if fp4_2 else 0, S2.stride(1) if fp4_2 else 0, BN=bn2, BK=bk2, FP4=fp4_2, PREC=prec, BMR=bm,
        PER_PAIR=per_pair, **_launch_opts(warps[1], num_stages),
    )
    if not per_pair:
        return out.to(zc.dtype)
    res = torch.empty(T, DOUT, dtype=zc.dtype, device=dev)
    BN = min(1024, next_pow2(DOUT))
    _moe_pair_sum_kernel[(T, triton.cdiv(DOUT, BN))](out, topk_ids.contiguous(), res, DOUT, TOPK=TOPK, BN=BN,
                                                    num_warps=4)
    return res


DOT_BM_LARGE = 16
"""Rows (routed pairs of one expert) per block of the "dot" path when the batch routes at least
DOT_BM_MIN_PAIRS_PER_EXPERT pairs per expert on average (prefill). 64: each block decodes its expert's MXFP4 tiles
once for 64 rows instead of 16 and its tl.dot has M = 64 (wgmma on sm_90) -- but on the H200 (session 8,
benchmarks/mixed_step.py --moe DOT_BM_LARGE=64, small preset, 2K prefill chunk) the MoE kernels got slower,
dot1 27.8 -> 36.3 ms and dot2 11.6 -> 17.0 ms per step (218/227 registers: low occupancy), so the default stays
16 (= BM, 16-row blocks at every size); 64 is kept as a tested knob for the next tile/warp sweep."""
DOT_BM_MIN_PAIRS_PER_EXPERT = 32
"""See DOT_BM_LARGE: below this many pairs per expert on average (decode batches, short prefills) most 64-row
blocks would be mostly empty, so blocks stay at 16 rows."""


def dot_block_rows(P: int, E: int) -> int:
    """Rows per sorted block of the "dot" path for P routed pairs over E experts (see DOT_BM_LARGE)."""
    return DOT_BM_LARGE if P >= DOT_BM_MIN_PAIRS_PER_EXPERT * E else BM


DENSE_MIN_PAIRS_PER_EXPERT = 64
"""variant="auto" with 16-bit activations: from this many routed pairs per expert on average (prefill chunks: 512
tokens of the small preset) the "dot" kernels run on 16-bit weights with DENSE_BM-row blocks ("dense" variant):
MXFP4 experts are first decoded ONCE (`mxfp4_to_dense`, one pass over them) instead of every 16-row block decoding
its expert's tiles again; unpacked experts in the activations' dtype (Kimi-Linear checkpoints) are used as they are,
each weight tile then read once for 64 rows instead of 16. 0 turns it off."""
DENSE_BM = 64
"""Rows (routed pairs of one expert) per sorted block of the "dense" variant."""
DENSE_TILES = ((64, 64, 64, 64), (8, 4))
"""The "dense" variant's tiles (gate/up rows, K; down rows, K) and warps (gate/up, down) where no knob is given."""
PAIR_SUM_MIN_PAIRS = 0
"""The "dense" variant (prefill) from this many routed pairs (> 0): its down GEMM stores each pair's weighted row
(fp32 [P, DOUT], at most PAIR_SUM_MAX_BYTES) and one kernel sums each token's rows in pair order, instead of
P x DOUT fp32 atomic adds into [T, DOUT]. Why: in run 20 (H100, a 16K-token step of the vs-transformers model) the
atomic down GEMM took 1.3 ms a layer against 0.93 for the gate/up GEMM with twice its FLOPs. 0 (the default until
benchmarks/sweep_moe_prefill.py has measured it on a GPU; no device time was left for it): atomics everywhere."""
PAIR_SUM_MAX_BYTES = 1 << 30
"""Largest per-pair buffer (P x DOUT x 4 bytes) the "dense" variant takes; above it, the atomic combine."""
DENSE_MAX_BYTES = 4 << 30
"""The "dense" variant's scratch (all experts' 16-bit weights) is at most this many bytes; above it "auto" keeps
the MXFP4 "dot" path (the K3 shape at full size would need 7.4 GB per layer)."""


def mxfp4_to_dense(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16, out=None) -> torch.Tensor:
    """Packed MXFP4 uint8 [..., N, K/2] + scale bytes [..., N, K/32] -> `dtype` [..., N, K] on the device, one
    Triton pass (the values `_fp4_tile` decodes: a scale byte of 0 gives 0)."""
    *lead, N, KH = packed.shape
    R = packed.numel() // KH
    out = torch.empty(*lead, N, 2 * KH, dtype=dtype, device=packed.device) if out is None else out
    BR, BKH = 16, min(256, next_pow2(KH))
    _mxfp4_to_dense_kernel[(triton.cdiv(R, BR), triton.cdiv(KH, BKH))](packed.contiguous(), scale.contiguous(), out,
                                                                      R, KH, BR=BR, BKH=BKH, num_warps=4)
    return out


def dense_weights(fp4_1: bool, fp4_2: bool, W1: torch.Tensor, W2: torch.Tensor, dtype) -> str | None:
    """What the "dense" variant makes of the experts' weights: "mxfp4" (both packed: decoded into a scratch first),
    "unpacked" (both already in the activations' dtype: used as they are), None (a mix: no "dense" variant)."""
    if fp4_1 and fp4_2:
        return "mxfp4"
    return "unpacked" if not (fp4_1 or fp4_2) and W1.dtype == W2.dtype == dtype else None


def takes_dense(P: int, E: int, weights: str | None, dtype, weight_elems: int) -> bool:
    """variant="auto": whether a batch of P routed pairs over E experts takes the "dense" variant; `weights` as
    `dense_weights` says (MXFP4 ones only while their decoded scratch, 2 bytes an element, fits DENSE_MAX_BYTES)."""
    return (weights is not None and DENSE_MIN_PAIRS_PER_EXPERT > 0 and P >= DENSE_MIN_PAIRS_PER_EXPERT * E
            and dtype in (torch.bfloat16, torch.float16)
            and (weights == "unpacked" or 2 * weight_elems <= DENSE_MAX_BYTES))


VARIANTS = ("blocks", "gemv", "dot", "dense", "auto")
DEFAULT_VARIANT = "auto"  # H200 sweep: T=1 38 µs vs blocks 251, T=8 165 vs 1021, T=64 764 vs 3309
"""What `moe_experts_triton` runs when no variant is given (the lead flips this after measuring)."""
AUTO_GEMV_MAX_PAIRS = 128
"""variant="auto": "gemv" when T * topk <= this, else "dot"."""
COMBINES = ("atomic", "loop", "unroll")
GEMV_COMBINE = "atomic"
"""The "gemv" path's combine when none is given (see `moe_experts_triton`). H200, small preset, graph-timed
(benchmarks/sweep_moe.py, docs/kernels-notes.md session 6): T=1 atomic 22.2 µs vs loop 40.2 / unroll 38.6
(one program per token walks its pairs' weights one after another: too few loads in flight); T=8 60.2 vs
82.2 / 81.2."""
GEMV1_ZEROS_OUT = True
"""The "gemv" atomic combine: the gate/up kernel zeroes the fp32 accumulator (no fill kernel: -1 launch per MoE
layer at decode batch sizes); False: a torch.zeros before it, as in session 6 (decode_roofline's graphs-s6)."""
DOT1_ZEROS_OUT = True
"""The same for the "dot" path (decode batches above AUTO_GEMV_MAX_PAIRS pairs, prefill): its persistent gate/up
kernel zeroes the accumulator first (-1 fill kernel per MoE layer; B=64 in run 15: 23 fills, 20.7 µs per step)."""
GEMV_WIDE_K = 1024
GEMV_WIDE_K_MAX_PAIRS = 16
"""Up to this many routed pairs, with MXFP4 weights whose K (DIN and I) both fit in GEMV_WIDE_K, each "gemv"
kernel takes its whole K in one tile (one round of loads; small preset T=1: 22.2 -> 19.7 µs, but T=8: 60.2
-> 79.2, so only for the fewest pairs)."""

# Default tiles (rows, K) per variant, gate/up then down, for MXFP4 and dense weights, and warps per kernel.
# From the sm_90 compiles (aot_check): "gemv" (16, 512) / (128, 128) at 4 warps: ~5.7 / ~5.2 issued
# instructions per weight element, 71 registers; "dot" (64, 256) at 8 warps / (128, 128) at 4 warps:
# ~7.1 / ~7.0 per element, 128 / 96 registers.
_TILES = {"gemv": ((16, 512, 128, 128), (16, 64, 32, 64), (4, 4)),
          "dot": ((64, 256, 128, 128), (64, 64, 64, 64), (8, 4))}


def _tiles(variant, fp4_1, fp4_2, DIN, I, bn1, bk1, bn2, bk2, num_warps, fill=None):
    """Tile sizes and warps: the knobs where given, else the defaults, K tiles clamped to the problem.

    `fill` = (rows of programs, DOUT, SMs, narrowest, routed pairs): the "gemv" down tile is narrowed (down to
    `narrowest` rows) until the launch has at least one program per SM (the small preset at batch 1: 8 pairs x
    1024 rows, 64 programs at 128 rows; rows of programs = routed pairs for "atomic", tokens for "loop"/"unroll");
    up to GEMV_WIDE_K_MAX_PAIRS pairs the K tiles take the whole K (GEMV_WIDE_K).
    """
    f4, dense, warps = _TILES[variant]
    kmin = 32 if variant == "gemv" else 128  # an MXFP4 "dot" K tile gives tl.dot K = BK/8 >= 16
    if (variant == "gemv" and fill is not None and fill[4] <= GEMV_WIDE_K_MAX_PAIRS and fp4_1 and fp4_2
            and max(DIN, I) <= GEMV_WIDE_K):  # few pairs: the whole K in one tile (see GEMV_WIDE_K)
        bk1 = bk1 or max(kmin, next_pow2(DIN))
        bk2 = bk2 or max(kmin, next_pow2(I))
    bk1 = bk1 or (min(f4[1], max(kmin, next_pow2(DIN))) if fp4_1 else min(dense[1], max(16, next_pow2(DIN))))
    bk2 = bk2 or (min(f4[3], max(kmin, next_pow2(I))) if fp4_2 else min(dense[3], max(16, next_pow2(I))))
    bn1 = bn1 or (f4 if fp4_1 else dense)[0]
    if not bn2:
        bn2 = (f4 if fp4_2 else dense)[2]
        if variant == "gemv" and fill is not None:  # too few (pair, tile) programs to fill the SMs: narrower tiles
            pairs, dout, sms, narrowest, _ = fill
            while bn2 > narrowest and pairs * -(-dout // bn2) < sms:
                bn2 //= 2
    if num_warps is not None:
        warps = tuple(num_warps) if isinstance(num_warps, (tuple, list)) else (num_warps, num_warps)
    return (bn1, bk1, bn2, bk2), warps


def moe_experts_triton(z, topk_weights, topk_ids, *, w13=None, w2=None, w13_packed=None, w13_scale=None,
                       w2_packed=None, w2_scale=None, activation="situ", situ_beta=4.0, situ_linear_beta=None,
                       variant=None, bn1=None, bk1=None, bn2=None, bk2=None, num_warps=None, num_stages=None,
                       combine=None, programs=None):
    """Triton implementation of `reference.moe_experts` (same arguments and result).

    Tuning knobs (None = the defaults): `variant` (default DEFAULT_VARIANT) "blocks" (sorted blocks of <= 16
    pairs of one expert, tl.dot), "gemv" (decode path: one routed pair per program, no sorting, fp32 FMAs on
    a lean MXFP4 decode), "dot" (sorted blocks like "blocks", lean MXFP4 decode into tl.dot, persistent
    programs over the device-side block count), "dense" (the "dot" kernels with DENSE_BM-row blocks on 16-bit weights:
    MXFP4 experts decoded once first, unpacked ones as they are; prefill chunks) or "auto" (by T * topk, see
    AUTO_GEMV_MAX_PAIRS and DENSE_MIN_PAIRS_PER_EXPERT);
    bn1/bk1 (gate/up tile: rows of I, K over DIN), bn2/bk2 (down tile: rows of DOUT, K over I); num_warps (an
    int, or a pair for the two kernels); num_stages; `combine` ("gemv", default GEMV_COMBINE): "atomic" (fp32
    atomic adds, one program per pair), "loop" (one program per token sums its pairs: no atomics, no zero fill,
    no cast) or "unroll" (as "loop", the pairs unrolled without branches);
    `programs` ("dot"): persistent programs per kernel (default 4 per SM).
    """
    if activation not in ("situ", "silu"):
        raise ValueError(f"unknown activation {activation!r}")
    variant = variant or DEFAULT_VARIANT
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} (one of {VARIANTS})")
    combine = combine or GEMV_COMBINE
    if combine not in COMBINES:
        raise ValueError(f"unknown combine {combine!r} (one of {COMBINES})")
    W1, S1, fp4_1 = _weights(w13, w13_packed, w13_scale, "w13")
    W2, S2, fp4_2 = _weights(w2, w2_packed, w2_scale, "w2")
    T, DIN = z.shape
    E = W1.shape[0]
    I = W1.shape[1] // 2
    DOUT = W2.shape[1]
    TOPK = topk_ids.shape[1]
    P = T * TOPK
    dev = z.device
    if P == 0:
        return torch.zeros(T, DOUT, dtype=z.dtype, device=dev)
    zc = z.contiguous()
    W1, S1, W2, S2 = (t.contiguous() for t in (W1, S1, W2, S2))
    tw = topk_weights.reshape(-1).contiguous()
    act_args = (float(4.0 if situ_beta is None else situ_beta), float(situ_linear_beta or 1.0),
                activation == "situ", situ_linear_beta is not None)
    kind = dense_weights(fp4_1, fp4_2, W1, W2, zc.dtype)
    if variant == "auto":
        dense = takes_dense(P, E, kind, zc.dtype, W1.numel() * 2 + W2.numel() * 2)
        variant = "gemv" if P <= AUTO_GEMV_MAX_PAIRS else ("dense" if dense else "dot")
    if variant == "dense":
        if kind is None:
            raise ValueError('variant="dense": needs both experts\' weights in MXFP4, or both unpacked in the '
                             f'activations\' dtype {zc.dtype} (others take "dot")')
        dt = zc.dtype if zc.dtype in (torch.bfloat16, torch.float16) else torch.float32
        D1, D2 = (mxfp4_to_dense(W1, S1, dt), mxfp4_to_dense(W2, S2, dt)) if kind == "mxfp4" else (W1, W2)
        t0, w0 = DENSE_TILES
        warps = tuple(num_warps) if isinstance(num_warps, (tuple, list)) else (
            (num_warps, num_warps) if num_warps else w0)
        tiles = (bn1 or t0[0], bk1 or min(t0[1], max(16, next_pow2(DIN))), bn2 or t0[2],
                 bk2 or min(t0[3], max(16, next_pow2(I))))
        per_pair = 0 < PAIR_SUM_MIN_PAIRS <= P and P * DOUT * 4 <= PAIR_SUM_MAX_BYTES
        return _dot_path(zc, tw, topk_ids, E, D1, D1, False, D2, D2, False, T, DIN, I, DOUT, TOPK, act_args, tiles,
                         warps, num_stages, programs, bm=DENSE_BM, per_pair=per_pair)
    if variant in ("gemv", "dot"):
        per_token = combine != "atomic"
        tiles, warps = _tiles(variant, fp4_1, fp4_2, DIN, I, bn1, bk1, bn2, bk2, num_warps,
                              fill=(T if per_token else P, DOUT, _num_sms(dev), 8 if per_token else 16, P))
        if variant == "gemv":
            return _gemv_path(zc, tw, topk_ids, W1, S1, fp4_1, W2, S2, fp4_2, T, DIN, I, DOUT, TOPK, act_args,
                              tiles, warps, num_stages, combine)
        return _dot_path(zc, tw, topk_ids, E, W1, S1, fp4_1, W2, S2, fp4_2, T, DIN, I, DOUT, TOPK, act_args, tiles,
                         warps, num_stages, programs)
    out = torch.zeros(T, DOUT, dtype=torch.float32, device=dev)
    sid, order, starts = route_blocks(topk_ids, E)
    hdt = zc.dtype
    h = torch.empty(P, I, dtype=hdt, device=dev)
    prec = dot_precision(zc.dtype)
    nw = num_warps or 8
    nw1, nw2 = tuple(nw) if isinstance(nw, (tuple, list)) else (nw, nw)
    BN1 = bn1 or min(32, max(16, next_pow2(I)))
    _moe_gemm1_kernel[(P, triton.cdiv(I, BN1))](
        zc, sid, order, starts, W1, S1, h, P, DIN, I, TOPK, zc.stride(0), W1.stride(0), W1.stride(1),
        S1.stride(0) if fp4_1 else 0, S1.stride(1) if fp4_1 else 0, act_args[0], act_args[1], BN=BN1,
        BK=bk1 or (128 if DIN >= 128 else max(32, next_pow2(DIN))), FP4=fp4_1, SITU=act_args[2],
        HAS_LIN=act_args[3], PREC=prec, **_launch_opts(nw1, num_stages),
    )
    BN2 = bn2 or min(32, max(16, next_pow2(DOUT)))
    _moe_gemm2_kernel[(P, triton.cdiv(DOUT, BN2))](
        h, sid, order, starts, W2, S2, tw, out, P, I, DOUT, TOPK, W2.stride(0), W2.stride(1),
        S2.stride(0) if fp4_2 else 0, S2.stride(1) if fp4_2 else 0, BN=BN2,
        BK=bk2 or (128 if I >= 128 else max(32, next_pow2(I))), FP4=fp4_2, PREC=prec, **_launch_opts(nw2, num_stages),
    )
    return out.to(z.dtype)
