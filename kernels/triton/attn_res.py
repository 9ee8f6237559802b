"""Block Attention Residuals in Triton: residual update, block write, depth-wise softmax mixing over up
to NB+1 sources and the output RMSNorm, fused in one kernel (one program per token row).

Variants (`attn_res_triton(..., variant=)`), same contract (`k3serve.kernels.reference.attn_res`):

* "row" (default): the whole row in registers (BLOCK = next_pow2(D)), the sources visited once with an
  online softmax. Every source costs two block-wide reductions, and the compiler issues no global load
  across the barriers of the previous reduction, so the n source rows are fetched one after the other (one
  DRAM round trip per source and row, one 16-warp program per SM: latency bound).
* "chunk_resident": the row in [TPR, VEC, K] tiles (see below); ALL the HBM loads of the row (partial, delta,
  the n blocks) are issued first and stay in registers as loaded (packed 16-bit), then per-thread partial
  sums of Σ s·w_q·w_norm and Σ s² per source (FMA chains), ONE stacked cross-thread reduction for all the
  logits, the softmax in-thread, pass 2 mixes from the registers (the mixed row stays in registers for
  Σ mix²), then scales and stores. One program per SM (8 warps x 255 registers by default), but a whole row
  (~170 KB) in flight per program instead of one source row. The row takes about (NB + 2)·D·esize /
  (4·32·num_warps) registers per thread: it fits for D=7168, NB=9, bf16 (larger rows spill: use "chunk").
* "chunk": the same two passes with a small footprint: pass 1 is a loop over chunks, software-pipelined
  (cp.async, `num_stages`), pass 2 reads the sources again (L2 hits). Several programs per SM.

Tiles: TPR = 32·num_warps threads, each holding K runs of VEC contiguous elements (one "unit" = TPR·VEC
elements). The partial sums fold VEC and K in-thread, so every accumulator is one register per thread; the
resident row is processed in parts of 2 units (the last of 1), so a width that is a multiple of the unit
(7168 = 7·1024) has no padding. The block written now (write_idx) is not read back in pass 1: its sums
are the partial's (kept apart when the blocks' dtype differs from the partial's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import TL_DTYPE, next_pow2


@triton.jit
def _attn_res_kernel(
    partial_ptr,
    delta_ptr,
    blocks_ptr,
    wn_ptr,
    wq_ptr,
    wo_ptr,
    out_ptr,
    n,
    write_idx,
    eps,
    eps_out,
    p_stride,
    d_stride,
    b_stride,
    o_stride,
    D: tl.constexpr,
    NB: tl.constexpr,
    BLOCK: tl.constexpr,
    PRESCALED: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    HAS_OUT: tl.constexpr,
    ROUND: tl.constexpr,
    ROUND_DT: tl.constexpr,
    P16: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BLOCK)
    m = r < D
    p_ptrs = partial_ptr + t * p_stride + r
    p = tl.load(p_ptrs, mask=m, other=0.0)
    if HAS_DELTA:
        new = p.to(tl.float32) + tl.load(delta_ptr + t * d_stride + r, mask=m, other=0.0).to(tl.float32)
        if ROUND:  # round-to-nearest-even, as torch's casts do (a 16-bit ROUND_DT only)
            new = new.to(ROUND_DT, fp_downcast_rounding="rtne").to(tl.float32)
        if P16:
            p = new.to(partial_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        else:
            p = new.to(partial_ptr.dtype.element_ty)
        tl.store(p_ptrs, p, mask=m)
    brow = blocks_ptr + t * b_stride
    pb = p.to(blocks_ptr.dtype.element_ty)
    if write_idx >= 0:
        tl.store(brow + write_idx * D + r, pb, mask=m)
    wqn = tl.load(wq_ptr + r, mask=m, other=0.0).to(tl.float32)
    if not PRESCALED:
        wqn = wqn * tl.load(wn_ptr + r, mask=m, other=0.0).to(tl.float32)
    pf = p.to(tl.float32)
    mx = tl.sum(pf * wqn, axis=0) * tl.rsqrt(tl.sum(pf * pf, axis=0) / D + eps)
    acc = pf
    den = 1.0
    for i in tl.static_range(NB):  # unrolled so that every source row's load can be in flight at once
        valid = i < n
        s = tl.load(brow + i * D + r, mask=m & valid, other=0.0)
        s = tl.where(i == write_idx, pb, s).to(tl.float32)
        logit = tl.sum(s * wqn, axis=0) * tl.rsqrt(tl.sum(s * s, axis=0) / D + eps)
        logit = tl.where(valid, logit, float("-inf"))
        m_new = tl.maximum(mx, logit)
        a = tl.exp(mx - m_new)
        b = tl.exp(logit - m_new)
        acc = acc * a + s * b
        den = den * a + b
        mx = m_new
    mix = acc / den
    if HAS_OUT:
        mix = mix * tl.rsqrt(tl.sum(mix * mix, axis=0) / D + eps_out)
        mix = mix * tl.load(wo_ptr + r, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * o_stride + r, mix.to(out_ptr.dtype.element_ty), mask=m)


# ------------------------------------------------------------------------------------------ "chunk" variants
# (tiles, parts and accumulators: see the module docstring)


@triton.jit
def _widen(x):
    """x as fp32; bf16 through integer ops, so that the compiler does not reuse (and keep alive from pass 1
    to pass 2) the fp32 copies made in pass 1 instead of the packed 16-bit values."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def _sum2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _fold(x):
    """[TPR, VEC, K] -> [TPR]: the in-thread part of a sum."""
    return tl.sum(tl.sum(x, axis=2), axis=1)


@triton.jit
def _fold_vec(acc, x, w):
    """acc + Σ x·w over the VEC axis of [TPR, VEC] (as a chain of FMAs when VEC == 2)."""
    if x.shape[1] == 2:
        x0, x1 = tl.split(x)
        w0, w1 = tl.split(w)
        return acc + x0 * w0 + x1 * w1
    elif x.shape[1] == 4:
        xa, xb = tl.split(tl.reshape(x, [x.shape[0], 2, 2]))
        wa, wb = tl.split(tl.reshape(w, [w.shape[0], 2, 2]))
        return _fold_vec(_fold_vec(acc, xa, wa), xb, wb)
    else:
        return acc + tl.sum(x * w, axis=1)


@triton.jit
def _fold_dot(acc, x, w):
    """acc + Σ x·w folded in-thread ([TPR, VEC, K] -> [TPR]), as a chain of FMAs for K <= 2."""
    if x.shape[2] == 2:
        xa, xb = tl.split(x)
        wa, wb = tl.split(w)
        return _fold_vec(_fold_vec(acc, xa, wa), xb, wb)
    elif x.shape[2] == 1:
        return _fold_vec(acc, tl.sum(x, axis=2), tl.sum(w, axis=2))
    else:
        return acc + _fold(x * w)


@triton.jit
def _join_halves(vals):
    h: tl.constexpr = len(vals) // 2
    out = ()
    for j in tl.static_range(h):
        out = out + (tl.join(vals[j], vals[j + h]),)
    return out


@triton.jit
def _stack(vals, LOG: tl.constexpr):
    """2**LOG [TPR] tensors -> [TPR, 2**LOG] (column i = vals[i]), the new axis in-thread (a tree of joins)."""
    for _ in tl.static_range(LOG):
        vals = _join_halves(vals)
    x = vals[0]
    return tl.reshape(x, [x.shape[0], x.numel // x.shape[0]])


@triton.jit
def _in_row(r, D: tl.constexpr, EVEN: tl.constexpr):
    """r < D (a constant when the tiles cover the row exactly, so that masks stay uniform)."""
    if EVEN:
        return tl.full(r.shape, 1, tl.int1)
    else:
        return r < D


@triton.jit
def _tile(K: tl.constexpr, TPR: tl.constexpr, VEC: tl.constexpr):
    """Element offsets of a [TPR, VEC, K] tile: run k of thread t at (k·TPR + t)·VEC. (Threads on axis 0, so
    that the coalescing pass puts them there and keeps K in-thread, with one layout for every K.)"""
    t = tl.arange(0, TPR)[:, None, None]
    k = tl.arange(0, K)[None, None, :]
    return (k * TPR + t) * VEC + tl.arange(0, VEC)[None, :, None]


@triton.jit
def _ar_load_tile(
    prow, drow, brow, r, m, n, write_idx, D: tl.constexpr, NB: tl.constexpr, HAS_DELTA: tl.constexpr
):
    """The HBM loads of one tile, as loaded: (partial, delta (partial again if none), block 0..NB-1). The
    block written now (write_idx) and the blocks past n are not read (0)."""
    p = tl.load(prow + r, mask=m, other=0.0)
    d = p
    if HAS_DELTA:
        d = tl.load(drow + r, mask=m, other=0.0)
    ld = (p, d)
    for i in tl.static_range(NB):
        ld = ld + (tl.load(brow + i * D + r, mask=m & (i < n) & (i != write_idx), other=0.0),)
    return ld


@triton.jit
def _ar_sums_tile(
    dots,
    sqs,
    ld,
    prow,
    brow,
    wq_ptr,
    wn_ptr,
    r,
    m,
    write_idx,
    D: tl.constexpr,
    NB: tl.constexpr,
    PRESCALED: tl.constexpr,
    PB_SAME: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    ROUND: tl.constexpr,
    ROUND_DT: tl.constexpr,
    P16: tl.constexpr,
):
    """Pass 1 on one loaded tile: residual update + store, block write, and the per-thread partial sums of
    Σ s·wqn and Σ s² of every source (index NB = partial; the block written now, write_idx, was loaded as 0
    and its sums are the partial's, or, when the blocks' dtype differs, kept at index NB+1)."""
    p = ld[0]
    if HAS_DELTA:
        new = p.to(tl.float32) + ld[1].to(tl.float32)
        if ROUND:  # round-to-nearest-even, as torch's casts do (a 16-bit ROUND_DT only)
            new = new.to(ROUND_DT, fp_downcast_rounding="rtne").to(tl.float32)
        if P16:
            p = new.to(prow.dtype.element_ty, fp_downcast_rounding="rtne")
        else:
            p = new.to(prow.dtype.element_ty)
        tl.store(prow + r, p, mask=m)
    if PB_SAME:
        pb = p
    elif brow.dtype.element_ty.primitive_bitwidth < prow.dtype.element_ty.primitive_bitwidth:
        pb = p.to(brow.dtype.element_ty, fp_downcast_rounding="rtne")  # as torch's copy_ rounds
    else:
        pb = p.to(brow.dtype.element_ty)
    if write_idx >= 0:
        tl.store(brow + write_idx * D + r, pb, mask=m)
    wqn = tl.load(wq_ptr + r, mask=m, other=0.0).to(tl.float32)
    if not PRESCALED:
        wqn = wqn * tl.load(wn_ptr + r, mask=m, other=0.0).to(tl.float32)
    pf = p.to(tl.float32)
    dots = dots[:NB] + (_fold_dot(dots[NB], pf, wqn),) + dots[NB + 1 :]
    sqs = sqs[:NB] + (_fold_dot(sqs[NB], pf, pf),) + sqs[NB + 1 :]
    if not PB_SAME:
        pbf = pb.to(tl.float32)
        dots = dots[: NB + 1] + (_fold_dot(dots[NB + 1], pbf, wqn),)
        sqs = sqs[: NB + 1] + (_fold_dot(sqs[NB + 1], pbf, pbf),)
    for i in tl.static_range(NB):
        sf = ld[2 + i].to(tl.float32)
        dots = dots[:i] + (_fold_dot(dots[i], sf, wqn),) + dots[i + 1 :]
        sqs = sqs[:i] + (_fold_dot(sqs[i], sf, sf),) + sqs[i + 1 :]
    return dots, sqs


@triton.jit
def _attn_res_chunk_kernel(
    partial_ptr,
    delta_ptr,
    blocks_ptr,
    wn_ptr,
    wq_ptr,
    wo_ptr,
    out_ptr,
    n,
    write_idx,
    eps,
    eps_out,
    p_stride,
    d_stride,
    b_stride,
    o_stride,
    D: tl.constexpr,
    NB: tl.constexpr,
    TPR: tl.constexpr,
    VEC: tl.constexpr,
    KC: tl.constexpr,
    NSP: tl.constexpr,
    LOG_NSP: tl.constexpr,
    RESIDENT: tl.constexpr,
    STACKED: tl.constexpr,
    STAGES: tl.constexpr,
    PRESCALED: tl.constexpr,
    PB_SAME: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    HAS_OUT: tl.constexpr,
    ROUND: tl.constexpr,
    ROUND_DT: tl.constexpr,
    P16: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    UNIT: tl.constexpr = TPR * VEC
    NK: tl.constexpr = (D + UNIT - 1) // UNIT  # units per row
    NPART: tl.constexpr = (NK + 1) // 2  # parts of 2 units (the last one of 1 if NK is odd)
    EVEN: tl.constexpr = D % UNIT == 0  # no masking by r < D in the parts
    EVEN_C: tl.constexpr = D % (KC * UNIT) == 0  # nor in the chunks
    prow = partial_ptr + t * p_stride
    drow = delta_ptr + t * d_stride
    brow = blocks_ptr + t * b_stride
    zero = tl.zeros([TPR], tl.float32)
    NACC: tl.constexpr = NB + 1 if PB_SAME else NB + 2
    dots = (zero,) * NACC
    sqs = (zero,) * NACC
    # ---- pass 1: per-thread partial sums of Σ s·wqn and Σ s² for every source; no barrier
    srcs = ()
    if RESIDENT:  # the row as parts of 2 units (and 1); every HBM load issued first
        lds = ()
        for j in tl.static_range(NPART):
            r = j * (2 * UNIT) + _tile(2 if 2 * j + 1 < NK else 1, TPR, VEC)
            lds = lds + _ar_load_tile(
                prow, drow, brow, r, _in_row(r, D, EVEN), n, write_idx, D, NB, HAS_DELTA
            )
        for j in tl.static_range(NPART):
            r = j * (2 * UNIT) + _tile(2 if 2 * j + 1 < NK else 1, TPR, VEC)
            dots, sqs = _ar_sums_tile(
                dots,
                sqs,
                lds[: NB + 2],
                prow,
                brow,
                wq_ptr,
                wn_ptr,
                r,
                _in_row(r, D, EVEN),
                write_idx,
                D,
                NB,
                PRESCALED,
                PB_SAME,
                HAS_DELTA,
                ROUND,
                ROUND_DT,
                P16,
            )
            srcs = srcs + lds[2 : NB + 2]
            lds = lds[NB + 2 :]
    else:  # chunks of KC units, the loop software-pipelined over STAGES
        offs = _tile(KC, TPR, VEC)
        for c in tl.range(0, (NK + KC - 1) // KC, num_stages=STAGES):
            r = c * (KC * UNIT) + offs
            m = _in_row(r, D, EVEN_C)
            ld = _ar_load_tile(prow, drow, brow, r, m, n, write_idx, D, NB, HAS_DELTA)
            dots, sqs = _ar_sums_tile(
                dots,
                sqs,
                ld,
                prow,
                brow,
                wq_ptr,
                wn_ptr,
                r,
                m,
                write_idx,
                D,
                NB,
                PRESCALED,
                PB_SAME,
                HAS_DELTA,
                ROUND,
                ROUND_DT,
                P16,
            )
    # ---- the 2·(NB+1) sums across threads; softmax over the sources (in-thread)
    idx = tl.arange(0, NSP)
    if STACKED:  # one reduction of a [TPR, NSP] stack (NSP more registers per thread for a moment)
        pad = (zero,) * (NSP - NACC)
        dv, qv = tl.reduce((_stack(dots + pad, LOG_NSP), _stack(sqs + pad, LOG_NSP)), 0, _sum2)
    else:  # one reduction of two sums per accumulator
        dv = tl.zeros([NSP], tl.float32)
        qv = tl.zeros([NSP], tl.float32)
        for i in tl.static_range(NACC):
            di, qi = tl.reduce((dots[i], sqs[i]), 0, _sum2)
            dv = tl.where(idx == i, di, dv)
            qv = tl.where(idx == i, qi, qv)
    # the block written now was read as 0: its sums are those at NACC-1 (the partial's when the dtypes agree)
    dv = tl.where(idx == write_idx, dv + tl.sum(tl.where(idx == NACC - 1, dv, 0.0), axis=0), dv)
    qv = tl.where(idx == write_idx, qv + tl.sum(tl.where(idx == NACC - 1, qv, 0.0), axis=0), qv)
    valid = (idx < n) | (idx == NB)
    logit = tl.where(valid, dv * tl.rsqrt(qv / D + eps), float("-inf"))
    e = tl.exp(logit - tl.max(logit, axis=0))
    alpha = e * (1.0 / tl.sum(e, axis=0))
    alphas = ()
    for i in tl.static_range(NB + 1):  # (-0.0 fill: the adds of the sum fold away, a plain register pick)
        alphas = alphas + (tl.sum(tl.where(idx == i, alpha, -0.0), axis=0),)
    alpha_w = tl.sum(tl.where(idx == write_idx, alpha, 0.0), axis=0)  # 0 unless 0 <= write_idx < n
    # ---- pass 2, part by part: mix (the whole mixed row stays in registers), Σ mix², then scale and store
    tl.debug_barrier()  # pass 2 re-reads what pass 1 stored (partial, block write_idx)
    sq = zero
    mixes = ()
    for j in tl.static_range(NPART):
        r = j * (2 * UNIT) + _tile(2 if 2 * j + 1 < NK else 1, TPR, VEC)
        m = _in_row(r, D, EVEN)
        mix = tl.load(prow + r, mask=m, other=0.0).to(tl.float32) * alphas[NB]
        if RESIDENT:  # the block just written, if it is a source, is read again (its tile holds 0)
            w = tl.load(brow + write_idx * D + r, mask=m & (write_idx >= 0) & (write_idx < n), other=0.0)
            mix += w.to(tl.float32) * alpha_w
        for i in tl.static_range(NB):
            if RESIDENT:
                s = _widen(srcs[i])
            else:
                s = tl.load(brow + i * D + r, mask=m & (i < n), other=0.0).to(tl.float32)
            mix += s * alphas[i]
        if RESIDENT:
            srcs = srcs[NB:]  # this part's tiles are done with
        sq = _fold_dot(sq, mix, mix)
        mixes = mixes + (mix,)
    if HAS_OUT:
        inv = tl.rsqrt(tl.sum(sq, axis=0) / D + eps_out)
    orow = out_ptr + t * o_stride
    for j in tl.static_range(NPART):
        r = j * (2 * UNIT) + _tile(2 if 2 * j + 1 < NK else 1, TPR, VEC)
        m = _in_row(r, D, EVEN)
        y = mixes[0]
        mixes = mixes[1:]
        if HAS_OUT:
            y = y * inv * tl.load(wo_ptr + r, mask=m, other=0.0).to(tl.float32)
        tl.store(orow + r, y.to(out_ptr.dtype.element_ty), mask=m)


VARIANTS = ("row", "chunk", "chunk_resident")
DEFAULT_VARIANT = "chunk_resident"  # H200, D=7168, 9 sources, T=4096: 244 µs (68% of copy bw) vs row 426


def supported(partial, delta, blocks, round_dtype) -> bool:
    f64 = any(t is not None and t.dtype == torch.float64 for t in (partial, delta, blocks))
    rd = round_dtype is None or round_dtype in TL_DTYPE
    rows = partial.stride(-1) == 1 and (blocks.shape[0] == 0 or blocks[0].is_contiguous())
    return not f64 and rd and rows and (delta is None or delta.stride(-1) == 1) and partial.shape[1] <= 65536


def attn_res_triton(
    partial,
    delta,
    blocks,
    w_norm,
    w_q,
    w_out,
    n,
    write_idx,
    eps,
    eps_out=None,
    round_dtype=None,
    *,
    variant=None,
    num_warps=None,
    chunk=None,
    vec=None,
    num_stages=None,
    stacked=True,
    prescale=False,
):
    """Triton implementation of `reference.attn_res` (same arguments and result; partial/blocks in place).

    Tuning knobs (None = the variant's default; see the module docstring for the variants):
      variant: one of VARIANTS (default DEFAULT_VARIANT);
      num_warps: "row" 16/8/4 by row size, "chunk" 4, "chunk_resident" 8;
      chunk: "chunk" only: elements per pass-1 chunk, a power-of-two multiple of the unit 32·num_warps·vec
        (default one unit);
      vec: contiguous elements per thread and tile run (default 16 bytes of the widest stored dtype for
        "chunk", 8 bytes for "chunk_resident", whose loaded tiles stay packed in registers);
      num_stages: software-pipelining depth of pass 1 of "chunk" (default 3; 1 = none);
      stacked: one stacked reduction for all the logits' sums (else one per source);
      prescale: compute w_q·w_norm once with torch (one extra small op) instead of in every program.
    """
    T, D = partial.shape
    NB = blocks.shape[1]
    if variant is None:  # the register-resident form was measured at rows up to D=7168 x 11 row reads
        variant = DEFAULT_VARIANT if D * (NB + 2) <= 7168 * 11 else "chunk"
    if not 0 <= n <= NB or write_idx >= NB:
        raise ValueError(f"attn_res: n={n}, write_idx={write_idx} for {NB} blocks")
    if variant not in VARIANTS:
        raise ValueError(f"attn_res: variant {variant!r} not in {VARIANTS}")
    out = torch.empty(T, D, dtype=partial.dtype, device=partial.device)
    if T == 0:
        return out
    wq = w_q.reshape(-1)
    if prescale:  # the same fp32 product the kernels form
        wq = wq.float() * w_norm.float()
    common = (
        partial,
        delta if delta is not None else partial,
        blocks,
        w_norm,
        wq,
        w_out if w_out is not None else w_norm,
        out,
        int(n),
        int(write_idx),
        float(eps),
        float(eps if eps_out is None else eps_out),
        partial.stride(0),
        delta.stride(0) if delta is not None else 0,
        blocks.stride(0),
        out.stride(0),
    )
    flags = dict(
        PRESCALED=bool(prescale),
        HAS_DELTA=delta is not None,
        HAS_OUT=w_out is not None,
        ROUND=round_dtype in (torch.bfloat16, torch.float16),
        ROUND_DT=TL_DTYPE.get(round_dtype, tl.bfloat16),
        P16=partial.dtype in (torch.bfloat16, torch.float16),
    )
    if variant == "row":
        BLOCK = next_pow2(D)
        _attn_res_kernel[(T,)](
            *common,
            D=D,
            NB=NB,
            BLOCK=BLOCK,
            **flags,
            num_warps=num_warps or (16 if BLOCK >= 8192 else (8 if BLOCK >= 2048 else 4)),
        )
        return out
    resident = variant == "chunk_resident"
    esize = max(partial.element_size(), blocks.element_size())
    num_warps = num_warps or (8 if resident else 4)
    vec = vec or max(1, (8 if resident else 16) // esize)
    unit = 32 * num_warps * vec
    kc = max(1, (chunk or unit) // unit)
    if vec & (vec - 1) or kc & (kc - 1) or (chunk and chunk % unit):
        raise ValueError(
            f"attn_res: vec={vec} and chunk={chunk} (a multiple of 32·num_warps·vec={unit}) "
            "must be powers of two"
        )
    nsp = next_pow2(NB + (1 if partial.dtype == blocks.dtype else 2))
    _attn_res_chunk_kernel[(T,)](
        *common,
        D=D,
        NB=NB,
        TPR=32 * num_warps,
        VEC=vec,
        KC=kc,
        NSP=nsp,
        LOG_NSP=nsp.bit_length() - 1,
        RESIDENT=resident,
        STACKED=bool(stacked),
        PB_SAME=partial.dtype == blocks.dtype,
        STAGES=num_stages or 3,
        **flags,
        num_warps=num_warps,
    )
    return out
