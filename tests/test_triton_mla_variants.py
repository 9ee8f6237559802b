"""Every variant/knob of the Triton absorbed paged MLA (kernels/triton/mla_decode.py) under the CPU interpreter,
against `reference.mla_paged_attention` in float64: ragged contexts (1 token, page boundaries, long), several
query rows per sequence (causal within the sequence's last tokens), empty sequences, heads 3/16/40, one and
many KV splits. Cache slots no sequence may see hold NaN, so any read past a context shows up."""

import math

import _triton_cpu  # (sets TRITON_INTERPRET=1 first)
import pytest
import torch
from _triton_cpu import cu_of, rel

from k3serve.kernels import reference as R
from k3serve.kernels.triton.mla_decode import choose_splits, mla_paged_attention_triton

pytestmark = _triton_cpu.skip_on_cuda

L, RR = 32, 16


def make_case(ctx, nq, bs, Hh, seed, dt=torch.float32, index_dtype=torch.int64, pad_pages=0, extra_blocks=1):
    g = torch.Generator().manual_seed(seed)
    B = len(ctx)
    maxb = max(math.ceil(c / bs) for c in ctx) + extra_blocks
    nblocks = B * maxb + 2
    raw = torch.full((nblocks, bs + pad_pages, L + RR), float("nan"))
    cache = raw[:, :bs] if pad_pages else raw
    bt = torch.randperm(nblocks, generator=g)[: B * maxb].view(B, maxb)
    for b, c in enumerate(ctx):  # only the visible slots get finite values
        for pos in range(c):
            cache[bt[b, pos // bs], pos % bs] = torch.randn(L + RR, generator=g)
    cache = cache.to(dt)
    cu = cu_of(nq).to(index_dtype)
    T = int(cu[-1])
    ql = torch.randn(T, Hh, L, generator=g).to(dt)
    qp = torch.randn(T, Hh, RR, generator=g).to(dt)
    sl = torch.tensor(ctx, dtype=index_dtype)
    return ql, qp, cache, bt.to(index_dtype), sl, cu


def check(case, tol, **kw):
    ql, qp, cache, bt, sl, cu = case
    ref = R.mla_paged_attention(ql.double(), qp.double(), cache.double(), bt, sl, cu, 0.3, kv_lora_rank=L)
    out = mla_paged_attention_triton(ql, qp, cache, bt, sl, cu, 0.3, kv_lora_rank=L, **kw)
    assert out.dtype == ql.dtype and out.shape == ql.shape
    err = rel(out, ref)
    assert err < tol, err
    return out


CASES = {
    # 1 token, exactly one page, a page boundary + 1, a long multi-page context
    "ragged": ([1, 8, 9, 70], [1, 1, 1, 1], 8),
    # several query rows per sequence (the last tokens of their sequence), an empty sequence in between
    "multi": ([13, 5, 6, 40], [3, 0, 1, 4], 4),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("Hh", [3, 16, 40])
@pytest.mark.parametrize("variant", ["trans", "plain"])
@pytest.mark.parametrize("num_splits", [1, 5, None])
def test_mla_variants_fp32(name, Hh, variant, num_splits):
    ctx, nq, bs = CASES[name]
    case = make_case(ctx, nq, bs, Hh, seed=Hh * 7 + len(name))
    check(case, 1e-5, variant=variant, num_splits=num_splits, block_n=16)


@pytest.mark.parametrize("variant", ["trans", "plain"])
@pytest.mark.parametrize("block_h,block_n,num_splits", [(16, 32, 3), (64, 16, 2), (32, 16, 24)])
def test_mla_block_shapes(variant, block_h, block_n, num_splits):
    # 40 heads in blocks of 16 / 64 / 32; more splits than some sequences have tiles (empty splits)
    case = make_case([33, 1, 100], [2, 1, 3], 16, 40, seed=block_h + block_n)
    check(case, 1e-5, variant=variant, block_h=block_h, block_n=block_n, num_splits=num_splits)


@pytest.mark.parametrize("variant", ["trans", "plain"])
def test_mla_bf16(variant):
    # bf16 cache and queries; p is rounded to bf16 for the value dot, so ~1e-3 relative error is expected
    case = make_case([50, 17, 1], [1, 2, 1], 8, 16, seed=5, dt=torch.bfloat16)
    check(case, 1e-2, variant=variant, block_n=16, num_splits=4)


def test_mla_int32_indices_strided_pages_empty_edges():
    # int32 index tensors, pages padded past their tokens, empty sequences first and last
    case = make_case([0, 21, 7, 0], [0, 2, 1, 0], 4, 3, seed=9, index_dtype=torch.int32, pad_pages=3)
    check(case, 1e-5, block_n=16, num_splits=3)
    check(case, 1e-5, block_n=16, num_splits=1, variant="plain")


def test_mla_many_sequences_chunked_lookup():
    # > 256 sequences: the in-kernel sequence lookup walks cu_seqlens_q in several chunks
    B = 300
    ctx = [1 + (b * 7) % 5 for b in range(B)]
    nq = [1 if b % 3 else min(2, ctx[b]) for b in range(B)]
    nq[-1] = 0
    case = make_case(ctx, nq, 4, 3, seed=1)
    check(case, 1e-5, block_n=16, num_splits=1)


def test_mla_default_knobs_long_context():
    # defaults (block_n 64 -> 32 for fp32, heuristic splits) on a context of many tiles
    case = make_case([700, 3], [2, 1], 64, 16, seed=2)
    check(case, 1e-5)


@pytest.mark.parametrize("variant", ["trans", "plain"])
def test_mla_empty_splits_poisoned_workspace(variant, monkeypatch):
    # a block table much wider than the contexts: most of the 12 splits are empty and store only (m, l);
    # the merge must not read their (never written) partial rows: new float buffers start as NaN here
    orig = torch.empty

    def nan_empty(*a, **k):
        x = orig(*a, **k)
        return x.fill_(float("nan")) if x.is_floating_point() else x

    case = make_case([5, 30], [1, 2], 4, 3, seed=8, extra_blocks=12)
    monkeypatch.setattr(torch, "empty", nan_empty)
    check(case, 1e-5, variant=variant, block_n=16, num_splits=12)


def test_mla_default_knobs_bf16_many_heads():
    # the bf16 defaults for > 16 heads (blocks of 64 heads, 32 keys per step, 4 stages), 40 heads
    case = make_case([90, 2], [1, 2], 16, 40, seed=6, dt=torch.bfloat16)
    check(case, 1e-2)


def test_mla_detects_wrong_scale():
    # the comparison is tight enough to fail: a 1% change of the softmax scale is caught
    ql, qp, cache, bt, sl, cu = make_case([40, 9], [1, 2], 8, 3, seed=4)
    ref = R.mla_paged_attention(ql.double(), qp.double(), cache.double(), bt, sl, cu, 0.3, kv_lora_rank=L)
    out = mla_paged_attention_triton(
        ql, qp, cache, bt, sl, cu, 0.303, kv_lora_rank=L, block_n=16, num_splits=3
    )
    assert rel(out, ref) > 1e-4


def test_choose_splits():
    # one item on 132 SMs: about one program per SM, capped by min_split_keys; many items: no split
    assert choose_splits(1, 32768, 64, 32, 512, 1152, 132, 256) == 128
    assert choose_splits(1, 32768, 64, 32, 512, 1152, 132, 1024) == 32
    ns = choose_splits(32, 32768, 64, 32, 512, 1152, 132, 256)
    assert 32 * ns <= 132 or (32 * ns) % 132 > 120  # a nearly full last wave
    assert choose_splits(1024, 32768, 64, 32, 512, 1152, 132, 256) == 1
    assert choose_splits(1, 64, 64, 32, 512, 1152, 132, 256) == 1


PREFILL_CASES = {
    # whole prompts, a chunk after a cached prefix, a decode row and an empty sequence among them
    "chunks": ([40, 70, 5, 9, 0], [40, 30, 5, 1, 0], 8),
    "short": ([1, 8, 9, 70], [1, 1, 1, 1], 8),
    "multi": ([13, 5, 6, 40], [3, 0, 1, 4], 4),
}


@pytest.mark.parametrize("name", list(PREFILL_CASES))
@pytest.mark.parametrize("Hh", [3, 16, 40])
@pytest.mark.parametrize("rows", [64, 16])
def test_mla_prefill_kernel_fp32(monkeypatch, name, Hh, rows):
    """`_mla_prefill_kernel` (BQ tokens x BH heads per program; token blocks that cross sequence boundaries,
    heads padded to a power of two, NaN in every slot no row may see) == the reference."""
    from k3serve.kernels.triton import mla_decode

    monkeypatch.setattr(mla_decode, "PREFILL_ROWS", rows)
    ctx, nq, bs = PREFILL_CASES[name]
    case = make_case(ctx, nq, bs, Hh, seed=Hh * 3 + rows + len(name))
    check(case, 1e-5, variant="prefill", block_n=16)


def test_mla_prefill_kernel_taken_for_prefill_bf16(monkeypatch):
    """variant=None: 16-bit steps with >= PREFILL_MIN_TOKENS_PER_SEQ tokens per sequence take the prefill kernel
    (the per-token kernel is made to fail), decode-shaped and fp32 steps do not; bf16 result == the reference."""
    from k3serve.kernels.triton import mla_decode

    assert mla_decode.takes_prefill(64, 4, 2) and not mla_decode.takes_prefill(63, 4, 2)
    assert not mla_decode.takes_prefill(64, 4, 4) and not mla_decode.takes_prefill(8, 8, 2)
    monkeypatch.setattr(mla_decode, "PREFILL_MIN_TOKENS_PER_SEQ", 0)
    assert not mla_decode.takes_prefill(10**6, 1, 2)
    monkeypatch.setattr(mla_decode, "PREFILL_MIN_TOKENS_PER_SEQ", 16)
    ctx, nq, bs = [40, 70, 9], [40, 30, 1], 8
    case = make_case(ctx, nq, bs, 16, seed=5, dt=torch.bfloat16)

    class Refuse:
        def __getitem__(self, grid):
            raise AssertionError("the per-token split kernel ran")

    monkeypatch.setattr(mla_decode, "_mla_split_kernel", Refuse())
    check(case, 2e-2)
