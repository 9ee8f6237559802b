"""Absorbed MLA attention over the paged latent cache, in Triton (flash-decoding with split KV).

Work item = (one query token, a block of up to BM heads); all heads of an item share the latent KV rows,
so each KV row is read once per item (items of one token that differ only in their head block run next to
each other, so the re-reads hit L2). Per item, the key range [0, qpos] is split into NS pieces processed
by separate programs (online softmax in each, base-2 exponent), then merged by their max/sum weights in a
second kernel that is parallel over (token, head, latent chunk) and reads all NS partials of a chunk at once.
Sequences are found from `cu_seqlens_q` on the device (no host sync, no glue kernels; capturable in a CUDA
graph). Contract: `k3serve.kernels.reference.mla_paged_attention`.

The KV tile loads (cp.async) are software-pipelined: the page indices of the next tile are loaded one step
ahead, so no tile load depends on a load of its own iteration and the pipeliner can issue tiles
num_stages - 1 steps ahead (with the page lookup in the same step it could only run one step ahead).
Two formulations of the per-tile math (`variant`):
  "plain" (default): heads are the MMA M dim: S[BM, BN] = Qa·C^T (+ Qp·Kpe^T), O[BM, L] += P·C; with
           BM = 64 all dots are Hopper wgmma (P stays in registers as the A operand), else mma.sync.
  "trans": keys are M: S^T[BN, BM] = C·Qa^T, O^T[L, BM] += C^T·P^T; with BN = 64 both dots are wgmma
           on the shared-memory tile, but three 72 KB buffers do not fit, so it runs unpipelined.
See `default_config` for the defaults and `benchmarks/sweep_mla.py` for the GPU sweep of the knobs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._common import dot_precision

LOG2E = 1.4426950408889634


@triton.jit
def _seq_of(cu_ptr, t, B, SB: tl.constexpr):
    """Index of the sequence holding query row t: the number of b in [1, B) with cu[b] <= t."""
    cnt = t * 0
    for c0 in range(0, B, SB):
        idx = c0 + 1 + tl.arange(0, SB)
        ok = idx < B
        v = tl.load(cu_ptr + idx, mask=ok, other=0)
        cnt += tl.sum((ok & (v <= t)).to(tl.int32), axis=0)
    return cnt


@triton.jit
def _mla_split_kernel(
    ql_ptr,
    qp_ptr,
    kv_ptr,
    bt_ptr,
    sl_ptr,
    cu_ptr,
    o_ptr,
    ws_ptr,
    qk_scale,
    kv_s0,
    kv_s1,
    bt_s0,
    Hh,
    nhb,
    NS,
    B,
    bs,
    ml_off,
    L: tl.constexpr,
    R: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    SB: tl.constexpr,
    SPLIT: tl.constexpr,
    TRANS: tl.constexpr,
    PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    hb = pid % nhb
    rest = pid // nhb
    s = rest % NS
    t = rest // NS
    rm = tl.arange(0, BM)
    rl = tl.arange(0, L)
    rr = tl.arange(0, R)
    rn = tl.arange(0, BN)
    heads = hb * BM + rm
    mrow = heads < Hh
    qrow = t.to(tl.int64) * Hh + heads
    # the query loads do not depend on the sequence lookup below: issued first, their latencies overlap
    qa = tl.load(ql_ptr + qrow[:, None] * L + rl[None, :], mask=mrow[:, None], other=0.0)
    qp = tl.load(qp_ptr + qrow[:, None] * R + rr[None, :], mask=mrow[:, None], other=0.0)
    b = _seq_of(cu_ptr, t, B, SB)
    q0 = tl.load(cu_ptr + b)
    nq = tl.load(cu_ptr + b + 1) - q0
    kv_hi = (tl.load(sl_ptr + b) - nq + (t - q0) + 1).to(tl.int32)  # keys [0, kv_hi) are visible to row t
    size = tl.cdiv(tl.cdiv(kv_hi, NS), BN) * BN
    lo = s * size
    hi = tl.minimum(lo + size, kv_hi)
    m_i = tl.full([BM], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    if TRANS:
        qaT = tl.trans(qa)
        qpT = tl.trans(qp)
        acc = tl.zeros([L, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, L], dtype=tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * bt_s0
    kk = lo + rn
    page = tl.load(bt_row + kk // bs, mask=kk < hi, other=0).to(tl.int64)
    for j in range(lo, hi, BN):
        kk = j + rn
        km = kk < hi
        row = page * kv_s0 + (kk % bs).to(tl.int64) * kv_s1
        # the next tile's pages, loaded one step ahead: the tile loads below depend on no load of this
        # iteration, so the software pipeliner can issue them num_stages - 1 tiles ahead
        kn = kk + BN
        page = tl.load(bt_row + kn // bs, mask=kn < hi, other=0).to(tl.int64)
        c = tl.load(kv_ptr + row[:, None] + rl[None, :], mask=km[:, None], other=0.0).to(qa.dtype)
        kp = tl.load(kv_ptr + row[:, None] + L + rr[None, :], mask=km[:, None], other=0.0).to(qa.dtype)
        if TRANS:
            sc = tl.dot(c, qaT, input_precision=PREC)
            sc = tl.dot(kp, qpT, sc, input_precision=PREC)  # [BN, BM]
            sc = tl.where(km[:, None], sc * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=0))
            p = tl.exp2(sc - m_new[None, :])
            alpha = tl.exp2(m_i - m_new)
            acc = tl.dot(tl.trans(c), p.to(qa.dtype), acc * alpha[None, :], input_precision=PREC)
            l_i = l_i * alpha + tl.sum(p, axis=0)
        else:
            sc = tl.dot(qa, tl.trans(c), input_precision=PREC)
            sc = tl.dot(qp, tl.trans(kp), sc, input_precision=PREC)  # [BM, BN]
            sc = tl.where(km[None, :], sc * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            p = tl.exp2(sc - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            acc = tl.dot(p.to(qa.dtype), c, acc * alpha[:, None], input_precision=PREC)
            l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    if SPLIT:
        # partials of row (t, h), split s at (t * Hh + h) * NS + s; padded heads are not stored, and an
        # empty split (short context, wide block table) stores only its (m, l) = (-1e30, 0)
        pbase = qrow * NS + s
        keep = mrow & (hi > lo)
        if TRANS:
            tl.store(ws_ptr + pbase[None, :] * L + rl[:, None], acc, mask=keep[None, :])
        else:
            tl.store(ws_ptr + pbase[:, None] * L + rl[None, :], acc, mask=keep[:, None])
        tl.store(ws_ptr + ml_off + pbase * 2, m_i, mask=mrow)
        tl.store(ws_ptr + ml_off + pbase * 2 + 1, l_i, mask=mrow)
    else:
        if TRANS:
            o = acc / l_i[None, :]
            tl.store(
                o_ptr + qrow[None, :] * L + rl[:, None], o.to(o_ptr.dtype.element_ty), mask=mrow[None, :]
            )
        else:
            o = acc / l_i[:, None]
            tl.store(
                o_ptr + qrow[:, None] * L + rl[None, :], o.to(o_ptr.dtype.element_ty), mask=mrow[:, None]
            )


@triton.jit
def _mla_prefill_kernel(ql_ptr, qp_ptr, kv_ptr, bt_ptr, sl_ptr, cu_ptr, o_ptr, qk_scale, kv_s0, kv_s1, bt_s0, T, Hh,
                        nhb, B, bs, L: tl.constexpr, R: tl.constexpr, BQ: tl.constexpr, BH: tl.constexpr,
                        BN: tl.constexpr, SB: tl.constexpr, PREC: tl.constexpr):
    """Prefill-shaped steps: one program = BQ consecutive query tokens x BH heads as the MMA M dim (BQ * BH rows),
    so every latent KV tile is read once for BQ tokens instead of once per token. The block's tokens are walked
    one sequence at a time (a block meets a sequence boundary rarely in prefill chunks); within a sequence each
    row sees keys [0, its causal end). No splits: prefill has T / BQ x head-block programs to fill the GPU."""
    ROWS: tl.constexpr = BQ * BH
    pid = tl.program_id(0)
    hb = pid % nhb
    t_first = (pid // nhb) * BQ
    r = tl.arange(0, ROWS)
    rl = tl.arange(0, L)
    rr = tl.arange(0, R)
    rn = tl.arange(0, BN)
    t = t_first + r // BH
    heads = hb * BH + r % BH
    mrow = (heads < Hh) & (t < T)
    qrow = t.to(tl.int64) * Hh + heads
    qa = tl.load(ql_ptr + qrow[:, None] * L + rl[None, :], mask=mrow[:, None], other=0.0)
    qp = tl.load(qp_ptr + qrow[:, None] * R + rr[None, :], mask=mrow[:, None], other=0.0)
    t_last = tl.minimum(t_first + BQ - 1, T - 1)
    b0 = _seq_of(cu_ptr, t_first, B, SB)
    b1 = _seq_of(cu_ptr, t_last, B, SB)
    for b in range(b0, b1 + 1):
        q0 = tl.load(cu_ptr + b)
        q1 = tl.load(cu_ptr + b + 1)
        ctx = tl.load(sl_ptr + b)
        seg = mrow & (t >= q0) & (t < q1)
        row_hi = ctx - (q1 - q0) + (t - q0) + 1  # keys [0, row_hi) are visible to the row's token
        hi = ctx - (q1 - q0) + (tl.minimum(t_last, q1 - 1) - q0) + 1
        m_i = tl.full([ROWS], -1e30, dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, L], dtype=tl.float32)
        bt_row = bt_ptr + (q0.to(tl.int64) * 0 + b) * bt_s0  # (b is a plain int under the interpreter)
        for j in range(0, hi, BN):
            kk = j + rn
            km = kk < hi
            page = tl.load(bt_row + kk // bs, mask=km, other=0).to(tl.int64)
            krow = page * kv_s0 + (kk % bs).to(tl.int64) * kv_s1
            c = tl.load(kv_ptr + krow[:, None] + rl[None, :], mask=km[:, None], other=0.0).to(qa.dtype)
            kp = tl.load(kv_ptr + krow[:, None] + L + rr[None, :], mask=km[:, None], other=0.0).to(qa.dtype)
            sc = tl.dot(qa, tl.trans(c), input_precision=PREC)
            sc = tl.dot(qp, tl.trans(kp), sc, input_precision=PREC)  # [ROWS, BN]
            vis = seg[:, None] & (kk[None, :] < row_hi[:, None])
            sc = tl.where(vis, sc * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            p = tl.exp2(sc - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            acc = tl.dot(p.to(qa.dtype), c, acc * alpha[:, None], input_precision=PREC)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + qrow[:, None] * L + rl[None, :], o.to(o_ptr.dtype.element_ty), mask=seg[:, None])


@triton.jit
def _mla_merge_kernel(o_ptr, ws_ptr, NS, ml_off, L: tl.constexpr, BL: tl.constexpr, NSP: tl.constexpr):
    """One (query row, head) and BL latent columns per program; all NS partials as one [NSP, BL] tile."""
    row = tl.program_id(0)  # t * Hh + h
    rs = tl.arange(0, NSP)
    sm = rs < NS
    pb = row.to(tl.int64) * NS + rs
    rl = tl.program_id(1) * BL + tl.arange(0, BL)
    mx = tl.load(ws_ptr + ml_off + pb * 2, mask=sm, other=-1e30)
    ls = tl.load(ws_ptr + ml_off + pb * 2 + 1, mask=sm, other=0.0)
    # issued without waiting for ls: rows of empty splits were never written and are dropped by the where
    acc = tl.load(ws_ptr + pb[:, None] * L + rl[None, :], mask=sm[:, None], other=0.0)
    acc = tl.where((ls > 0)[:, None], acc, 0.0)
    w = tl.exp2(mx - tl.max(mx, axis=0))
    o = tl.sum(acc * w[:, None], axis=0) / tl.sum(ls * w, axis=0)
    tl.store(o_ptr + row.to(tl.int64) * L + rl, o.to(o_ptr.dtype.element_ty))


def supported(q_lat, q_pe, kv_cache, kv_lora_rank) -> bool:
    L, R = kv_lora_rank, q_pe.shape[-1]
    dims = all(d >= 16 and (d & (d - 1)) == 0 for d in (L, R)) and L <= 1024
    f64 = any(t.dtype == torch.float64 for t in (q_lat, q_pe, kv_cache))
    return dims and not f64 and kv_cache.stride(-1) == 1


@functools.cache
def _num_sms(index: int | None) -> int:
    if index is None or not torch.cuda.is_available():
        return 132  # H200 (the interpreter / compile-only paths)
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=4096)
def choose_splits(
    items: int,
    max_ctx: int,
    block_n: int,
    rows: int,
    L: int,
    entry_bytes: int,
    sms: int,
    min_split_keys: int,
    max_splits: int = 256,
) -> int:
    """KV splits per item that minimise a wave model of the split + merge time (in units of one KV tile).

    Per program: its tiles plus ~2 tiles of fixed cost (first-load latency, epilogue); programs run in
    ceil(items * NS / sms) waves of one program per SM (the pipelined tiles take most of the shared memory);
    the fp32 partials of the `rows` real heads per item (written, then read by the merge) cost their bytes
    spread over all SMs, plus one tile for the merge launch.
    """
    tiles = triton.cdiv(max_ctx, block_n)
    tile_bytes = block_n * entry_bytes
    top = max(1, min(max_splits, triton.cdiv(max_ctx, min_split_keys), tiles))
    best, best_cost = 1, None
    for ns in range(1, top + 1):
        cost = triton.cdiv(items * ns, sms) * (triton.cdiv(tiles, ns) + 2)
        if ns > 1:
            cost += items * ns * rows * (L + 2) * 8 / (sms * tile_bytes) + 1
        if best_cost is None or cost < best_cost - 1e-9:
            best, best_cost = ns, cost
    return best


SMEM_BUDGET = (
    227 * 1024 - 4096
)  # a block may use 227 KB on sm_90; a little is kept for the compiler's scratch


def smem_estimate(variant: str, BM: int, BN: int, stages: int, L: int, R: int, elem: int) -> int:
    """Shared memory of the split kernel: the query block plus the pipelined KV tile buffers (stages - 1 of
    them, or `stages` when a wgmma reads the tile straight from shared memory while the next loads land)."""
    wgmma = elem == 2 and (BM >= 64 if variant == "plain" else BN >= 64)
    bufs = stages if wgmma else max(1, stages - 1)
    return (BM + bufs * BN) * (L + R) * elem


def default_config(
    Hh: int, L: int, R: int, elem: int, variant=None, block_h=None, block_n=None, num_stages=None
) -> tuple[str, int, int, int]:
    """Fill in the knobs left None: (variant, block_h, block_n, num_stages).

    16-bit data: heads as the MMA M dim ("plain"); <= 16 heads in one block of 16 (mma.sync), more heads in
    blocks of 64 (Hopper wgmma, padded rows cost MMA time only) when the buffers fit, else 32; 32 keys per
    step and 4 stages (tile loads run 3 steps ahead: 2 tiles in flight while one is computed). fp32 data
    (ieee dots on FMA units, tiles of twice the bytes): blocks of 16/32 heads, 16 keys, 2 stages. Default
    stages are cut to fit the shared memory; explicit knobs are taken as given.
    """
    variant = variant or "plain"
    f32 = elem == 4
    if not f32 and 16 < Hh <= 32 and block_h is None and block_n is None and num_stages is None:
        # measured on the H200 (benchmarks/sweep_mla.py): 32 heads, 64 keys, 3 stages was the fastest at
        # 17-32 heads (B=32: 595 µs vs 795 for 64-head blocks; B=1 in a graph: 34.5 vs 41.3 µs)
        block_h, block_n, num_stages = 32, 64, 3
    block_n = block_n or (16 if f32 else 32)
    stages = num_stages or (2 if f32 else {16: 5, 32: 4}.get(block_n, 3 if variant == "plain" else 2))
    if block_h is None:
        block_h = 16 if Hh <= 16 else 32
        if not f32 and Hh > 16 and smem_estimate(variant, 64, block_n, stages, L, R, elem) <= SMEM_BUDGET:
            block_h = 64
    if num_stages is None:
        while stages > 2 and smem_estimate(variant, block_h, block_n, stages, L, R, elem) > SMEM_BUDGET:
            stages -= 1
    return variant, block_h, block_n, stages


PREFILL_MIN_TOKENS_PER_SEQ = 16
"""`variant=None`: 16-bit steps with at least this many query tokens per sequence on average (prefill chunks)
take `_mla_prefill_kernel` (BQ tokens x BH heads per program, each KV tile read once per BQ tokens); decode-shaped
steps keep the per-token split kernel. 0 turns the prefill kernel off."""
PREFILL_ROWS = 64
"""MMA rows per prefill program (BQ tokens x BH heads; 64: Hopper wgmma)."""
PREFILL_BN = 32
PREFILL_STAGES = 2


def takes_prefill(T: int, B: int, elem: int) -> bool:
    """Whether `variant=None` takes the prefill kernel for T query tokens over B sequences."""
    return elem == 2 and PREFILL_MIN_TOKENS_PER_SEQ > 0 and T >= PREFILL_MIN_TOKENS_PER_SEQ * max(B, 1)


def _pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


@functools.lru_cache(maxsize=4096)
def _plan(
    T,
    Hh,
    L,
    R,
    B,
    max_ctx,
    q_elem,
    kv_elem,
    sms,
    variant,
    block_h,
    block_n,
    num_stages,
    num_splits,
    min_split_keys,
    merge_elems,
):
    """Host-side launch plan, cached: the wrapper's per-call Python work is a lookup plus two launches."""
    variant, BM, BN, stages = default_config(
        Hh, L, R, max(q_elem, kv_elem), variant, block_h, block_n, num_stages
    )
    if variant not in ("trans", "plain"):
        raise ValueError(f"mla: unknown variant {variant!r}")
    nhb = -(-Hh // BM)
    if num_splits is None:
        num_splits = choose_splits(
            T * nhb, max_ctx, BN, min(BM, Hh), L, (L + R) * kv_elem, sms, min_split_keys
        )
    NS = max(1, int(num_splits))
    NSP = _pow2(NS)
    BL = min(L, max(16, _pow2(merge_elems) // NSP))
    return dict(
        variant=variant,
        BM=BM,
        BN=BN,
        stages=stages,
        nhb=nhb,
        NS=NS,
        NSP=NSP,
        BL=BL,
        SB=min(256, _pow2(B)),
        ml_off=T * Hh * NS * L,
        ws_size=T * Hh * NS * (L + 2),
    )


def mla_paged_attention_triton(
    q_lat,
    q_pe,
    kv_cache,
    block_tables,
    seq_lens,
    cu_seqlens_q,
    scale,
    *,
    kv_lora_rank,
    num_splits=None,
    block_n=None,
    num_stages=None,
    min_split_keys=256,
    variant=None,
    block_h=None,
    num_warps=8,
    merge_elems=4096,
):
    """Triton implementation of `reference.mla_paged_attention` (same arguments and result).

    Tuning knobs (not part of the op contract; None = `default_config`): `variant` "plain" (heads are the
    MMA M dim) or "trans" (keys are M: with block_n = 64 both dots are wgmma on the shared-memory tile), or
    "prefill" (`_mla_prefill_kernel`: tokens x heads as M; None takes it per `takes_prefill`);
    `block_h` heads per program; `block_n` keys per inner step; `num_stages` software-pipelining depth;
    `num_warps` of the split kernel; `num_splits` KV splits per item (default `choose_splits`, each split
    >= `min_split_keys` keys of the longest possible context); `merge_elems` partials per merge program.
    """
    T, Hh, L = q_lat.shape
    R = q_pe.shape[-1]
    if L != kv_lora_rank or kv_cache.shape[-1] != L + R:
        raise ValueError(
            f"mla: q_lat {tuple(q_lat.shape)}, q_pe {tuple(q_pe.shape)}, cache {tuple(kv_cache.shape)}"
        )
    dev = q_lat.device
    out = torch.empty(T, Hh, L, dtype=q_lat.dtype, device=dev)
    if T == 0:
        return out
    ql, qp = q_lat.contiguous(), q_pe.contiguous()
    cu, sl, bt = cu_seqlens_q.to(device=dev), seq_lens.to(device=dev), block_tables.to(device=dev)
    bs = kv_cache.shape[1]
    B = cu.shape[0] - 1
    if variant == "prefill" or (variant is None and takes_prefill(T, B, q_lat.element_size())):
        BH = min(PREFILL_ROWS, _pow2(Hh))
        BQ = max(1, PREFILL_ROWS // BH)
        nhb = -(-Hh // BH)
        _mla_prefill_kernel[(triton.cdiv(T, BQ) * nhb,)](
            ql, qp, kv_cache, bt, sl, cu, out, float(scale) * LOG2E, kv_cache.stride(0), kv_cache.stride(1),
            bt.stride(0), T, Hh, nhb, B, bs, L=L, R=R, BQ=BQ, BH=BH, BN=block_n or PREFILL_BN,
            SB=min(256, _pow2(B)), PREC=dot_precision(q_lat.dtype), num_warps=num_warps,
            num_stages=num_stages or PREFILL_STAGES,
        )  # fmt: skip
        return out
    pl = _plan(
        T,
        Hh,
        L,
        R,
        B,
        bt.shape[1] * bs,
        q_lat.element_size(),
        kv_cache.element_size(),
        _num_sms(dev.index if dev.type == "cuda" else None),
        variant,
        block_h,
        block_n,
        num_stages,
        num_splits,
        min_split_keys,
        merge_elems,
    )
    NS = pl["NS"]
    split = NS > 1
    ws = torch.empty(pl["ws_size"], dtype=torch.float32, device=dev) if split else out
    _mla_split_kernel[(T * pl["nhb"] * NS,)](
        ql, qp, kv_cache, bt, sl, cu, out, ws, float(scale) * LOG2E, kv_cache.stride(0), kv_cache.stride(1),
        bt.stride(0), Hh, pl["nhb"], NS, B, bs, pl["ml_off"], L=L, R=R, BM=pl["BM"], BN=pl["BN"], SB=pl["SB"],
        SPLIT=split, TRANS=pl["variant"] == "trans", PREC=dot_precision(q_lat.dtype), num_warps=num_warps,
        num_stages=pl["stages"],
    )  # fmt: skip
    if split:
        _mla_merge_kernel[(T * Hh, L // pl["BL"])](
            out, ws, NS, pl["ml_off"], L=L, BL=pl["BL"], NSP=pl["NSP"], num_warps=4
        )
    return out
