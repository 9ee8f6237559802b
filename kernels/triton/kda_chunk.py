"""KDA chunked prefill in Triton: variable-length batches, slot-gathered initial states, in-place finals,
in-pass checkpoint export. Same contract as `k3serve.kernels.reference.kda_chunked`.

Two launches:
1. `_kda_prep_kernel`, one program per (chunk, head), chunk-parallel. Per chunk of n <= 64 tokens it
   normalises q, k, forms the cumulative log-decay G, the gated key-key matrix A (strictly lower, β rows)
   and the gated query-key matrix (inclusive), solves (I + A) [W | U] = β [k̂ e^G | v] block-wise
   (16-row sub-chunks, exact 16x16 inverses by forward substitution), and stores W, U, q̂ e^G,
   k̂ e^{G_n - G}, the q-k matrix and e^{G_n}.
   Every exponent is taken against a reference point so that it is <= 0 (g <= 0: log-decays), except
   inside a 16-token diagonal block, where it is at most the block's decay span; a block whose span
   exceeds 80 (only possible for unbounded gates) takes an exact pairwise path.
   (Or, with prep_variant="split" / "onepass", the prep is done by `_kda_intra_kernel` +
   `_kda_wu_kernel` / `_kda_prep_onepass_kernel`: see `kda_chunked_triton` and the section comment.)
2. `_kda_state_kernel`, one program per (sequence, head, V block), sequential over the sequence's chunks:
   Ũ = U - W Sᵀ;  O = (q̂ e^G) Sᵀ + QK Ũ;  S <- S e^{G_n} + Ũᵀ (k̂ e^{G_n-G}).  The state stays in fp32
   registers; checkpoints are chunk ends (the chunk grid is cut at every checkpoint offset), so an
   export is one store.
Requires g <= 0 (KDA log-decays), K and V powers of two >= 16, no float64 (those go to the reference).
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from ..reference import _varlen
from ._common import dot_precision, inter_dtype

BT = 64  # chunk length
BC = 16  # sub-chunk length


@triton.jit
def _load_sub(
    q_ptr,
    k_ptr,
    g_ptr,
    b_ptr,
    v_ptr,
    t0,
    n,
    i: tl.constexpr,
    h,
    scale,
    H,
    sq,
    sk,
    sv,
    K: tl.constexpr,
    V: tl.constexpr,
    L2NORM: tl.constexpr,
):
    """Rows t0 + 16i .. of sub-chunk i for head h: q, k, v at token strides sq, sk, sv (elements; heads K or V
    apart), g and beta contiguous."""
    r = i * 16 + tl.arange(0, 16)
    m = r < n
    tok = (t0 + r).to(tl.int64)
    base = tok * H + h
    rk = tl.arange(0, K)
    rv = tl.arange(0, V)
    qx = tl.load(q_ptr + tok[:, None] * sq + h * K + rk[None, :], mask=m[:, None], other=0.0).to(tl.float32)
    kx = tl.load(k_ptr + tok[:, None] * sk + h * K + rk[None, :], mask=m[:, None], other=0.0).to(tl.float32)
    if L2NORM:
        qx = qx * tl.rsqrt(tl.sum(qx * qx, axis=1) + 1e-6)[:, None]
        kx = kx * tl.rsqrt(tl.sum(kx * kx, axis=1) + 1e-6)[:, None]
    qx = qx * scale
    gx = tl.load(g_ptr + base[:, None] * K + rk[None, :], mask=m[:, None], other=0.0).to(tl.float32)
    bx = tl.load(b_ptr + base, mask=m, other=0.0).to(tl.float32)
    vx = tl.load(v_ptr + tok[:, None] * sv + h * V + rv[None, :], mask=m[:, None], other=0.0).to(tl.float32)
    return qx, kx, gx, bx, vx


@triton.jit
def _diag_exact(qx, kx, G):
    """Diagonal 16x16 blocks by the exact pairwise form (any decay strength); unmasked."""
    r = tl.arange(0, 16)
    akk = tl.zeros([16, 16], dtype=tl.float32)
    aqk = tl.zeros([16, 16], dtype=tl.float32)
    for s in tl.static_range(16):
        sel = (r == s)[:, None]
        ks = tl.sum(tl.where(sel, kx, 0.0), axis=0)
        gs = tl.sum(tl.where(sel, G, 0.0), axis=0)
        d = tl.exp(tl.minimum(G - gs[None, :], 0.0)) * ks[None, :]
        colk = tl.sum(kx * d, axis=1)
        colq = tl.sum(qx * d, axis=1)
        akk = tl.where((r == s)[None, :], colk[:, None], akk)
        aqk = tl.where((r == s)[None, :], colq[:, None], aqk)
    return akk, aqk


@triton.jit
def _diag(qx, kx, G, c0, c1, PREC: tl.constexpr):
    """Diagonal 16x16 blocks: (k̂_t·k̂_s e^{G_t-G_s}) strictly lower and (q̂_t·k̂_s e^{G_t-G_s}) inclusive."""
    r = tl.arange(0, 16)
    span = tl.max(c0 - c1, axis=0)
    if span < 80.0:
        a = tl.exp(G - c0[None, :])
        kn = kx * tl.exp(c0[None, :] - G)
        akk = tl.dot(kx * a, tl.trans(kn), input_precision=PREC)
        aqk = tl.dot(qx * a, tl.trans(kn), input_precision=PREC)
    else:  # exact pairwise form (decays too strong for the factored one)
        akk, aqk = _diag_exact(qx, kx, G)
    akk = tl.where(r[:, None] > r[None, :], akk, 0.0)
    aqk = tl.where(r[:, None] >= r[None, :], aqk, 0.0)
    return akk, aqk


@triton.jit
def _inv16(a, PREC: tl.constexpr):
    """(I + a)^-1 for a strictly lower-triangular 16x16 `a` (fp32).

    Exact-arithmetic inputs (PREC == "ieee"): forward substitution. Otherwise the product form
    (I + a)^-1 = (I + N)(I + N²)(I + N⁴)(I + N⁸), N = -a (N^16 = 0): seven 16x16 fp32 FMA products and no
    cross-warp reductions; its error on strongly correlated keys stays near 1e-4 relative, far under the
    bf16 rounding of the stored results.
    """
    r = tl.arange(0, 16)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    if PREC == "ieee":
        t = eye
        for i in tl.static_range(1, 16):
            row = tl.sum(tl.where(r[:, None] == i, a, 0.0), axis=0)
            new = -tl.sum(row[:, None] * t, axis=0) + tl.where(r == i, 1.0, 0.0)
            t = tl.where(r[:, None] == i, new[None, :], t)
    else:
        n1 = -a
        n2 = tl.dot(n1, n1, input_precision="ieee")
        t = tl.dot(eye + n1, eye + n2, input_precision="ieee")
        n4 = tl.dot(n2, n2, input_precision="ieee")
        t = tl.dot(t, eye + n4, input_precision="ieee")
        n8 = tl.dot(n4, n4, input_precision="ieee")
        t = tl.dot(t, eye + n8, input_precision="ieee")
    return t


@triton.jit
def _store_rows(ptr, x, t0, n, i: tl.constexpr, h, H, D: tl.constexpr, col0: tl.constexpr, W: tl.constexpr):
    r = i * 16 + tl.arange(0, 16)
    cols = tl.arange(0, D)
    base = (t0 + r).to(tl.int64) * H + h
    tl.store(
        ptr + base[:, None] * W + col0 + cols[None, :], x.to(ptr.dtype.element_ty), mask=(r < n)[:, None]
    )


@triton.jit
def _offd(xs_i, ci, cj1, ke_j, PREC: tl.constexpr):
    """Off-diagonal block: rows of sub-chunk i (x̂ e^{G-c_i}) against keys of an earlier sub-chunk j."""
    return tl.dot((xs_i * tl.exp(ci - cj1)[None, :]).to(ke_j.dtype), tl.trans(ke_j), input_precision=PREC)


@triton.jit(do_not_specialize=["H"])
def _kda_prep_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    b_ptr,
    w_ptr,
    u_ptr,
    qg_ptr,
    kd_ptr,
    aqk_ptr,
    gend_ptr,
    cstart_ptr,
    clen_ptr,
    scale,
    H,
    sq,
    sk,
    sv,
    K: tl.constexpr,
    V: tl.constexpr,
    L2NORM: tl.constexpr,
    PREC: tl.constexpr,
):
    c = tl.program_id(0)
    h = tl.program_id(1)
    DT = w_ptr.dtype.element_ty
    t0 = tl.load(cstart_ptr + c)
    n = tl.load(clen_ptr + c)
    z16 = tl.zeros([16, 16], dtype=tl.float32)

    # ---- sub-chunk 0
    q0, k0, g0, b0, v0 = _load_sub(q_ptr, k_ptr, g_ptr, b_ptr, v_ptr, t0, n, 0, h, scale, H, sq, sk, sv, K, V, L2NORM)
    c0 = tl.zeros([K], dtype=tl.float32)
    G0 = tl.cumsum(g0, axis=0)
    c1 = tl.sum(g0, axis=0)
    a00, p00 = _diag(q0, k0, G0, c0, c1, PREC)
    t00 = _inv16(a00 * b0[:, None], PREC)
    e0 = tl.exp(G0)
    xk0 = tl.dot(t00, b0[:, None] * k0 * e0, input_precision=PREC)
    xv0 = tl.dot(t00, b0[:, None] * v0, input_precision=PREC)
    ke0 = (k0 * tl.exp(c1[None, :] - G0)).to(DT)
    xk0 = xk0.to(DT)
    xv0 = xv0.to(DT)
    _store_rows(qg_ptr, q0 * e0, t0, n, 0, h, H, K, 0, K)
    _store_rows(w_ptr, xk0, t0, n, 0, h, H, K, 0, K)
    _store_rows(u_ptr, xv0, t0, n, 0, h, H, V, 0, V)
    _store_rows(aqk_ptr, p00, t0, n, 0, h, H, 16, 0, 64)
    _store_rows(aqk_ptr, z16, t0, n, 0, h, H, 16, 16, 64)
    _store_rows(aqk_ptr, z16, t0, n, 0, h, H, 16, 32, 64)
    _store_rows(aqk_ptr, z16, t0, n, 0, h, H, 16, 48, 64)

    # ---- sub-chunk 1
    q1, k1, g1, b1, v1 = _load_sub(q_ptr, k_ptr, g_ptr, b_ptr, v_ptr, t0, n, 1, h, scale, H, sq, sk, sv, K, V, L2NORM)
    G1 = c1[None, :] + tl.cumsum(g1, axis=0)
    c2 = c1 + tl.sum(g1, axis=0)
    a11, p11 = _diag(q1, k1, G1, c1, c2, PREC)
    s1 = tl.exp(G1 - c1[None, :])
    a10 = _offd(k1 * s1, c1, c1, ke0, PREC) * b1[:, None]
    p10 = _offd(q1 * s1, c1, c1, ke0, PREC)
    t11 = _inv16(a11 * b1[:, None], PREC)
    e1 = tl.exp(G1)
    rk1 = b1[:, None] * k1 * e1 - tl.dot(a10.to(DT), xk0, input_precision=PREC)
    rv1 = b1[:, None] * v1 - tl.dot(a10.to(DT), xv0, input_precision=PREC)
    xk1 = tl.dot(t11, rk1, input_precision=PREC)
    xv1 = tl.dot(t11, rv1, input_precision=PREC)
    ke1 = (k1 * tl.exp(c2[None, :] - G1)).to(DT)
    xk1 = xk1.to(DT)
    xv1 = xv1.to(DT)
    _store_rows(qg_ptr, q1 * e1, t0, n, 1, h, H, K, 0, K)
    _store_rows(w_ptr, xk1, t0, n, 1, h, H, K, 0, K)
    _store_rows(u_ptr, xv1, t0, n, 1, h, H, V, 0, V)
    _store_rows(aqk_ptr, p10, t0, n, 1, h, H, 16, 0, 64)
    _store_rows(aqk_ptr, p11, t0, n, 1, h, H, 16, 16, 64)
    _store_rows(aqk_ptr, z16, t0, n, 1, h, H, 16, 32, 64)
    _store_rows(aqk_ptr, z16, t0, n, 1, h, H, 16, 48, 64)

    # ---- sub-chunk 2
    q2, k2, g2, b2, v2 = _load_sub(q_ptr, k_ptr, g_ptr, b_ptr, v_ptr, t0, n, 2, h, scale, H, sq, sk, sv, K, V, L2NORM)
    G2 = c2[None, :] + tl.cumsum(g2, axis=0)
    c3 = c2 + tl.sum(g2, axis=0)
    a22, p22 = _diag(q2, k2, G2, c2, c3, PREC)
    s2 = tl.exp(G2 - c2[None, :])
    a20 = _offd(k2 * s2, c2, c1, ke0, PREC) * b2[:, None]
    a21 = _offd(k2 * s2, c2, c2, ke1, PREC) * b2[:, None]
    p20 = _offd(q2 * s2, c2, c1, ke0, PREC)
    p21 = _offd(q2 * s2, c2, c2, ke1, PREC)
    t22 = _inv16(a22 * b2[:, None], PREC)
    e2 = tl.exp(G2)
    rk2 = (
        b2[:, None] * k2 * e2
        - tl.dot(a20.to(DT), xk0, input_precision=PREC)
        - tl.dot(a21.to(DT), xk1, input_precision=PREC)
    )
    rv2 = (
        b2[:, None] * v2
        - tl.dot(a20.to(DT), xv0, input_precision=PREC)
        - tl.dot(a21.to(DT), xv1, input_precision=PREC)
    )
    xk2 = tl.dot(t22, rk2, input_precision=PREC)
    xv2 = tl.dot(t22, rv2, input_precision=PREC)
    ke2 = (k2 * tl.exp(c3[None, :] - G2)).to(DT)
    xk2 = xk2.to(DT)
    xv2 = xv2.to(DT)
    _store_rows(qg_ptr, q2 * e2, t0, n, 2, h, H, K, 0, K)
    _store_rows(w_ptr, xk2, t0, n, 2, h, H, K, 0, K)
    _store_rows(u_ptr, xv2, t0, n, 2, h, H, V, 0, V)
    _store_rows(aqk_ptr, p20, t0, n, 2, h, H, 16, 0, 64)
    _store_rows(aqk_ptr, p21, t0, n, 2, h, H, 16, 16, 64)
    _store_rows(aqk_ptr, p22, t0, n, 2, h, H, 16, 32, 64)
    _store_rows(aqk_ptr, z16, t0, n, 2, h, H, 16, 48, 64)

    # ---- sub-chunk 3
    q3, k3, g3, b3, v3 = _load_sub(q_ptr, k_ptr, g_ptr, b_ptr, v_ptr, t0, n, 3, h, scale, H, sq, sk, sv, K, V, L2NORM)
    G3 = c3[None, :] + tl.cumsum(g3, axis=0)
    c4 = c3 + tl.sum(g3, axis=0)
    a33, p33 = _diag(q3, k3, G3, c3, c4, PREC)
    s3 = tl.exp(G3 - c3[None, :])
    a30 = _offd(k3 * s3, c3, c1, ke0, PREC) * b3[:, None]
    a31 = _offd(k3 * s3, c3, c2, ke1, PREC) * b3[:, None]
    a32 = _offd(k3 * s3, c3, c3, ke2, PREC) * b3[:, None]
    p30 = _offd(q3 * s3, c3, c1, ke0, PREC)
    p31 = _offd(q3 * s3, c3, c2, ke1, PREC)
    p32 = _offd(q3 * s3, c3, c3, ke2, PREC)
    t33 = _inv16(a33 * b3[:, None], PREC)
    e3 = tl.exp(G3)
    rk3 = (
        b3[:, None] * k3 * e3
        - tl.dot(a30.to(DT), xk0, input_precision=PREC)
        - tl.dot(a31.to(DT), xk1, input_precision=PREC)
        - tl.dot(a32.to(DT), xk2, input_precision=PREC)
    )
    rv3 = (
        b3[:, None] * v3
        - tl.dot(a30.to(DT), xv0, input_precision=PREC)
        - tl.dot(a31.to(DT), xv1, input_precision=PREC)
        - tl.dot(a32.to(DT), xv2, input_precision=PREC)
    )
    xk3 = tl.dot(t33, rk3, input_precision=PREC)
    xv3 = tl.dot(t33, rv3, input_precision=PREC)
    ke3 = (k3 * tl.exp(c4[None, :] - G3)).to(DT)
    _store_rows(qg_ptr, q3 * e3, t0, n, 3, h, H, K, 0, K)
    _store_rows(w_ptr, xk3, t0, n, 3, h, H, K, 0, K)
    _store_rows(u_ptr, xv3, t0, n, 3, h, H, V, 0, V)
    _store_rows(aqk_ptr, p30, t0, n, 3, h, H, 16, 0, 64)
    _store_rows(aqk_ptr, p31, t0, n, 3, h, H, 16, 16, 64)
    _store_rows(aqk_ptr, p32, t0, n, 3, h, H, 16, 32, 64)
    _store_rows(aqk_ptr, p33, t0, n, 3, h, H, 16, 48, 64)

    # ---- keys decayed to the chunk end, and the chunk's total decay
    _store_rows(kd_ptr, ke0.to(tl.float32) * tl.exp(c4 - c1)[None, :], t0, n, 0, h, H, K, 0, K)
    _store_rows(kd_ptr, ke1.to(tl.float32) * tl.exp(c4 - c2)[None, :], t0, n, 1, h, H, K, 0, K)
    _store_rows(kd_ptr, ke2.to(tl.float32) * tl.exp(c4 - c3)[None, :], t0, n, 2, h, H, K, 0, K)
    _store_rows(kd_ptr, ke3, t0, n, 3, h, H, K, 0, K)
    rk = tl.arange(0, K)
    tl.store(gend_ptr + (c.to(tl.int64) * H + h) * K + rk, tl.exp(c4))


@triton.jit(do_not_specialize=["H"])
def _kda_state_kernel(
    w_ptr,
    u_ptr,
    qg_ptr,
    kd_ptr,
    aqk_ptr,
    gend_ptr,
    o_ptr,
    pool_ptr,
    slot_ptr,
    init_ptr,
    seqc_ptr,
    cstart_ptr,
    clen_ptr,
    cckpt_ptr,
    pool_stride,
    H,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    init = tl.load(init_ptr + b)
    c_lo = tl.load(seqc_ptr + b)
    c_hi = tl.load(seqc_ptr + b + 1)
    rt = tl.arange(0, 64)
    rk = tl.arange(0, K)
    rv = vb * BV + tl.arange(0, BV)
    if slot >= 0:
        pool_row = pool_ptr + slot * pool_stride + h * V * K
        S = tl.load(
            pool_row + rv[:, None] * K + rk[None, :], mask=(init != 0) & (rv[:, None] < V), other=0.0
        ).to(tl.float32)
        for c in range(c_lo, c_hi):
            t0 = tl.load(cstart_ptr + c)
            n = tl.load(clen_ptr + c)
            m = (rt < n)[:, None]
            base = (t0 + rt).to(tl.int64) * H + h
            w = tl.load(w_ptr + base[:, None] * K + rk[None, :], mask=m, other=0.0)
            u = tl.load(u_ptr + base[:, None] * V + rv[None, :], mask=m, other=0.0).to(tl.float32)
            qg = tl.load(qg_ptr + base[:, None] * K + rk[None, :], mask=m, other=0.0)
            kd = tl.load(kd_ptr + base[:, None] * K + rk[None, :], mask=m, other=0.0)
            a = tl.load(aqk_ptr + base[:, None] * 64 + rt[None, :], mask=m, other=0.0)
            ge = tl.load(gend_ptr + (c * H + h) * K + rk)
            Sd = S.to(w.dtype)
            unew = u - tl.dot(w, tl.trans(Sd), input_precision=PREC)
            un = unew.to(a.dtype)
            o = tl.dot(qg, tl.trans(Sd), input_precision=PREC) + tl.dot(a, un, input_precision=PREC)
            tl.store(o_ptr + base[:, None] * V + rv[None, :], o.to(o_ptr.dtype.element_ty), mask=m)
            S = S * ge[None, :] + tl.dot(tl.trans(un), kd, input_precision=PREC)
            ck = tl.load(cckpt_ptr + c).to(tl.int64)
            if ck >= 0:
                tl.store(
                    pool_ptr + ck * pool_stride + h * V * K + rv[:, None] * K + rk[None, :],
                    S.to(pool_ptr.dtype.element_ty),
                )
        tl.store(pool_row + rv[:, None] * K + rk[None, :], S.to(pool_ptr.dtype.element_ty))
    else:  # padded sequence: zero output, no slot touched
        for c in range(c_lo, c_hi):
            t0 = tl.load(cstart_ptr + c)
            n = tl.load(clen_ptr + c)
            base = (t0 + rt).to(tl.int64) * H + h
            zero = tl.zeros([64, BV], dtype=tl.float32)
            tl.store(
                o_ptr + base[:, None] * V + rv[None, :],
                zero.to(o_ptr.dtype.element_ty),
                mask=(rt < n)[:, None],
            )


# ---------------------------------------------------------------------------------------------------------
# "split" / "onepass" prep. (a) `_split_intra`, per (chunk, head): the gated q-k and k-k matrices as
# 64x64 tl.dot accumulators (wgmma) over K slices of BK columns, one pass (one accumulator) each. Per slice
# every exponent comes from the in-block cumulative log-decay L and the block totals S: rows x e^L, keys
# k e^{S-L} (<= 1), and per key block j a row factor (e^{-S_j} on its own block, at most e^80, else
# e^{c_i - c_{j+1}} <= 1); the four key blocks are one product (concatenated along K). The l2 norms are
# applied to the finished matrices. A's 16x16 blocks (tl.split) give T' = (I + A)^-1 diag(β) by 16x16
# inverses and the block merge T_ij = -T_ii Σ_{j<=m<i} A_im T_mj. (b) `_wu_cols`, per (chunk, head, BN
# columns): G over the 64-row chunk, W = T' (k̂ e^G), U = T' V as 64-row tl.dot tiles, q̂ e^G,
# k̂ e^{G_n-G}, e^{G_n}. Neither part keeps 16-row W/U blocks of earlier sub-chunks live (the fused
# kernel does).


@triton.jit
def _mm16(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _seg_add(a, fa, b, fb):
    """Segmented sum (a segment starts where the flag is set)."""
    return tl.where(fb, b, a + b), fa | fb


@triton.jit
def _bsel(blk, x0, x1, x2, x3):
    """Row-wise select among four per-16-row-block values (K vectors or scalars) -> a [64, BK] tile."""
    return tl.where(blk == 0, x0, tl.where(blk == 1, x1, tl.where(blk == 2, x2, x3)))


@triton.jit
def _cat4(a, b, c, d):
    """[R, C] x4 -> [R, 4C] (columns interleaved; only ever contracted over, in the same order on both sides)."""
    return tl.reshape(tl.join(tl.join(a, b), tl.join(c, d)), [a.shape[0], 4 * a.shape[1]])


@triton.jit
def _rows2(x):
    """[2R, C] -> the top and bottom halves."""
    y = tl.permute(tl.reshape(x, [2, x.shape[0] // 2, x.shape[1]]), (1, 2, 0))
    return tl.split(y)


@triton.jit
def _cols2(x):
    """[R, 2C] -> the left and right halves."""
    y = tl.permute(tl.reshape(x, [x.shape[0], 2, x.shape[1] // 2]), (0, 2, 1))
    return tl.split(y)


@triton.jit
def _exact_sub(
    q_ptr,
    k_ptr,
    g_ptr,
    t0,
    n,
    i: tl.constexpr,
    h,
    H,
    K: tl.constexpr,
    col0,
    BK: tl.constexpr,
    QK: tl.constexpr,
):
    """Sub-chunk i, columns col0..col0+BK: raw diagonal block (k-k, or q-k if QK) by the exact pairwise form,
    and the row sums of squares of x (k or q) and of k."""
    r = i * 16 + tl.arange(0, 16)
    off = ((t0 + r).to(tl.int64) * H + h)[:, None] * K + col0 + tl.arange(0, BK)[None, :]
    msk = (r < n)[:, None]
    k = tl.load(k_ptr + off, mask=msk, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + off, mask=msk, other=0.0).to(tl.float32)
    if QK:
        x = tl.load(q_ptr + off, mask=msk, other=0.0).to(tl.float32)
    else:
        x = k
    ek, ex = _diag_exact(x, k, tl.cumsum(g, axis=0))
    return ex, ek, tl.sum(x * x, axis=1), tl.sum(k * k, axis=1)


@triton.jit
def _exact_fix(e, sx, sk, scale, L2NORM: tl.constexpr, QK: tl.constexpr):
    """Norms and the causal mask applied to an exact raw diagonal block."""
    r = tl.arange(0, 16)
    if QK:
        e = tl.where(r[:, None] >= r[None, :], e, 0.0)
        sc = scale
    else:
        e = tl.where(r[:, None] > r[None, :], e, 0.0)
        sc = 1.0
    return e * _norm(sx, sc, L2NORM)[:, None] * _norm(sk, 1.0, L2NORM)[None, :]


@triton.jit
def _exact_diag_blocks(
    q_ptr,
    k_ptr,
    g_ptr,
    t0,
    n,
    h,
    H,
    scale,
    K: tl.constexpr,
    BK: tl.constexpr,
    L2NORM: tl.constexpr,
    QK: tl.constexpr,
):
    """The four diagonal 16x16 blocks of the k-k matrix (QK False: k̂_t·k̂_s e^{G_t-G_s}, strictly lower, no β)
    or of the q-k matrix (QK True: inclusive) by the exact pairwise form, for decays too strong to factor:
    key s and the gates are taken row by row, nothing is factored."""
    z16 = tl.zeros([16, 16], dtype=tl.float32)
    zv = tl.zeros([16], dtype=tl.float32)
    e0, e1, e2, e3 = z16, z16, z16, z16
    sx0, sx1, sx2, sx3, sk0, sk1, sk2, sk3 = zv, zv, zv, zv, zv, zv, zv, zv
    for kb in range(K // BK):
        x, y, yx, yk = _exact_sub(q_ptr, k_ptr, g_ptr, t0, n, 0, h, H, K, kb * BK, BK, QK)
        e0, sx0, sk0 = e0 + x, sx0 + yx, sk0 + yk
        x, y, yx, yk = _exact_sub(q_ptr, k_ptr, g_ptr, t0, n, 1, h, H, K, kb * BK, BK, QK)
        e1, sx1, sk1 = e1 + x, sx1 + yx, sk1 + yk
        x, y, yx, yk = _exact_sub(q_ptr, k_ptr, g_ptr, t0, n, 2, h, H, K, kb * BK, BK, QK)
        e2, sx2, sk2 = e2 + x, sx2 + yx, sk2 + yk
        x, y, yx, yk = _exact_sub(q_ptr, k_ptr, g_ptr, t0, n, 3, h, H, K, kb * BK, BK, QK)
        e3, sx3, sk3 = e3 + x, sx3 + yx, sk3 + yk
    e0 = _exact_fix(e0, sx0, sk0, scale, L2NORM, QK)
    e1 = _exact_fix(e1, sx1, sk1, scale, L2NORM, QK)
    e2 = _exact_fix(e2, sx2, sk2, scale, L2NORM, QK)
    e3 = _exact_fix(e3, sx3, sk3, scale, L2NORM, QK)
    return e0, e1, e2, e3


@triton.jit
def _ld_beta(b_ptr, t0, n, i: tl.constexpr, h, H):
    r = i * 16 + tl.arange(0, 16)
    return tl.load(b_ptr + (t0 + r).to(tl.int64) * H + h, mask=r < n, other=0.0).to(tl.float32)


@triton.jit
def _block_span(span, i: tl.constexpr):
    return tl.max(tl.where(tl.arange(0, 64) // 16 == i, span, 0.0), axis=0)


@triton.jit
def _gated(
    x_ptr,
    k_ptr,
    g_ptr,
    off,
    m,
    blk,
    first,
    BK: tl.constexpr,
    PREC: tl.constexpr,
    QK: tl.constexpr,
    acc,
    sx,
    sk,
    span,
):
    """One K slice of the gated matrix X K̂ᵀ (raw x = q if QK else k): acc += Σ_d x_t k_s e^{G_t-G_s} for s <= t
    (upper triangle: finite junk, masked later); also the row sums of squares of x and k, and the decay spans
    of the 16-token blocks (per row)."""
    k = tl.load(k_ptr + off, mask=m[:, None], other=0.0).to(tl.float32)
    if QK:
        x = tl.load(x_ptr + off, mask=m[:, None], other=0.0).to(tl.float32)
        sk += tl.sum(k * k, axis=1)
    else:
        x = k
    g = tl.load(g_ptr + off, mask=m[:, None], other=0.0).to(tl.float32)
    sx += tl.sum(x * x, axis=1)
    # in-block cumulative log-decay L and block totals S (all exponents are formed from these)
    L, _ = tl.associative_scan((g, tl.broadcast_to(first, [64, BK])), 0, _seg_add)
    S0 = tl.sum(tl.where(blk == 0, g, 0.0), axis=0)
    S1 = tl.sum(tl.where(blk == 1, g, 0.0), axis=0)
    S2 = tl.sum(tl.where(blk == 2, g, 0.0), axis=0)
    S3 = tl.sum(tl.where(blk == 3, g, 0.0), axis=0)
    Sb = _bsel(blk, S0[None, :], S1[None, :], S2[None, :], S3[None, :])
    span = tl.maximum(span, tl.max(-Sb, axis=1))
    xs = x * tl.exp(L)  # x e^{G_t - c_i}, row t in block i (c_i: G at the block start)
    ke = k * tl.exp(Sb - L)  # k e^{c_{j+1} - G_s} <= 1, key s in block j
    # key block j against rows of block j (diagonal block: e^{c_j - c_{j+1}}, at most e^80, larger spans are
    # flagged and redone exactly) and of blocks i > j (e^{c_i - c_{j+1}} <= 1); the four as one product,
    # key block j in column group j of the contraction
    u0 = tl.exp(tl.minimum(-S0, 80.0))[None, :]
    u1 = tl.exp(tl.minimum(-S1, 80.0))[None, :]
    u2 = tl.exp(tl.minimum(-S2, 80.0))[None, :]
    u3 = tl.exp(tl.minimum(-S3, 80.0))[None, :]
    f1 = tl.exp(S1)[None, :]
    f2 = tl.exp(S2)[None, :]
    xc = _cat4(
        xs * _bsel(blk, u0, 1.0, f1, f1 * f2),
        xs * _bsel(blk, 0.0, u1, 1.0, f2),
        xs * _bsel(blk, 0.0, 0.0, u2, 1.0),
        xs * tl.where(blk == 3, u3, 0.0),
    )
    kc = _cat4(
        tl.where(blk == 0, ke, 0.0),
        tl.where(blk == 1, ke, 0.0),
        tl.where(blk == 2, ke, 0.0),
        tl.where(blk == 3, ke, 0.0),
    )
    return tl.dot(xc, tl.trans(kc), acc, input_precision=PREC), sx, sk, span


@triton.jit
def _norm(sx, scale, L2NORM: tl.constexpr):
    if L2NORM:
        return tl.rsqrt(sx + 1e-6) * scale
    else:
        return sx * 0.0 + scale


@triton.jit
def _split_intra(
    q_ptr,
    k_ptr,
    g_ptr,
    b_ptr,
    aqk_ptr,
    t_ptr,
    rq_ptr,
    rk_ptr,
    flag_ptr,
    c,
    h,
    t0,
    n,
    scale,
    H,
    K: tl.constexpr,
    BK: tl.constexpr,
    L2NORM: tl.constexpr,
    PREC: tl.constexpr,
    EXACT: tl.constexpr,
):
    """Part (a) for one chunk: stores T' (lower 16x16 blocks only: the upper ones are never read), the q-k
    matrix and the per-token norm factors (q's including `scale`). Two passes over K, one accumulator each:
    the k-k matrix (then T'), then the q-k matrix.

    EXACT False: diagonal blocks only in the factored form; stores flag = (some 16-token block's decay span
    reaches 80), in which case the chunk must be redone with EXACT True (which redoes such blocks exactly).
    """
    rt = tl.arange(0, 64)
    m = rt < n
    base = (t0 + rt).to(tl.int64) * H + h
    blk = (rt // 16)[:, None]
    first = (rt % 16 == 0)[:, None]
    r2 = rt[:, None]
    c2 = rt[None, :]
    # ---- pass 1: the q-k matrix (q̂_t·k̂_s e^{G_t-G_s}) inclusive, and the norms
    acc = tl.zeros([64, 64], dtype=tl.float32)
    sq = tl.zeros([64], dtype=tl.float32)
    sk = tl.zeros([64], dtype=tl.float32)
    span = tl.zeros([64], dtype=tl.float32)
    for kb in range(K // BK):
        off = base[:, None] * K + kb * BK + tl.arange(0, BK)[None, :]
        acc, sq, sk, span = _gated(q_ptr, k_ptr, g_ptr, off, m, blk, first, BK, PREC, True, acc, sq, sk, span)
    rq = _norm(sq, scale, L2NORM)
    rk = _norm(sk, 1.0, L2NORM)
    tl.store(rq_ptr + base, rq, mask=m)
    tl.store(rk_ptr + base, rk, mask=m)
    p = tl.where(r2 >= c2, acc, 0.0) * rq[:, None] * rk[None, :]
    if EXACT:  # blocks whose decay span reaches 80 are stored exactly below (their factored values unused)
        redo = (blk == tl.trans(blk)) & (span >= 80.0)[:, None]
        tl.store(aqk_ptr + base[:, None] * 64 + c2, p.to(aqk_ptr.dtype.element_ty), mask=m[:, None] & ~redo)
        sp0 = _block_span(span, 0)
        sp1 = _block_span(span, 1)
        sp2 = _block_span(span, 2)
        sp3 = _block_span(span, 3)
        if tl.maximum(tl.maximum(sp0, sp1), tl.maximum(sp2, sp3)) >= 80.0:
            e0, e1, e2, e3 = _exact_diag_blocks(q_ptr, k_ptr, g_ptr, t0, n, h, H, scale, K, BK, L2NORM, True)
            _store_rows(aqk_ptr, e0, t0, tl.where(sp0 >= 80.0, n, 0), 0, h, H, 16, 0, 64)
            _store_rows(aqk_ptr, e1, t0, tl.where(sp1 >= 80.0, n, 0), 1, h, H, 16, 16, 64)
            _store_rows(aqk_ptr, e2, t0, tl.where(sp2 >= 80.0, n, 0), 2, h, H, 16, 32, 64)
            _store_rows(aqk_ptr, e3, t0, tl.where(sp3 >= 80.0, n, 0), 3, h, H, 16, 48, 64)
    else:
        tl.store(aqk_ptr + base[:, None] * 64 + c2, p.to(aqk_ptr.dtype.element_ty), mask=m[:, None])
        tl.store(flag_ptr + c.to(tl.int64) * H + h, (tl.max(span, axis=0) >= 80.0).to(tl.int32))
    # ---- pass 2: A = diag(β) (k̂_t·k̂_s e^{G_t-G_s}) strictly lower
    acc = tl.zeros([64, 64], dtype=tl.float32)
    for kb in range(K // BK):
        off = base[:, None] * K + kb * BK + tl.arange(0, BK)[None, :]
        acc, sk, sk, span = _gated(
            k_ptr, k_ptr, g_ptr, off, m, blk, first, BK, PREC, False, acc, sk, sk, span
        )
    beta = tl.load(b_ptr + base, mask=m, other=0.0).to(tl.float32)
    a = tl.where(r2 > c2, acc, 0.0) * (beta * rk)[:, None] * rk[None, :]
    # ---- its 16x16 blocks -> T' = (I + A)^-1 diag(β)
    a01, a23 = _rows2(a)
    r0, r1 = _rows2(a01)
    rr2, r3 = _rows2(a23)
    lft, _ = _cols2(r0)
    a00, _ = _cols2(lft)
    lft, _ = _cols2(r1)
    a10, a11 = _cols2(lft)
    lft, rgt = _cols2(rr2)
    a20, a21 = _cols2(lft)
    a22, _ = _cols2(rgt)
    lft, rgt = _cols2(r3)
    a30, a31 = _cols2(lft)
    a32, a33 = _cols2(rgt)
    b0 = _ld_beta(b_ptr, t0, n, 0, h, H)
    b1 = _ld_beta(b_ptr, t0, n, 1, h, H)
    b2 = _ld_beta(b_ptr, t0, n, 2, h, H)
    b3 = _ld_beta(b_ptr, t0, n, 3, h, H)
    if EXACT:
        sp0 = _block_span(span, 0)
        sp1 = _block_span(span, 1)
        sp2 = _block_span(span, 2)
        sp3 = _block_span(span, 3)
        if tl.maximum(tl.maximum(sp0, sp1), tl.maximum(sp2, sp3)) >= 80.0:
            e0, e1, e2, e3 = _exact_diag_blocks(q_ptr, k_ptr, g_ptr, t0, n, h, H, scale, K, BK, L2NORM, False)
            a00 = tl.where(sp0 >= 80.0, e0 * b0[:, None], a00)
            a11 = tl.where(sp1 >= 80.0, e1 * b1[:, None], a11)
            a22 = tl.where(sp2 >= 80.0, e2 * b2[:, None], a22)
            a33 = tl.where(sp3 >= 80.0, e3 * b3[:, None], a33)
    t00 = _inv16(a00, PREC)
    _store_rows(t_ptr, t00 * b0[None, :], t0, n, 0, h, H, 16, 0, 64)
    t11 = _inv16(a11, PREC)
    t10 = -_mm16(t11, _mm16(a10, t00))
    _store_rows(t_ptr, t10 * b0[None, :], t0, n, 1, h, H, 16, 0, 64)
    _store_rows(t_ptr, t11 * b1[None, :], t0, n, 1, h, H, 16, 16, 64)
    t22 = _inv16(a22, PREC)
    t21 = -_mm16(t22, _mm16(a21, t11))
    t20 = -_mm16(t22, _mm16(a20, t00) + _mm16(a21, t10))
    _store_rows(t_ptr, t20 * b0[None, :], t0, n, 2, h, H, 16, 0, 64)
    _store_rows(t_ptr, t21 * b1[None, :], t0, n, 2, h, H, 16, 16, 64)
    _store_rows(t_ptr, t22 * b2[None, :], t0, n, 2, h, H, 16, 32, 64)
    t33 = _inv16(a33, PREC)
    t32 = -_mm16(t33, _mm16(a32, t22))
    t31 = -_mm16(t33, _mm16(a31, t11) + _mm16(a32, t21))
    t30 = -_mm16(t33, _mm16(a30, t00) + _mm16(a31, t10) + _mm16(a32, t20))
    _store_rows(t_ptr, t30 * b0[None, :], t0, n, 3, h, H, 16, 0, 64)
    _store_rows(t_ptr, t31 * b1[None, :], t0, n, 3, h, H, 16, 16, 64)
    _store_rows(t_ptr, t32 * b2[None, :], t0, n, 3, h, H, 16, 32, 64)
    _store_rows(t_ptr, t33 * b3[None, :], t0, n, 3, h, H, 16, 48, 64)


@triton.jit
def _load_tinv(t_ptr, base, m):
    """T' of a chunk as one 64x64 tile (upper blocks are masked, never read)."""
    rt = tl.arange(0, 64)
    return tl.load(
        t_ptr + base[:, None] * 64 + rt[None, :], mask=m[:, None] & (rt[None, :] <= rt[:, None]), other=0.0
    )


@triton.jit
def _wu_cols(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    rq_ptr,
    rk_ptr,
    w_ptr,
    u_ptr,
    qg_ptr,
    kd_ptr,
    gend_ptr,
    tm,
    c,
    h,
    base,
    m,
    j,
    H,
    K: tl.constexpr,
    V: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
):
    """Part (b), columns j*BN..j*BN+BN of the K side (W, q̂e^G, k̂e^{G_n-G}, e^{G_n}) and of the V side (U)."""
    cols = j * BN + tl.arange(0, BN)
    if j * BN < K:
        off = base[:, None] * K + cols[None, :]
        g = tl.load(g_ptr + off, mask=m[:, None], other=0.0).to(tl.float32)
        G = tl.cumsum(g, axis=0)
        gn = tl.sum(g, axis=0)
        e = tl.exp(G)
        rk = tl.load(rk_ptr + base, mask=m, other=0.0)
        kx = tl.load(k_ptr + off, mask=m[:, None], other=0.0).to(tl.float32) * rk[:, None]
        w = tl.dot(tm, (kx * e).to(tm.dtype), input_precision=PREC)
        tl.store(w_ptr + off, w.to(w_ptr.dtype.element_ty), mask=m[:, None])
        tl.store(kd_ptr + off, (kx * tl.exp(gn[None, :] - G)).to(kd_ptr.dtype.element_ty), mask=m[:, None])
        rq = tl.load(rq_ptr + base, mask=m, other=0.0)
        qx = tl.load(q_ptr + off, mask=m[:, None], other=0.0).to(tl.float32) * rq[:, None]
        tl.store(qg_ptr + off, (qx * e).to(qg_ptr.dtype.element_ty), mask=m[:, None])
        tl.store(gend_ptr + (c.to(tl.int64) * H + h) * K + cols, tl.exp(gn))
    if j * BN < V:
        off = base[:, None] * V + cols[None, :]
        x = tl.load(v_ptr + off, mask=m[:, None], other=0.0)
        u = tl.dot(tm, x.to(tm.dtype), input_precision=PREC)
        tl.store(u_ptr + off, u.to(u_ptr.dtype.element_ty), mask=m[:, None])


@triton.jit(do_not_specialize=["H", "NCH"])
def _kda_intra_kernel(
    q_ptr,
    k_ptr,
    g_ptr,
    b_ptr,
    aqk_ptr,
    t_ptr,
    rq_ptr,
    rk_ptr,
    flag_ptr,
    cstart_ptr,
    clen_ptr,
    scale,
    H,
    NCH,
    K: tl.constexpr,
    BK: tl.constexpr,
    L2NORM: tl.constexpr,
    PREC: tl.constexpr,
    MODE: tl.constexpr,
):
    """Part (a). MODE 0: one program per (chunk, head), factored diagonal blocks, flags the chunks that need
    MODE 1; MODE 1: a few persistent programs walk all NCH (chunk, head) pairs and redo the flagged ones
    (exact diagonal blocks where needed); MODE 2: one program per (chunk, head), exact fallback inline."""
    if MODE == 1:
        for i in range(tl.program_id(0), NCH, tl.num_programs(0)):
            if tl.load(flag_ptr + i) != 0:
                c = i // H
                h = i % H
                t0 = tl.load(cstart_ptr + c)
                n = tl.load(clen_ptr + c)
                _split_intra(
                    q_ptr,
                    k_ptr,
                    g_ptr,
                    b_ptr,
                    aqk_ptr,
                    t_ptr,
                    rq_ptr,
                    rk_ptr,
                    flag_ptr,
                    c,
                    h,
                    t0,
                    n,
                    scale,
                    H,
                    K,
                    BK,
                    L2NORM,
                    PREC,
                    True,
                )
    else:
        c = tl.program_id(0)
        h = tl.program_id(1)
        t0 = tl.load(cstart_ptr + c)
        n = tl.load(clen_ptr + c)
        _split_intra(
            q_ptr,
            k_ptr,
            g_ptr,
            b_ptr,
            aqk_ptr,
            t_ptr,
            rq_ptr,
            rk_ptr,
            flag_ptr,
            c,
            h,
            t0,
            n,
            scale,
            H,
            K,
            BK,
            L2NORM,
            PREC,
            MODE == 2,
        )


@triton.jit(do_not_specialize=["H"])
def _kda_wu_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    rq_ptr,
    rk_ptr,
    t_ptr,
    w_ptr,
    u_ptr,
    qg_ptr,
    kd_ptr,
    gend_ptr,
    cstart_ptr,
    clen_ptr,
    H,
    K: tl.constexpr,
    V: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
):
    """Part (b): program (chunk, head, column tile j)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.program_id(2)
    t0 = tl.load(cstart_ptr + c)
    n = tl.load(clen_ptr + c)
    rt = tl.arange(0, 64)
    m = rt < n
    base = (t0 + rt).to(tl.int64) * H + h
    tm = _load_tinv(t_ptr, base, m)
    _wu_cols(
        q_ptr,
        k_ptr,
        v_ptr,
        g_ptr,
        rq_ptr,
        rk_ptr,
        w_ptr,
        u_ptr,
        qg_ptr,
        kd_ptr,
        gend_ptr,
        tm,
        c,
        h,
        base,
        m,
        j,
        H,
        K,
        V,
        BN,
        PREC,
    )


@triton.jit
def _onepass(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    b_ptr,
    w_ptr,
    u_ptr,
    qg_ptr,
    kd_ptr,
    aqk_ptr,
    gend_ptr,
    t_ptr,
    rq_ptr,
    rk_ptr,
    flag_ptr,
    c,
    h,
    t0,
    n,
    scale,
    H,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BN: tl.constexpr,
    NJ: tl.constexpr,
    L2NORM: tl.constexpr,
    PREC: tl.constexpr,
    EXACT: tl.constexpr,
):
    _split_intra(
        q_ptr,
        k_ptr,
        g_ptr,
        b_ptr,
        aqk_ptr,
        t_ptr,
        rq_ptr,
        rk_ptr,
        flag_ptr,
        c,
        h,
        t0,
        n,
        scale,
        H,
        K,
        BK,
        L2NORM,
        PREC,
        EXACT,
    )
    tl.debug_barrier()  # this CTA's stores of T' and the norms are visible to all its threads
    rt = tl.arange(0, 64)
    m = rt < n
    base = (t0 + rt).to(tl.int64) * H + h
    tm = _load_tinv(t_ptr, base, m)
    for j in tl.static_range(NJ):
        _wu_cols(
            q_ptr,
            k_ptr,
            v_ptr,
            g_ptr,
            rq_ptr,
            rk_ptr,
            w_ptr,
            u_ptr,
            qg_ptr,
            kd_ptr,
            gend_ptr,
            tm,
            c,
            h,
            base,
            m,
            j,
            H,
            K,
            V,
            BN,
            PREC,
        )


@triton.jit(do_not_specialize=["H", "NCH"])
def _kda_prep_onepass_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    b_ptr,
    w_ptr,
    u_ptr,
    qg_ptr,
    kd_ptr,
    aqk_ptr,
    gend_ptr,
    t_ptr,
    rq_ptr,
    rk_ptr,
    flag_ptr,
    cstart_ptr,
    clen_ptr,
    scale,
    H,
    NCH,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BN: tl.constexpr,
    NJ: tl.constexpr,
    L2NORM: tl.constexpr,
    PREC: tl.constexpr,
    MODE: tl.constexpr,
):
    """Parts (a) and (b) in one program (T' and the norms pass through L1/L2 between them); grid and MODE as in
    `_kda_intra_kernel`."""
    if MODE == 1:
        for i in range(tl.program_id(0), NCH, tl.num_programs(0)):
            if tl.load(flag_ptr + i) != 0:
                c = i // H
                h = i % H
                t0 = tl.load(cstart_ptr + c)
                n = tl.load(clen_ptr + c)
                _onepass(
                    q_ptr,
                    k_ptr,
                    v_ptr,
                    g_ptr,
                    b_ptr,
                    w_ptr,
                    u_ptr,
                    qg_ptr,
                    kd_ptr,
                    aqk_ptr,
                    gend_ptr,
                    t_ptr,
                    rq_ptr,
                    rk_ptr,
                    flag_ptr,
                    c,
                    h,
                    t0,
                    n,
                    scale,
                    H,
                    K,
                    V,
                    BK,
                    BN,
                    NJ,
                    L2NORM,
                    PREC,
                    True,
                )
    else:
        c = tl.program_id(0)
        h = tl.program_id(1)
        t0 = tl.load(cstart_ptr + c)
        n = tl.load(clen_ptr + c)
        _onepass(
            q_ptr,
            k_ptr,
            v_ptr,
            g_ptr,
            b_ptr,
            w_ptr,
            u_ptr,
            qg_ptr,
            kd_ptr,
            aqk_ptr,
            gend_ptr,
            t_ptr,
            rq_ptr,
            rk_ptr,
            flag_ptr,
            c,
            h,
            t0,
            n,
            scale,
            H,
            K,
            V,
            BK,
            BN,
            NJ,
            L2NORM,
            PREC,
            MODE == 2,
        )


def _fixup_programs(dev: torch.device, nch: int) -> int:
    """Programs of a MODE 1 launch: enough to walk the flags fast, few enough to start at once."""
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
    return max(1, min(nch, sms))


class ChunkPlan:
    """The chunk grid of a call (device int32 tensors) plus checkpoint copies done after the launch.

    chunk_start/chunk_len [NC]: token range of each chunk (<= 64 tokens, never crossing a sequence or a
    checkpoint offset); seq_first [B+1]: chunks of sequence b are seq_first[b]..seq_first[b+1]-1;
    chunk_ckpt [NC]: slot that receives the state after the chunk, or -1; extra_copies: (src, dst) slot
    pairs for further checkpoints at an offset that already has one.
    """

    def __init__(
        self, cu: list[int], slots: list[int], ckpts: dict[int, list[tuple[int, int]]], device: torch.device
    ):
        cu_t = torch.tensor(cu, dtype=torch.int64)
        lens = cu_t[1:] - cu_t[:-1]
        B = len(cu) - 1
        self.extra_copies: list[tuple[int, int]] = []
        if not ckpts:
            nch = (lens + BT - 1) // BT
            first = torch.zeros(B + 1, dtype=torch.int64)
            first[1:] = torch.cumsum(nch, 0)
            NC = int(first[-1])
            seq = torch.repeat_interleave(torch.arange(B), nch)
            idx = torch.arange(NC) - first[seq]
            start = cu_t[seq] + BT * idx
            length = torch.minimum(cu_t[seq + 1] - start, torch.tensor(BT))
            ck = torch.full((NC,), -1, dtype=torch.int64)
        else:
            starts, lengths, cks, firsts = [], [], [], [0]
            for b in range(B):
                L = cu[b + 1] - cu[b]
                marks = ckpts.get(b, []) if slots[b] >= 0 else []
                by_off: dict[int, list[int]] = {}
                for off, s in marks:
                    by_off.setdefault(off, []).append(s)
                cuts = sorted(set(range(0, L, BT)) | {off for off in by_off if 0 < off < L})
                for j, s0 in enumerate(cuts):
                    e0 = cuts[j + 1] if j + 1 < len(cuts) else L
                    starts.append(cu[b] + s0)
                    lengths.append(e0 - s0)
                    ss = by_off.get(e0, [])
                    cks.append(ss[0] if ss else -1)
                    self.extra_copies.extend((ss[0], d) for d in ss[1:])
                firsts.append(len(starts))
            start = torch.tensor(starts, dtype=torch.int64)
            length = torch.tensor(lengths, dtype=torch.int64)
            ck = torch.tensor(cks, dtype=torch.int64)
            first = torch.tensor(firsts, dtype=torch.int64)
        self.num_chunks = int(start.numel())
        self.chunk_start, self.chunk_len, self.chunk_ckpt, self.seq_first = upload_int32(
            [start, length, ck, first], device)


def upload_int32(parts: list, device: torch.device) -> list[torch.Tensor]:
    """Host integer tensors / lists -> int32 tensors on `device`, in ONE copy. On CUDA the packed buffer is pinned
    and copied with non_blocking=True: the host does not wait for the stream (a copy from pageable memory does).
    Every part starts 16-byte aligned in the packed buffer (Triton specializes pointers on that)."""
    ts = [p.to(torch.int32) if isinstance(p, torch.Tensor) else torch.tensor(p, dtype=torch.int32) for p in parts]
    sizes = [t.numel() for t in ts]
    room = [-(-n // 4) * 4 for n in sizes]
    flat = torch.zeros(sum(room), dtype=torch.int32)
    at = 0
    for t, r in zip(ts, room):
        flat[at : at + t.numel()] = t.reshape(-1)
        at += r
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    elif flat.device != device:
        flat = flat.to(device)
    return [v[:n] for v, n in zip(flat.split(room), sizes)]


PLAN_CACHE_SIZE = 8
"""Plans kept by `_call_plan`: one per KDA cache group of a step (a layout has a few groups, each with its own
state slots, and consecutive KDA layers belong to different groups), so every group's plan is built once per
engine step, not once per layer. 1 keeps only the last call's (session 8's behaviour: 18 builds per step of the
small preset, each with its host reads)."""
_PLANS: list = []  # (refs, versions, T, device, plan tuple), most recent first: see _call_plan
PLAN_BUILDS = [0]  # plans built so far (tests count them)


def _call_plan(T, dev, cu_seqlens, state_indices, has_initial_state, checkpoint_seq, checkpoint_offsets,
               checkpoint_slots, host=None):
    """The host-side view of a call's batch: (cu list, B, ChunkPlan, slots and has-initial-state as int32 on dev).

    With `host` (a _varlen.HostVarlen: the engine's host copies of the index arguments) it is built from those lists,
    no device read, and kept in `host.memo` for the group's later layers. Without it, building reads cu_seqlens /
    slots / flags (/ checkpoints) back from the device (host syncs); the engine passes the SAME tensors to every KDA
    layer of one cache group in a step, so the results of the last PLAN_CACHE_SIZE calls are kept and one is reused
    while every argument is the very same tensor object (weak references; a freed and re-allocated tensor never
    matches) at the same version counter (an in-place write invalidates it): one build per group and engine step
    instead of one per layer. Sequences passed as Python lists are never cached. Either way the device tensors are
    uploaded in one non-blocking copy (`upload_int32`).
    """
    if host is not None:
        key = ("kda_chunk", T, dev)
        hit = host.memo.get(key)
        if hit is None:
            hit = host.memo[key] = _build_plan(T, dev, host.cu_seqlens, host.state_indices, host.has_initial_state,
                                               host.checkpoint_seq, host.checkpoint_offsets, host.checkpoint_slots)
        return hit
    args = (cu_seqlens, state_indices, has_initial_state, checkpoint_seq, checkpoint_offsets, checkpoint_slots)
    cacheable = all(a is None or isinstance(a, torch.Tensor) for a in args)
    if cacheable:
        versions = tuple(None if a is None else a._version for a in args)
        for i, entry in enumerate(_PLANS):
            if entry[2] == T and entry[3] == dev and entry[1] == versions and all(
                (r is None and a is None) or (r is not None and r() is a) for r, a in zip(entry[0], args)
            ):
                if i:
                    _PLANS.insert(0, _PLANS.pop(i))
                return entry[4]
    result = _build_plan(T, dev, *args)
    if cacheable:
        refs = tuple(None if a is None else weakref.ref(a) for a in args)
        _PLANS.insert(0, (refs, versions, T, dev, result))
        del _PLANS[max(1, PLAN_CACHE_SIZE):]
    return result


def _build_plan(T, dev, cu_seqlens, state_indices, has_initial_state, checkpoint_seq, checkpoint_offsets,
                checkpoint_slots):
    """`_call_plan`'s build (tensors are read back: host syncs on CUDA; lists are taken as they are)."""
    PLAN_BUILDS[0] += 1
    cu = _varlen.seq_starts(cu_seqlens)
    if cu[-1] > T:
        raise ValueError(f"cu_seqlens ends at {cu[-1]} but there are only {T} tokens")
    B = len(cu) - 1
    slots = _varlen.int_list(state_indices, B, "state_indices")
    init = _varlen.bool_list(has_initial_state, B, "has_initial_state")
    lens = [cu[b + 1] - cu[b] for b in range(B)]
    ckpts = _varlen.checkpoints_by_seq(checkpoint_seq, checkpoint_offsets, checkpoint_slots, lens, min_offset=1)
    plan = ChunkPlan(cu, slots, ckpts, dev)
    slots_t, init_t = upload_int32([slots, [int(x) for x in init]], dev)
    return cu, B, plan, slots_t, init_t


def check_pool(pool: torch.Tensor) -> None:
    """A slot pool [S, ...] may have any slot stride, but each slot must be contiguous."""
    if pool.shape[0] and not pool[0].is_contiguous():
        raise ValueError("each slot of the state pool must be contiguous")


def supported(q, k, v, g, beta, state_pool) -> bool:
    """Shapes/dtypes the Triton KDA kernels handle (others go to the reference)."""
    K, V = q.shape[-1], v.shape[-1]
    ok_dim = all(d >= 16 and (d & (d - 1)) == 0 for d in (K, V)) and K <= 256 and V <= 256
    f64 = any(t.dtype == torch.float64 for t in (q, k, v, g, beta, state_pool))
    return ok_dim and not f64 and q.is_cuda == state_pool.is_cuda


PREP_VARIANTS = ("fused", "split", "onepass")


def kda_chunked_triton(
    q,
    k,
    v,
    g,
    beta,
    state_pool,
    state_indices,
    cu_seqlens,
    has_initial_state,
    *,
    scale=None,
    use_qk_l2norm=True,
    checkpoint_seq=None,
    checkpoint_offsets=None,
    checkpoint_slots=None,
    chunk_size=64,
    prep_variant="fused",
    prep_num_warps=None,
    prep_maxnreg="auto",
    intra_block_k=16,
    intra_num_stages=2,
    wu_num_warps=4,
    wu_block_n=32,
    tinv_fp32=False,
    exact_inline=False,
    host=None,
):
    """Triton implementation of `reference.kda_chunked` (same arguments and result; see module doc).

    `chunk_size` is accepted for signature compatibility; the kernels always use 64-token chunks (the
    result is the same function). The chunk grid is built on the host: from `host` (a _varlen.HostVarlen, the
    index arguments as lists: no device read) or, without it, from cu_seqlens / slots / flags / checkpoints read
    back (host syncs, once per group and step: `_call_plan`).

    Tuning knobs (every combination computes the same function, for every input this wrapper takes):
    prep_variant: "fused" (one `_kda_prep_kernel` per (chunk, head)); "split": `_kda_intra_kernel` per
    (chunk, head) forms the gated q-k and k-k matrices as 64x64 tl.dot accumulators over K slices of
    `intra_block_k` columns (two passes, one accumulator each), stores the q-k matrix, the norms and the
    explicit T' = (I + A)^-1 diag(β) (16x16 inverses + block merge), then `_kda_wu_kernel` per (chunk,
    head, `wu_block_n` columns) forms G, W = T' (k̂ e^G), U = T' V (64-row tl.dot tiles), q̂ e^G,
    k̂ e^{G_n-G}, e^{G_n}; "onepass": both parts in one program (T' and the norms through L1/L2).
    prep_num_warps: warps of the fused (default 8 if K >= 128 else 4) or intra / onepass kernel (default 8);
    prep_maxnreg: register cap of the intra / onepass kernel ("auto": 128 at 8 warps = 2 CTAs/SM, else
    none; None: none); intra_num_stages: software pipelining of its K loops; wu_num_warps: warps of
    `_kda_wu_kernel`; tinv_fp32: T' in fp32 (tf32 W/U products) for 16-bit inputs instead of the
    activation dtype (16-bit products, as FLA's recompute_w_u); fp32 inputs always use fp32 + ieee.
    Split/onepass decay-span fallback: the main launch factors every diagonal block and flags chunks
    with a 16-token block whose span reaches 80; a second, persistent launch redoes only flagged chunks
    with exact diagonal blocks (exact_inline=True: one launch with the exact path inline instead).
    """
    if prep_variant not in PREP_VARIANTS:
        raise ValueError(f"prep_variant must be one of {PREP_VARIANTS}, got {prep_variant!r}")
    T, H, K = q.shape
    V = v.shape[-1]
    if tuple(state_pool.shape[1:]) != (H, V, K):
        raise ValueError(f"state_pool {tuple(state_pool.shape)} must be [num_slots, {H}, {V}, {K}]")
    check_pool(state_pool)
    scale = K**-0.5 if scale is None else float(scale)
    dev = q.device
    cu, B, plan, slots_t, init_t = _call_plan(
        T, dev, cu_seqlens, state_indices, has_initial_state, checkpoint_seq, checkpoint_offsets, checkpoint_slots,
        host,
    )
    if prep_variant == "fused":  # q, k, v at any token stride (column slices of the conv's output: no copies)
        q, k, v = (t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous() for t in (q, k, v))
        g, beta = g.contiguous(), beta.contiguous()
    else:
        q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    idt = inter_dtype(q.dtype)
    prec = dot_precision(idt)
    o = torch.empty(v.shape, dtype=v.dtype, device=dev)
    if T > cu[-1]:
        o[cu[-1] :].zero_()
    NC = plan.num_chunks
    w = torch.empty(T, H, K, dtype=idt, device=dev)
    u = torch.empty(T, H, V, dtype=idt, device=dev)
    qg = torch.empty(T, H, K, dtype=idt, device=dev)
    kd = torch.empty(T, H, K, dtype=idt, device=dev)
    aqk = torch.empty(T, H, BT, dtype=idt, device=dev)
    gend = torch.empty(max(NC, 1), H, K, dtype=torch.float32, device=dev)
    if NC:
        l2 = bool(use_qk_l2norm)
        if prep_variant == "fused":
            _kda_prep_kernel[(NC, H)](
                q,
                k,
                v,
                g,
                beta,
                w,
                u,
                qg,
                kd,
                aqk,
                gend,
                plan.chunk_start,
                plan.chunk_len,
                scale,
                H,
                q.stride(0),
                k.stride(0),
                v.stride(0),
                K=K,
                V=V,
                L2NORM=l2,
                PREC=prec,
                num_warps=prep_num_warps or (8 if K >= 128 else 4),
            )
        else:
            tinv = torch.empty(T, H, BT, dtype=torch.float32 if tinv_fp32 else idt, device=dev)
            rq = torch.empty(T, H, dtype=torch.float32, device=dev)
            rk = torch.empty(T, H, dtype=torch.float32, device=dev)
            BN = min(int(wu_block_n), K, V)
            BK = min(int(intra_block_k), K)
            for name, x in (("wu_block_n", BN), ("intra_block_k", BK)):
                if x < 16 or x & (x - 1):
                    raise ValueError(f"{name} must be a power of two >= 16, got {x}")
            flags = torch.empty(NC * H, dtype=torch.int32, device=dev)
            nw = prep_num_warps or 8
            main = dict(num_warps=nw, num_stages=intra_num_stages)
            mr = (128 if nw >= 8 else None) if prep_maxnreg == "auto" else prep_maxnreg
            if mr:
                main["maxnreg"] = int(mr)
            # MODE 0 on every chunk, then MODE 1 redoes the (rare) flagged ones; or MODE 2 with it inline
            launches = (
                [((NC, H), 2, main)]
                if exact_inline
                else [((NC, H), 0, main), ((_fixup_programs(dev, NC * H),), 1, dict(num_warps=4))]
            )
            if prep_variant == "split":
                for grid, mode, opts in launches:
                    _kda_intra_kernel[grid](
                        q,
                        k,
                        g,
                        beta,
                        aqk,
                        tinv,
                        rq,
                        rk,
                        flags,
                        plan.chunk_start,
                        plan.chunk_len,
                        scale,
                        H,
                        NC * H,
                        K=K,
                        BK=BK,
                        L2NORM=l2,
                        PREC=prec,
                        MODE=mode,
                        **opts,
                    )
                _kda_wu_kernel[(NC, H, max(K, V) // BN)](
                    q,
                    k,
                    v,
                    g,
                    rq,
                    rk,
                    tinv,
                    w,
                    u,
                    qg,
                    kd,
                    gend,
                    plan.chunk_start,
                    plan.chunk_len,
                    H=H,
                    K=K,
                    V=V,
                    BN=BN,
                    PREC=prec,
                    num_warps=wu_num_warps,
                )
            else:
                for grid, mode, opts in launches:
                    _kda_prep_onepass_kernel[grid](
                        q,
                        k,
                        v,
                        g,
                        beta,
                        w,
                        u,
                        qg,
                        kd,
                        aqk,
                        gend,
                        tinv,
                        rq,
                        rk,
                        flags,
                        plan.chunk_start,
                        plan.chunk_len,
                        scale,
                        H,
                        NC * H,
                        K=K,
                        V=V,
                        BK=BK,
                        BN=BN,
                        NJ=max(K, V) // BN,
                        L2NORM=l2,
                        PREC=prec,
                        MODE=mode,
                        **opts,
                    )
    BV = min(32, V)
    if B:
        _kda_state_kernel[(B, H, V // BV)](
            w,
            u,
            qg,
            kd,
            aqk,
            gend,
            o,
            state_pool,
            slots_t,
            init_t,
            plan.seq_first,
            plan.chunk_start,
            plan.chunk_len,
            plan.chunk_ckpt,
            state_pool.stride(0),
            H=H,
            K=K,
            V=V,
            BV=BV,
            PREC=prec,
            num_warps=8,
            num_stages=2,
        )
    for src, dst in plan.extra_copies:
        state_pool[dst].copy_(state_pool[src])
    return o
