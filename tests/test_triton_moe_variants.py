"""MoE expert variants ("gemv" decode path, "dot" lean-decode blocks) and the lean MXFP4 decode, under the
CPU interpreter, against the reference ops (fp32 to 1e-5, bf16 to 2e-2)."""

import _triton_cpu  # (sets TRITON_INTERPRET=1 first)
import pytest
import torch
import triton
import triton.language as tl
from _triton_cpu import rel

from k3serve.kernels import reference as R
from k3serve.kernels.reference.mxfp4 import mxfp4_dequantize, mxfp4_quantize
from k3serve.kernels.triton import moe
from k3serve.kernels.triton.moe import moe_experts_triton, route_blocks

pytestmark = _triton_cpu.skip_on_cuda

VARIANTS = {
    "gemv": dict(variant="gemv"),
    "gemv-loop": dict(variant="gemv", combine="loop"),
    "dot": dict(variant="dot"),
}


def _case(T, E, k, DIN, I, DOUT, fp4, seed, invalid=True, wscale=1.0):
    """Inputs; fp4 = (w13 packed?, w2 packed?). Some rows route the same expert twice over tokens."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(T, DIN, generator=g)
    w13 = torch.randn(E, 2 * I, DIN, generator=g) * 0.2 * wscale
    w2 = torch.randn(E, DOUT, I, generator=g) * 0.2 * wscale
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if invalid and T * k > 1:
        ids[T // 2, k - 1] = -1
    tw = torch.rand(T, k, generator=g)
    kw = {}
    if fp4[0]:
        kw["w13_packed"], kw["w13_scale"] = mxfp4_quantize(w13)
    else:
        kw["w13"] = w13
    if fp4[1]:
        kw["w2_packed"], kw["w2_scale"] = mxfp4_quantize(w2)
    else:
        kw["w2"] = w2
    return z, tw, ids, kw


def _check(z, tw, ids, kw, dt, act, lin, knobs):
    ref = R.moe_experts(z.double(), tw.double(), ids, activation=act, situ_linear_beta=lin,
                        **{a: (t.double() if t.is_floating_point() else t) for a, t in kw.items()})
    kw = {a: (t.to(dt) if t.is_floating_point() else t) for a, t in kw.items()}
    beta = {} if act == "situ" else {"situ_beta": None}  # silu configs carry situ_beta=None
    out = moe_experts_triton(z.to(dt), tw, ids, activation=act, situ_linear_beta=lin, **beta, **kw, **knobs)
    assert out.dtype == dt and out.shape == ref.shape
    err = rel(out, ref)
    assert err < (1e-5 if dt == torch.float32 else 2e-2), err
    return err


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("T,E,k,DIN,I,DOUT,fp4,act,lin", [
    (1, 6, 1, 96, 96, 72, (True, True), "situ", 25.0),
    (2, 8, 2, 160, 64, 40, (True, True), "silu", None),
    (5, 16, 4, 96, 32, 72, (True, False), "situ", None),
    (5, 6, 3, 72, 40, 24, (False, False), "silu", None),
    (33, 12, 2, 64, 32, 40, (False, True), "situ", 25.0),
])
def test_variants_fp32(name, T, E, k, DIN, I, DOUT, fp4, act, lin):
    z, tw, ids, kw = _case(T, E, k, DIN, I, DOUT, fp4, seed=T * 100 + E)
    _check(z, tw, ids, kw, torch.float32, act, lin, VARIANTS[name])


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("T,E,k,DIN,I,DOUT,fp4,act,lin", [
    (1, 16, 4, 160, 96, 72, (True, True), "situ", 25.0),
    (5, 8, 2, 160, 96, 72, (True, True), "silu", None),
    (33, 10, 2, 64, 32, 48, (True, True), "situ", None),
    (5, 6, 3, 160, 96, 72, (False, False), "situ", 25.0),
])
def test_variants_bf16(name, T, E, k, DIN, I, DOUT, fp4, act, lin):
    z, tw, ids, kw = _case(T, E, k, DIN, I, DOUT, fp4, seed=T * 7 + k)
    _check(z, tw, ids, kw, torch.bfloat16, act, lin, VARIANTS[name])


@pytest.mark.parametrize("knobs", [
    dict(variant="gemv", bn1=32, bk1=64, bn2=16, bk2=32, num_warps=2),
    dict(variant="gemv", bn1=16, bk1=512, bn2=64, bk2=256, combine="loop", num_warps=8),
    dict(variant="dot", bn1=16, bk1=128, bn2=32, bk2=256, num_warps=4, programs=3),
    dict(variant="dot", bn1=32, bk1=512, bn2=16, bk2=128, programs=1),
])
def test_variant_tiles(knobs):
    """Other tile shapes, and few persistent programs (each loops over many work items)."""
    z, tw, ids, kw = _case(3, 7, 3, 224, 96, 80, (True, True), seed=5)
    _check(z, tw, ids, kw, torch.float32, "situ", 25.0, knobs)


@pytest.mark.parametrize("name", ["gemv", "dot"])
@pytest.mark.parametrize("wscale", [2.0**-24, 2.0**20])
def test_variants_far_scales(name, wscale):
    """Scale bytes far from 127 (weights ~2^-26 and ~2^18) decode exactly; see `test_lean_decode_exact` for
    the full byte range (the kernels need |activations| < 2^63, weights' scale byte <= 192)."""
    z, tw, ids, kw = _case(3, 6, 2, 96, 64, 48, (True, True), seed=11, wscale=wscale)
    s13 = kw["w13_scale"].int()
    assert s13.max() < 105 or s13.min() > 140
    _check(z, tw, ids, kw, torch.float32, "silu", None, VARIANTS[name])


def test_all_pairs_invalid_and_repeated_experts():
    """All of one token's pairs invalid, and one expert shared by every token (block > 16 pairs for "dot")."""
    z, tw, ids, kw = _case(18, 5, 2, 96, 64, 48, (True, True), seed=3, invalid=False)
    ids[:, 0] = 2
    ids[4] = -1
    for name in VARIANTS:
        _check(z, tw, ids, kw, torch.float32, "situ", 25.0, VARIANTS[name])
    sid, order, starts, n = route_blocks(ids, 5, count=True)
    assert int(n) == int((starts >= 0).sum())


@pytest.mark.parametrize("name", list(VARIANTS))
def test_no_valid_pairs(name):
    """Every id -1: zeros (the "dot" kernels see a block count of 0 and run no work item)."""
    z, tw, ids, kw = _case(3, 4, 2, 64, 32, 48, (True, True), seed=4)
    out = moe_experts_triton(z, tw, torch.full_like(ids, -1), **kw, **VARIANTS[name])
    assert out.shape == (3, 48) and torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("variant,knob,programs", [("gemv", "GEMV1_ZEROS_OUT", None), ("dot", "DOT1_ZEROS_OUT", None),
                                                   ("dot", "DOT1_ZEROS_OUT", 1)])
@pytest.mark.parametrize("T,k,I,DOUT,bn1", [(1, 4, 96, 72, 16), (3, 2, 32, 200, 16), (5, 3, 64, 48, 64)])
def test_atomic_accumulator_zeroed_in_kernel(monkeypatch, variant, knob, programs, T, k, I, DOUT, bn1):
    """moe.GEMV1_ZEROS_OUT / DOT1_ZEROS_OUT: the gate/up kernel zeroes the atomic combine's accumulator, which is
    handed over full of NaNs here (DOUT wider and narrower than the gate/up tiles x ZB, a token with an invalid
    pair; "dot" with one persistent program: its zeroing loop covers every chunk); without the in-kernel zeroing
    the NaNs reach the output."""
    z, tw, ids, kw = _case(T, 7, k, 64, I, DOUT, (True, True), seed=T + DOUT)
    made = []

    def poisoned(T_, D_, dev):
        made.append((T_, D_))
        return torch.full((T_, D_), float("nan"), dtype=torch.float32, device=dev)

    monkeypatch.setattr(moe, "_accumulator", poisoned)
    knobs = dict(variant="gemv", combine="atomic", bn1=bn1) if variant == "gemv" else dict(variant="dot",
                                                                                          programs=programs)
    _check(z, tw, ids, kw, torch.float32, "situ", 25.0, knobs)
    assert made == [(T, DOUT)]
    monkeypatch.setattr(moe, knob, False)  # the fill kernel instead: no accumulator from here
    _check(z, tw, ids, kw, torch.float32, "situ", 25.0, knobs)
    assert made == [(T, DOUT)]


def test_auto_and_default(monkeypatch):
    """variant="auto" takes "gemv" up to AUTO_GEMV_MAX_PAIRS pairs, then "dot"; no variant = DEFAULT_VARIANT."""
    z, tw, ids, kw = _case(4, 6, 2, 96, 64, 48, (True, True), seed=2)
    monkeypatch.setattr(moe, "AUTO_GEMV_MAX_PAIRS", 6)
    seen = []
    for name in ("_gemv_path", "_dot_path"):
        orig = getattr(moe, name)
        monkeypatch.setattr(moe, name, lambda *a, _o=orig, _n=name, **k: (seen.append(_n), _o(*a, **k))[1])
    _check(z, tw, ids, kw, torch.float32, "situ", 25.0, dict(variant="auto", num_warps=(2, 4)))  # 8 pairs
    _check(z[:3], tw[:3], ids[:3], kw, torch.float32, "situ", 25.0, dict(variant="auto"))  # 6 pairs
    assert seen == ["_dot_path", "_gemv_path"]
    assert moe.DEFAULT_VARIANT in moe.VARIANTS
    _check(z, tw, ids, kw, torch.float32, "silu", None, dict(num_warps=(4, 8)))
    if moe.DEFAULT_VARIANT == "blocks":
        assert len(seen) == 2


@triton.jit
def _decode_kernel(w_ptr, s_ptr, out_ptr, NW: tl.constexpr, B: tl.constexpr, POST: tl.constexpr):
    """Decode NW int32 words (one scale per 4 words) with the kernels' lean decode and group factor, in the
    kernels' order: "gemv" (B = 62) scales x by 2^64 before the group factor, "dot" (B = 94) multiplies the
    decoded operand by the factor and the accumulator by 2^32."""
    rj = tl.arange(0, NW)
    wd = tl.load(w_ptr + rj)
    f = moe._group_factor(tl.load(s_ptr + rj // 4).to(tl.int32), B)
    for i in tl.static_range(8):
        if B == 62:
            v = (moe._dn(wd, i) * POST) * f
        else:
            v = (moe._dn(wd, i) * f) * POST
        tl.store(out_ptr + rj * 8 + i, v)


@pytest.mark.parametrize("B,POST,sbytes", [(62, 2.0**64, [1, 64, 100, 127, 128, 150, 192]),  # "gemv"
                                           (94, 2.0**32, [40, 100, 127, 128, 160])])  # "dot"
def test_lean_decode_exact(B, POST, sbytes):
    """Every byte value (both nibble orders) decodes bit-exactly to mxfp4_dequantize's value, over the scale
    bytes each path supports."""
    b = torch.arange(256, dtype=torch.uint8)
    packed = torch.cat([b, b.flip(0)]).view(1, 512)  # 1024 elements, 32 groups
    for sbyte in sbytes:
        scales = torch.full((1, 32), sbyte, dtype=torch.uint8)
        ref = mxfp4_dequantize(packed, scales, torch.float32)
        out = torch.empty(1024, dtype=torch.float32)
        _decode_kernel[(1,)](packed.view(torch.int32).reshape(-1), scales.reshape(-1), out, NW=128, B=B, POST=POST)
        assert torch.equal(out, ref.reshape(-1)), sbyte


@pytest.mark.parametrize("dt,fp4", [(torch.float32, (True, True)), (torch.float32, (False, True)),
                                    (torch.bfloat16, (True, True))])
def test_dot_large_blocks(monkeypatch, dt, fp4):
    """The "dot" path's 64-row blocks (moe.DOT_BM_LARGE, prefill-sized batches): blocks of one expert span several
    64-row tiles and a partial last one, every expert routed, some pairs invalid; equal to the reference and to
    the 16-row blocks."""
    T, E, k = 150, 4, 2  # 300 pairs: ~75 per expert, i.e. one full 64-row block + a partial one per expert
    z, tw, ids, kw = _case(T, E, k, 96, 64, 72, fp4, seed=11)
    ids[::7, 0] = -1
    monkeypatch.setattr(moe, "DOT_BM_LARGE", 64)
    assert moe.dot_block_rows(T * k, E) == 64
    sid, order, starts = route_blocks(ids, E, bm=64)
    nblk = int((starts >= 0).sum())
    counts = torch.bincount(ids[ids >= 0], minlength=E)
    assert nblk == int(((counts + 63) // 64).sum())  # blocks of <= 64 pairs of one expert
    big = _check(z, tw, ids, kw, dt, "situ", 25.0, dict(variant="dot"))
    monkeypatch.setattr(moe, "DOT_BM_LARGE", 16)
    assert moe.dot_block_rows(T * k, E) == 16
    small = _check(z, tw, ids, kw, dt, "situ", 25.0, dict(variant="dot"))
    assert abs(big - small) < (1e-5 if dt == torch.float32 else 2e-2)


def test_dot_block_rows_threshold(monkeypatch):
    """16-row blocks below DOT_BM_MIN_PAIRS_PER_EXPERT pairs per expert on average (decode batches), 64 above."""
    monkeypatch.setattr(moe, "DOT_BM_LARGE", 64)
    E = 64
    assert moe.dot_block_rows(moe.DOT_BM_MIN_PAIRS_PER_EXPERT * E - 1, E) == moe.BM == 16
    assert moe.dot_block_rows(moe.DOT_BM_MIN_PAIRS_PER_EXPERT * E, E) == 64
    assert moe.dot_block_rows(64 * 8, E) == 16  # B=64 decode, top-8: 8 pairs per expert
    assert moe.dot_block_rows(2048 * 8, E) == 64  # a 2K prefill chunk


_AOT_LARGE_BLOCKS = """
import torch
from k3serve.kernels.reference.mxfp4 import mxfp4_quantize
from k3serve.kernels.triton import moe
from k3serve.kernels.triton.aot_check import capture_compiles
T, E, k, DIN, I, DOUT = 2048, 64, 8, 1024, 768, 1024  # the small preset's LatentMoE, a 2K prefill chunk
g = torch.Generator().manual_seed(0)
w13p, w13s = mxfp4_quantize(torch.randn(E, 2 * I, DIN, generator=g) * 0.1)
w2p, w2s = mxfp4_quantize(torch.randn(E, DOUT, I, generator=g) * 0.1)
ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
moe.DOT_BM_LARGE = 64
with capture_compiles() as reps:
    moe.moe_experts_triton(torch.randn(T, DIN).bfloat16(), torch.rand(T, k), ids, w13_packed=w13p, w13_scale=w13s,
                           w2_packed=w2p, w2_scale=w2s, variant="dot")
for r in reps:
    print(r.line())
"""


def test_dot_large_blocks_compile_for_sm90():
    """The 64-row "dot" kernels compile for an H200 (sm_90) through Triton's full pipeline on this CPU
    (kernels/triton/aot_check.py, a process without the interpreter): wgmma, no spills."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _AOT_LARGE_BLOCKS], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("_moe_dot")]
    assert len(lines) == 2 and all("'BMR': 64" in ln for ln in lines), r.stdout
    assert all(" spills=0 " in ln and "wgmma=True" in ln for ln in lines), r.stdout


@pytest.mark.parametrize("shape", [(3, 40, 96), (2, 5, 32), (1, 17, 544)])
def test_mxfp4_to_dense_is_the_decode(shape):
    """`moe.mxfp4_to_dense` (one Triton pass) == the reference dequantization, every value, in bf16 and fp32,
    at K not a multiple of the kernel's column tile; a scale byte of 0 decodes to 0 as in the fused kernels."""
    g = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(*shape, generator=g) * 3
    packed, scale = mxfp4_quantize(w)
    scale[0, 0, 0] = 0
    want = mxfp4_dequantize(packed, scale)
    want[0, 0, :32] = 0
    for dt in (torch.float32, torch.bfloat16):
        got = moe.mxfp4_to_dense(packed, scale, dt)
        assert got.dtype == dt and got.shape == w.shape
        assert torch.equal(got.float(), want.to(dt).float())


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act,lin", [("situ", 25.0), ("silu", None)])
def test_dense_variant(monkeypatch, dt, act, lin):
    """The "dense" variant (experts decoded once, then the "dot" kernels on 16-bit weights with 64-row blocks):
    equal to the reference and to the MXFP4 "dot" path, blocks spanning several 64-row tiles and a partial one,
    some pairs invalid; "auto" takes it from DENSE_MIN_PAIRS_PER_EXPERT pairs per expert in 16-bit only."""
    T, E, k = 150, 4, 2
    z, tw, ids, kw = _case(T, E, k, 96, 64, 72, (True, True), seed=5)
    ids[::5, 1] = -1
    dense = _check(z, tw, ids, kw, dt, act, lin, dict(variant="dense"))
    dot = _check(z, tw, ids, kw, dt, act, lin, dict(variant="dot"))
    assert abs(dense - dot) < (1e-5 if dt == torch.float32 else 2e-2)
    seen = []
    real = moe._dot_path
    monkeypatch.setattr(moe, "_dot_path", lambda *a, **kw_: seen.append((a[6], kw_.get("bm"))) or real(*a, **kw_))
    monkeypatch.setattr(moe, "DENSE_MIN_PAIRS_PER_EXPERT", 64)  # 300 pairs over 4 experts: 75 per expert
    _check(z, tw, ids, kw, dt, act, lin, dict(variant="auto"))
    assert seen[-1] == ((False, 64) if dt == torch.bfloat16 else (True, None))  # fp32 keeps the MXFP4 "dot"
    monkeypatch.setattr(moe, "DENSE_MIN_PAIRS_PER_EXPERT", 76)
    _check(z, tw, ids, kw, dt, act, lin, dict(variant="auto"))
    assert seen[-1] == (True, None)


@pytest.mark.parametrize("packed", [True, False], ids=["mxfp4", "unpacked"])
def test_dense_variant_per_pair_sum(monkeypatch, packed):
    """From PAIR_SUM_MIN_PAIRS pairs the "dense" down GEMM stores each pair's weighted row and one kernel sums each
    token's rows (no atomics): equal to the reference and to the atomic combine, invalid pairs (never written)
    left out of the sums, tokens whose every pair is invalid give 0; above PAIR_SUM_MAX_BYTES, or with 0, atomics."""
    T, E, k, DOUT = 90, 4, 3, 40
    z, tw, ids, kw = _case(T, E, k, 64, 64, DOUT, (packed, packed), seed=11)
    ids[::4, 1] = -1
    ids[7] = -1  # a token with no valid pair
    launched = []
    real = moe._moe_pair_sum_kernel
    monkeypatch.setattr(moe, "_moe_pair_sum_kernel", type("K", (), {"__getitem__": lambda self, grid: (
        launched.append(grid) or real[grid])})())
    monkeypatch.setattr(moe, "PAIR_SUM_MIN_PAIRS", T * k)
    out_pair = moe_experts_triton(z, tw, ids, variant="dense", **kw)
    assert launched == [(T, 1)]
    _check(z, tw, ids, kw, torch.float32, "situ", None, dict(variant="dense"))
    assert torch.equal(out_pair[7], torch.zeros(DOUT))
    monkeypatch.setattr(moe, "PAIR_SUM_MIN_PAIRS", T * k + 1)  # one pair short: the atomic combine
    out_atomic = moe_experts_triton(z, tw, ids, variant="dense", **kw)
    assert len(launched) == 2 and rel(out_pair, out_atomic) < 1e-6
    monkeypatch.setattr(moe, "PAIR_SUM_MIN_PAIRS", 1)
    monkeypatch.setattr(moe, "PAIR_SUM_MAX_BYTES", T * k * DOUT * 4 - 1)  # the buffer one byte too large
    moe_experts_triton(z, tw, ids, variant="dense", **kw)
    monkeypatch.setattr(moe, "PAIR_SUM_MIN_PAIRS", 0)
    monkeypatch.setattr(moe, "PAIR_SUM_MAX_BYTES", 1 << 40)
    moe_experts_triton(z, tw, ids, variant="dense", **kw)
    assert len(launched) == 2


def test_dense_variant_thresholds(monkeypatch):
    """`takes_dense`: prefill-sized 16-bit batches, with MXFP4 weights (not above DENSE_MAX_BYTES decoded) or
    unpacked ones in the activations' dtype (no scratch: any size); never a mix of the two."""
    E = 64
    n = moe.DENSE_MIN_PAIRS_PER_EXPERT * E
    big = moe.DENSE_MAX_BYTES // 2 + 1
    for kind in ("mxfp4", "unpacked"):
        assert moe.takes_dense(n, E, kind, torch.bfloat16, 10**6)
        assert moe.takes_dense(n, E, kind, torch.float16, 10**6)
        assert not moe.takes_dense(n - 1, E, kind, torch.bfloat16, 10**6)
        assert not moe.takes_dense(n, E, kind, torch.float32, 10**6)
    assert not moe.takes_dense(n, E, "mxfp4", torch.bfloat16, big)
    assert moe.takes_dense(n, E, "unpacked", torch.bfloat16, big)
    assert not moe.takes_dense(n, E, None, torch.bfloat16, 10**6)
    monkeypatch.setattr(moe, "DENSE_MIN_PAIRS_PER_EXPERT", 0)
    assert not moe.takes_dense(10**6, E, "mxfp4", torch.bfloat16, 10**6)
    assert not moe.takes_dense(10**6, E, "unpacked", torch.bfloat16, 10**6)
    w = torch.zeros(2, 4, 8)
    assert moe.dense_weights(True, True, w, w, torch.bfloat16) == "mxfp4"
    assert moe.dense_weights(False, False, w.bfloat16(), w.bfloat16(), torch.bfloat16) == "unpacked"
    assert moe.dense_weights(False, False, w, w, torch.bfloat16) is None  # fp32 experts, bf16 activations
    assert moe.dense_weights(True, False, w, w, torch.float32) is None
    with pytest.raises(ValueError, match="dense"):
        z, tw, ids, kw = _case(4, 4, 2, 64, 32, 32, (True, False), seed=1)
        moe_experts_triton(z, tw, ids, variant="dense", **kw)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_dense_variant_on_unpacked_weights(monkeypatch, dt):
    """Unpacked experts (Kimi-Linear checkpoints) take the "dense" variant as they are: 64-row blocks, no decode
    (`mxfp4_to_dense` is not called), equal to the reference and to the 16-row "dot" path; "auto" takes it from
    DENSE_MIN_PAIRS_PER_EXPERT pairs per expert in 16-bit activations only."""
    T, E, k = 150, 4, 2
    z, tw, ids, kw = _case(T, E, k, 96, 64, 72, (False, False), seed=7)
    ids[::7, 0] = -1
    monkeypatch.setattr(moe, "mxfp4_to_dense", lambda *a, **k_: pytest.fail("unpacked weights were decoded"))
    seen = []
    real = moe._dot_path
    monkeypatch.setattr(moe, "_dot_path", lambda *a, **kw_: seen.append(kw_.get("bm")) or real(*a, **kw_))
    dense = _check(z, tw, ids, kw, dt, "situ", None, dict(variant="dense"))
    assert seen[-1] == moe.DENSE_BM
    dot = _check(z, tw, ids, kw, dt, "situ", None, dict(variant="dot"))
    assert seen[-1] is None and abs(dense - dot) < (1e-5 if dt == torch.float32 else 2e-2)
    monkeypatch.setattr(moe, "DENSE_MIN_PAIRS_PER_EXPERT", 64)  # 300 pairs over 4 experts: 75 per expert
    _check(z, tw, ids, kw, dt, "situ", None, dict(variant="auto"))
    assert seen[-1] == (moe.DENSE_BM if dt == torch.bfloat16 else None)
    monkeypatch.setattr(moe, "DENSE_MIN_PAIRS_PER_EXPERT", 76)
    _check(z, tw, ids, kw, dt, "situ", None, dict(variant="auto"))
    assert seen[-1] is None
