"""GPU correctness of the Triton kernels against the reference ops (fp64 on the CPU).

Every check draws fresh random inputs, poisons the CUDA caching allocator with NaN first (so an output
element a kernel never writes shows up as NaN) and fills unused state slots with NaN (a kernel that reads
or writes a slot it should not is caught). Calls go through `k3serve.kernels.ops`, so the registration
in `k3serve.kernels.triton_ops` is what is tested. Tolerances: ‖out − ref‖ / ‖ref‖ per dtype.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from k3serve.kernels import ops, reference  # noqa: E402
from k3serve.kernels.reference.mxfp4 import mxfp4_quantize  # noqa: E402

DEV = "cuda"
TOL = {torch.float32: 2e-4, torch.bfloat16: 2.5e-2}
_seed = [1234]


def gen() -> torch.Generator:
    _seed[0] += 1
    return torch.Generator().manual_seed(_seed[0])


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.detach().double().cpu()
    ref = ref.detach().double().cpu()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def poison_allocator(nbytes: int = 1 << 28) -> None:
    x = torch.full((nbytes // 4,), float("nan"), device=DEV)
    del x


def cu_of(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


# ---------------------------------------------------------------- KDA
def kda_inputs(T, H, K, V, g: torch.Generator, lower_bound=-5.0):
    q = torch.randn(T, H, K, generator=g)
    k = torch.randn(T, H, K, generator=g)
    v = torch.randn(T, H, V, generator=g)
    g_ = reference.kda_gate(torch.randn(T, H, K, generator=g), torch.randn(H, generator=g) * 0.5,
                            torch.randn(H * K, generator=g), lower_bound)
    beta = torch.sigmoid(torch.randn(T, H, generator=g))
    return q, k, v, g_, beta


def run_kda(op, lens, H, dt, pool_dt=torch.float32, ckpt=True, lower_bound=-5.0, K=128, V=128):
    g = gen()
    T = sum(lens)
    B = len(lens)
    q, k, v, gg, beta = kda_inputs(T, H, K, V, g, lower_bound)
    q, k, v = (x.to(dt) for x in (q, k, v))
    nslots = 2 * B + 4
    pool = torch.full((nslots, H, V, K), float("nan"))
    slots = torch.randperm(nslots, generator=g)[:B]
    init = torch.rand(B, generator=g) < 0.6
    for b in range(B):
        pool[slots[b]] = torch.randn(H, V, K, generator=g) if init[b] else float("nan")
    if B > 1:  # one padded sequence; its former slot stays NaN and must not be touched
        pool[slots[B // 2]] = float("nan")
        slots[B // 2] = -1
    free = [s for s in range(nslots) if s not in slots.tolist()]
    cs, co, csl = [], [], []
    if ckpt:
        for b in range(B):
            if slots[b] >= 0 and lens[b] > 2 and len(free) >= 2:
                cs += [b, b]
                co += [1 + int(torch.randint(lens[b] - 1, (1,), generator=g)), lens[b]]
                csl += [free.pop(), free.pop()]
                pool[csl[-1]] = pool[csl[-2]] = float("nan")
    ck = dict(checkpoint_seq=torch.tensor(cs), checkpoint_offsets=torch.tensor(co),
              checkpoint_slots=torch.tensor(csl)) if cs else {}
    pool = pool.to(pool_dt)
    ref_pool = pool.double()
    ref_o = getattr(reference, op)(q.double(), k.double(), v.double(), gg.double(), beta.double(), ref_pool, slots,
                                   cu_of(lens), init, **ck)
    dpool = pool.to(DEV)
    poison_allocator()
    o = getattr(ops, op)(q.to(DEV), k.to(DEV), v.to(DEV), gg.to(DEV), beta.to(DEV), dpool, slots.to(DEV),
                         cu_of(lens).to(DEV), init.to(DEV), **{a: t.to(DEV) for a, t in ck.items()})
    torch.cuda.synchronize()
    touched = sorted({int(s) for s in slots if s >= 0} | set(csl))
    untouched = [s for s in range(nslots) if s not in touched]
    assert torch.isnan(dpool[untouched].float()).all(), "a slot outside the call was written"
    tol = TOL[dt] if pool_dt == torch.float32 else 3e-2
    assert rel(o, ref_o) < tol, rel(o, ref_o)
    assert rel(dpool[touched], ref_pool[touched]) < tol, rel(dpool[touched], ref_pool[touched])


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,H", [([1, 63, 64, 65, 200, 0, 129], 4), ([300, 17], 12), ([1000], 2)])
def test_kda_chunked_gpu(lens, H, dt):
    run_kda("kda_chunked", lens, H, dt)


def test_kda_chunked_unbounded_gate_and_bf16_pool_gpu():
    run_kda("kda_chunked", [150, 40, 7], 3, torch.bfloat16, lower_bound=None)
    run_kda("kda_chunked", [150, 40, 7], 3, torch.bfloat16, pool_dt=torch.bfloat16)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_kda_chunked_strided_qkv_gpu(dt):
    """q, k, v as column slices of one [T, 3·H·K] tensor (the conv output the engine splits): the fused prep kernel
    reads them at their token stride; bit for bit the result (and the states) of contiguous copies."""
    from k3serve.kernels.triton.kda_chunk import kda_chunked_triton

    g = gen()
    lens, H, K = [300, 77, 1], 4, 128
    T = sum(lens)
    merged = (torch.randn(T, 3 * H * K, generator=g)).to(dt).to(DEV)
    q, k, v = (merged[:, i * H * K:(i + 1) * H * K].view(T, H, K) for i in range(3))
    gg = reference.kda_gate(torch.randn(T, H, K, generator=g), torch.randn(H, generator=g) * 0.5,
                            torch.randn(H * K, generator=g), -5.0).to(DEV)
    beta = torch.rand(T, H, generator=g).to(DEV)
    pool = torch.randn(4, H, K, K, generator=g).to(DEV)
    pool2 = pool.clone()
    cu = torch.tensor([0, 300, 377, 378], device=DEV)
    si, init = torch.tensor([2, 0, 3], device=DEV), torch.tensor([True, False, True], device=DEV)
    got = kda_chunked_triton(q, k, v, gg, beta, pool, si, cu, init)
    want = kda_chunked_triton(q.contiguous(), k.contiguous(), v.contiguous(), gg, beta, pool2, si, cu, init)
    torch.cuda.synchronize()
    assert torch.equal(got, want) and torch.equal(pool, pool2)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_kda_decode_shaped_and_recurrent_gpu(dt):
    run_kda("kda_chunked", [1] * 33, 4, dt, ckpt=False)  # T == B: the token-serial path
    run_kda("kda_recurrent", [5, 1, 30, 2], 4, dt)
    run_kda("kda_recurrent", [1, 2, 1, 3], 4, dt, ckpt=False)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,lb,strided", [(1, -5.0, False), (7, None, False), (70, -5.0, False), (1, -5.0, True),
                                          (7, None, True)])
def test_kda_decode_fused_gpu(N, lb, strided, dt):
    """strided: qkv, beta logits and gate passed as column slices of one wider tensor, as the engine passes
    its merged input projection (workers/engine/k3_forward.py)."""
    g = gen()
    H, K, V, W = 4, 128, 128, 4
    C = 2 * H * K + H * V
    qkv = torch.randn(N, C, generator=g).to(dt)
    cw = torch.randn(C, W, generator=g) * 0.5
    nslots = N + 3
    cs = torch.randn(nslots, C, W - 1, generator=g).to(dt)
    pool = torch.randn(nslots, H, V, K, generator=g)
    rg = torch.randn(N, H, K, generator=g).to(dt)
    al = torch.randn(H, generator=g) * 0.5
    dtb = torch.randn(H * K, generator=g)
    bl = torch.randn(N, H, generator=g).to(dt)
    gate = torch.randn(N, H, V, generator=g).to(dt)
    onw = torch.rand(V, generator=g) + 0.5
    slots = torch.randperm(nslots, generator=g)[:N]
    if N > 1:
        slots[N // 2] = -1
    init = torch.rand(N, generator=g) < 0.8
    unused = [s for s in range(nslots) if s not in slots.tolist()]
    pool[unused] = float("nan")
    cs[unused] = float("nan")
    rc, rp = cs.double(), pool.double()
    ref = reference.kda_decode(qkv.double(), cw.double(), rc, rg.double(), al.double(), dtb.double(), bl.double(),
                               gate.double(), onw.double(), rp, slots, init, lower_bound=lb)
    dc, dp = cs.to(DEV), pool.to(DEV)
    poison_allocator()
    if strided:
        merged = torch.cat([qkv, bl, gate.reshape(N, H * V), torch.randn(N, 5, generator=g).to(dt)], 1).to(DEV)
        d_qkv, d_bl = merged[:, :C], merged[:, C:C + H]
        d_gate = merged[:, C + H:C + H + H * V]
        assert d_qkv.stride(0) == d_bl.stride(0) == d_gate.stride(0) == merged.shape[1]
    else:
        d_qkv, d_bl, d_gate = qkv.to(DEV), bl.to(DEV), gate.to(DEV)
    y = ops.kda_decode(d_qkv, cw.to(DEV), dc, rg.to(DEV), al.to(DEV), dtb.to(DEV), d_bl, d_gate,
                       onw.to(DEV), dp, slots.to(DEV), init.to(DEV), lower_bound=lb)
    torch.cuda.synchronize()
    used = [int(s) for s in slots if s >= 0]
    assert torch.isnan(dp[unused]).all() and torch.isnan(dc[unused].float()).all()
    assert rel(y, ref) < TOL[dt], rel(y, ref)
    assert rel(dp[used], rp[used]) < TOL[dt]
    assert rel(dc[used], rc[used]) < TOL[dt]


# ---------------------------------------------------------------- AttnRes
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,D,n,wi,delta,wout", [(1, 7168, 8, -1, True, True), (37, 7168, 3, 3, True, True),
                                                 (5, 1000, 0, 0, False, True), (64, 2048, 8, -1, True, False)])
def test_attn_res_gpu(T, D, n, wi, delta, wout, dt):
    g = gen()
    NB = 9
    p = torch.randn(T, D, generator=g).to(dt)
    d = torch.randn(T, D, generator=g).to(dt) if delta else None
    bl = torch.randn(T, NB, D, generator=g).to(dt)
    wn = torch.rand(D, generator=g) + 0.5
    wq = torch.randn(1, D, generator=g) * 0.05
    wo = torch.rand(D, generator=g) + 0.5 if wout else None
    rd = dt if dt != torch.float32 else None
    rp, rb = p.double(), bl.double()
    ref = reference.attn_res(rp, None if d is None else d.double(), rb, wn.double(), wq.double(),
                             None if wo is None else wo.double(), n, wi, 1e-5, round_dtype=None)
    dp, db = p.to(DEV), bl.to(DEV)
    poison_allocator()
    y = ops.attn_res(dp, None if d is None else d.to(DEV), db, wn.to(DEV), wq.to(DEV), None if wo is None else
                     wo.to(DEV), n, wi, 1e-5, round_dtype=rd)
    torch.cuda.synchronize()
    assert rel(y, ref) < TOL[dt], rel(y, ref)
    assert rel(dp, rp) < TOL[dt] / 4
    assert rel(db, rb) < TOL[dt] / 4


# ---------------------------------------------------------------- MLA
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hh,ctx,nq,bs", [(12, [3000], [1], 64), (32, [1, 700, 4097, 65], [1, 1, 1, 1], 16),
                                          (96, [500, 33], [1, 1], 64), (16, [300, 90], [40, 3], 64),
                                          # prefill-shaped (bf16: kernels/triton/mla_decode.py _mla_prefill_kernel)
                                          (16, [1024, 300, 7], [1024, 100, 1], 16), (32, [900, 70], [600, 70], 64),
                                          (96, [400], [400], 64)])
def test_mla_paged_gpu(Hh, ctx, nq, bs, dt):
    g = gen()
    L, R = 512, 64
    B = len(ctx)
    maxb = max(math.ceil(c / bs) for c in ctx) + 1
    nblocks = B * maxb + 3
    cache = torch.randn(nblocks, bs, L + R, generator=g).to(dt)
    bt = torch.randperm(nblocks, generator=g)[: B * maxb].view(B, maxb).to(torch.int32)
    cu = cu_of(nq)
    T = int(cu[-1])
    ql = torch.randn(T, Hh, L, generator=g).to(dt) * 0.1
    qp = torch.randn(T, Hh, R, generator=g).to(dt) * 0.1
    sl = torch.tensor(ctx, dtype=torch.int32)
    ref = reference.mla_paged_attention(ql.double(), qp.double(), cache.double(), bt, sl, cu, 192**-0.5,
                                        kv_lora_rank=L)
    poison_allocator()
    o = ops.mla_paged_attention(ql.to(DEV), qp.to(DEV), cache.to(DEV), bt.to(DEV), sl.to(DEV), cu.to(DEV),
                                192**-0.5, kv_lora_rank=L)
    torch.cuda.synchronize()
    assert rel(o, ref) < TOL[dt], rel(o, ref)


# ---------------------------------------------------------------- MoE
@pytest.mark.parametrize("T,E,k,G,tg,scoring", [(1, 896, 16, 1, 1, "sigmoid"), (33, 896, 16, 1, 1, "sigmoid"),
                                                (20, 256, 8, 8, 4, "sigmoid"), (9, 64, 6, 1, 1, "softmax")])
def test_moe_route_gpu(T, E, k, G, tg, scoring):
    g = gen()
    lg = torch.randn(T, E, generator=g)
    bias = torch.randn(E, generator=g) * 0.1
    rw, ri = reference.moe_route(lg.double(), bias.double(), k, num_expert_group=G, topk_group=tg, scoring=scoring)
    w, i = ops.moe_route(lg.to(DEV), bias.to(DEV), k, num_expert_group=G, topk_group=tg, scoring=scoring)
    assert torch.equal(i.cpu(), ri)
    assert rel(w, rw) < 1e-5


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,fp4", [(1, True), (8, True), (64, True), (13, False)])
def test_moe_experts_gpu(T, fp4, dt):
    g = gen()
    E, k, DIN, I, DOUT = 32, 8, 512, 128, 384
    z = torch.randn(T, DIN, generator=g).to(dt)
    w13 = torch.randn(E, 2 * I, DIN, generator=g) * DIN**-0.5
    w2 = torch.randn(E, DOUT, I, generator=g) * I**-0.5
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if T > 1:
        ids[1, 0] = -1
    tw = torch.rand(T, k, generator=g)
    if fp4:
        p13, s13 = mxfp4_quantize(w13)
        p2, s2 = mxfp4_quantize(w2)
        kw = dict(w13_packed=p13, w13_scale=s13, w2_packed=p2, w2_scale=s2)
    else:
        kw = dict(w13=w13.to(dt), w2=w2.to(dt))
    ref = reference.moe_experts(z.double(), tw.double(), ids, situ_linear_beta=25.0,
                                **{a: (t.double() if t.is_floating_point() else t) for a, t in kw.items()})
    poison_allocator()
    o = ops.moe_experts(z.to(DEV), tw.to(DEV), ids.to(DEV), situ_linear_beta=25.0,
                        **{a: t.to(DEV) for a, t in kw.items()})
    torch.cuda.synchronize()
    assert rel(o, ref) < TOL[dt], rel(o, ref)


@pytest.mark.parametrize("packed", [True, False], ids=["mxfp4", "unpacked"])
@pytest.mark.parametrize("variant,pair_sum", [("dense", 0), ("dense", 1), ("dot", 0), ("auto", 0), ("auto", 1)],
                         ids=["dense", "dense-pair-sum", "dot", "auto", "auto-pair-sum"])
def test_moe_experts_prefill_gpu(monkeypatch, variant, packed, pair_sum):
    """Prefill-sized bf16 batches: the "dense" variant (64-row blocks on 16-bit weights: MXFP4 experts decoded
    once first, unpacked bf16 ones as they are), the 16-row "dot" path and what "auto" picks (dense here) against
    the reference, the "dense" down GEMM's combine both ways (atomics, per-pair rows summed: PAIR_SUM_MIN_PAIRS);
    the decode pass == the reference dequantization on the GPU."""
    from k3serve.kernels.reference.mxfp4 import mxfp4_dequantize
    from k3serve.kernels.triton import moe

    monkeypatch.setattr(moe, "PAIR_SUM_MIN_PAIRS", pair_sum)

    g = gen()
    T, E, k, DIN, I, DOUT = 1024, 32, 8, 512, 128, 384
    z = torch.randn(T, DIN, generator=g).to(torch.bfloat16)
    w13 = torch.randn(E, 2 * I, DIN, generator=g) * DIN**-0.5
    w2 = torch.randn(E, DOUT, I, generator=g) * I**-0.5
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids[::9, 0] = -1
    tw = torch.rand(T, k, generator=g)
    if packed:
        p13, s13 = mxfp4_quantize(w13)
        p2, s2 = mxfp4_quantize(w2)
        kw = dict(w13_packed=p13, w13_scale=s13, w2_packed=p2, w2_scale=s2)
        d = moe.mxfp4_to_dense(p13.to(DEV), s13.to(DEV), torch.bfloat16)
        assert torch.equal(d.cpu().float(), mxfp4_dequantize(p13, s13).bfloat16().float())
    else:
        kw = dict(w13=w13.bfloat16(), w2=w2.bfloat16())
    assert moe.takes_dense(T * k, E, "mxfp4" if packed else "unpacked", torch.bfloat16, 10**6)
    ref = reference.moe_experts(z.double(), tw.double(), ids, situ_linear_beta=25.0,
                                **{a: (t.double() if t.is_floating_point() else t) for a, t in kw.items()})
    poison_allocator()
    o = moe.moe_experts_triton(z.to(DEV), tw.to(DEV), ids.to(DEV), situ_linear_beta=25.0, variant=variant,
                               **{a: t.to(DEV) for a, t in kw.items()})
    torch.cuda.synchronize()
    assert rel(o, ref) < TOL[torch.bfloat16], rel(o, ref)


# ---------------------------------------------------------------- causal conv (prefill) and MLA cache write
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_causal_conv1d_varlen_gpu(dt):
    g = gen()
    C, K = 3 * 4 * 128, 4
    lens = [700, 1, 0, 33, 2, 129]
    slots = torch.tensor([3, 0, 5, 1, -1, 7])
    init = torch.tensor([True, True, False, False, True, True])
    x = torch.randn(sum(lens), C, generator=g).to(dt)
    w = torch.randn(C, K, generator=g)
    pool = torch.randn(10, C, K - 1, generator=g).to(dt)
    pool[[2, 4, 6, 8, 9]] = float("nan")  # never read (checkpoint targets or unused)
    ck = dict(checkpoint_seq=torch.tensor([0, 0, 3, 5]), checkpoint_offsets=torch.tensor([1, 512, 33, 64]),
              checkpoint_slots=torch.tensor([2, 4, 6, 8]))
    ref_pool = pool.double()
    ref = reference.causal_conv1d_varlen(x.double(), w.double(), ref_pool, slots, cu_of(lens), init, **ck)
    dpool = pool.to(DEV)
    poison_allocator()
    y = ops.causal_conv1d_varlen(x.to(DEV), w.to(DEV), dpool, slots.to(DEV), cu_of(lens).to(DEV), init.to(DEV),
                                 **{a: t.to(DEV) for a, t in ck.items()})
    torch.cuda.synchronize()
    assert rel(y, ref) < TOL[dt]
    written = [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert rel(dpool[written], ref_pool[written]) < TOL[dt]
    assert dpool[9].isnan().all()


def test_mla_write_cache_gpu():
    g = gen()
    L, R, bs = 512, 64, 16
    kv_a = torch.randn(40, L + R + 8, generator=g).to(torch.bfloat16).to(DEV)
    c_kv, k_pe = kv_a[:, :L].contiguous(), kv_a[:, L + 8:]
    slots = torch.randperm(8 * bs, generator=g)[:40].to(DEV)
    slots[[3, 17]] = -1
    cache = torch.full((8, bs, L + R), float("nan"), dtype=torch.bfloat16, device=DEV)
    ref = cache.clone()
    reference.mla_write_cache(c_kv, k_pe, ref, slots)
    ops.mla_write_cache(c_kv, k_pe, cache, slots)
    torch.cuda.synchronize()
    assert torch.equal(cache.isnan(), ref.isnan())
    assert torch.equal(torch.nan_to_num(cache), torch.nan_to_num(ref))
