"""Triton AttnRes and absorbed paged MLA under the CPU interpreter, against the reference ops."""

import math

import _triton_cpu  # (sets TRITON_INTERPRET=1 first)
import pytest
import torch
from _triton_cpu import cu_of, rel

from k3serve.kernels import reference as R
from k3serve.kernels.triton.attn_res import attn_res_triton
from k3serve.kernels.triton.mla_decode import mla_paged_attention_triton

pytestmark = _triton_cpu.skip_on_cuda


@pytest.mark.parametrize("n,wi,delta,wout", [(0, -1, False, True), (3, 2, True, True), (5, -1, True, False),
                                             (4, 4, False, True)])
def test_attn_res_fp32(n, wi, delta, wout):
    g = torch.Generator().manual_seed(n * 10 + wi)
    T, D, NB = 6, 96, 5
    p = torch.randn(T, D, generator=g)
    d = torch.randn(T, D, generator=g) if delta else None
    bl = torch.randn(T, NB, D, generator=g)
    wn, wq = torch.rand(D, generator=g) + 0.5, torch.randn(1, D, generator=g)
    wo = torch.rand(D, generator=g) + 0.5 if wout else None
    rp, rb = p.double(), bl.double()
    ref = R.attn_res(rp, None if d is None else d.double(), rb, wn.double(), wq.double(),
                     None if wo is None else wo.double(), n, wi, 1e-5)
    out = attn_res_triton(p, d, bl, wn, wq, wo, n, wi, 1e-5)
    assert rel(out, ref) < 1e-5
    assert rel(p, rp) < 1e-6 and rel(bl, rb) < 1e-6


def test_attn_res_bf16_rounds_partial():
    # The interpreter's float->bf16 conversion does not round like the GPU's, so the rounded residual is
    # compared within one bf16 ulp; the mixture itself within bf16 tolerance.
    g = torch.Generator().manual_seed(7)
    T, D, NB = 4, 64, 3
    p = torch.randn(T, D, generator=g).bfloat16()
    d = torch.randn(T, D, generator=g).bfloat16()
    bl = torch.randn(T, NB, D, generator=g).bfloat16()
    wn, wq, wo = torch.rand(D, generator=g) + 0.5, torch.randn(D, generator=g), torch.rand(D, generator=g) + 0.5
    rp, rb = p.clone(), bl.clone()
    ref = R.attn_res(rp, d, rb, wn, wq, wo, 2, 1, 1e-5, round_dtype=torch.bfloat16)
    out = attn_res_triton(p, d, bl, wn, wq, wo, 2, 1, 1e-5, round_dtype=torch.bfloat16)
    assert rel(out, ref) < 2e-2
    assert ((p.float() - rp.float()).abs() <= rp.float().abs() * 2**-7 + 1e-6).all()
    assert torch.equal(bl[:, 1], p) and torch.equal(bl[:, [0, 2]], rb[:, [0, 2]])


@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_mla_paged(num_splits):
    g = torch.Generator().manual_seed(3)
    L, Rr, bs, Hh = 32, 16, 4, 3
    ctx, nq = [7, 1, 13], [1, 1, 3]
    B, maxb = len(ctx), max(math.ceil(c / bs) for c in ctx) + 1
    cache = torch.randn(20, bs, L + Rr, generator=g)
    bt = torch.randperm(20, generator=g)[: B * maxb].view(B, maxb)
    cu = cu_of(nq)
    T = int(cu[-1])
    ql, qp = torch.randn(T, Hh, L, generator=g), torch.randn(T, Hh, Rr, generator=g)
    ref = R.mla_paged_attention(ql.double(), qp.double(), cache.double(), bt, torch.tensor(ctx), cu, 0.2,
                                kv_lora_rank=L)
    out = mla_paged_attention_triton(ql, qp, cache, bt, torch.tensor(ctx), cu, 0.2, kv_lora_rank=L,
                                     num_splits=num_splits, block_n=16)
    assert rel(out, ref) < 1e-5


def test_mla_paged_strided_cache_pages():
    # pages padded past the block's tokens (the engine's cache views have a larger block stride)
    g = torch.Generator().manual_seed(4)
    L, Rr, bs, Hh = 32, 16, 4, 2
    raw = torch.randn(10, bs + 3, L + Rr, generator=g)
    cache = raw[:, :bs]
    bt = torch.tensor([[3, 1, 7]])
    ql, qp = torch.randn(1, Hh, L, generator=g), torch.randn(1, Hh, Rr, generator=g)
    ref = R.mla_paged_attention(ql.double(), qp.double(), cache.double(), bt, torch.tensor([10]), cu_of([1]), 0.3,
                                kv_lora_rank=L)
    out = mla_paged_attention_triton(ql, qp, cache, bt, torch.tensor([10]), cu_of([1]), 0.3, kv_lora_rank=L,
                                     block_n=16)
    assert rel(out, ref) < 1e-5


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_mla_write_cache(dt):
    from k3serve.kernels.triton.mla_cache import mla_write_cache_triton

    g = torch.Generator().manual_seed(11)
    L, Rr, bs, nb, T = 32, 16, 4, 6, 9
    kv_a = torch.randn(T, L + Rr + 8, generator=g).to(dt)  # k_pe a strided slice, as the model passes it
    c_kv, k_pe = kv_a[:, :L].contiguous(), kv_a[:, L + 8:]
    slots = torch.tensor([5, -1, 0, 23, 7, -1, 12, 13, 1])
    # a padded page layout: the cache is a strided view of larger pages
    pages = torch.full((nb, bs + 1, L + Rr), float("nan"), dtype=dt)
    cache, ref = pages[:, :bs], pages.clone()[:, :bs]
    R.mla_write_cache(c_kv, k_pe, ref, slots)
    mla_write_cache_triton(c_kv, k_pe, cache, slots)
    assert torch.equal(cache.isnan(), ref.isnan())  # the same rows written, the others untouched
    assert torch.equal(torch.nan_to_num(cache), torch.nan_to_num(ref))
    assert pages[:, bs].isnan().all()  # page padding never written
