"""Triton rms_norm / silu_and_mul / situ_and_mul under the CPU interpreter, against the reference ops: fp32, bf16,
fp16; ragged and odd sizes; 0, 1, 3, 37 rows; weights None / bf16 / fp32; strided row views; leading dims; the
chunked long-row path; the dispatch through `k3serve.kernels.ops` under K3SERVE_KERNELS=triton.

Tolerances: fp32 rtol 1e-5. fp16/bf16: every element within 1 ulp of the reference's fp32 value before its one
rounding, and (almost) all elements equal to that value rounded once (a second rounding, e.g. of an intermediate
to the activation dtype, would break this). The interpreter converts fp32 -> bf16 by truncation (the GPU rounds to
nearest even), so bf16 outputs are also accepted as the truncated fp32 reference.
"""

import _triton_cpu  # (sets TRITON_INTERPRET=1 first)
import pytest
import torch

from k3serve.kernels import ops
from k3serve.kernels import reference as R
from k3serve.kernels.triton import pointwise as P

pytestmark = _triton_cpu.skip_on_cuda

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _trunc_bf16(v: torch.Tensor) -> torch.Tensor:
    return ((v.view(torch.int32) >> 16) << 16).view(torch.float32).to(torch.bfloat16)


def check(out: torch.Tensor, ref32: torch.Tensor, dtype: torch.dtype) -> None:
    """out (dtype) vs the reference computed in fp32 (ref32, not yet rounded)."""
    assert out.dtype == dtype and out.shape == ref32.shape and out.is_contiguous()
    if out.numel() == 0:
        return
    assert torch.isfinite(out).all()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref32, rtol=1e-5, atol=1e-6)
        return
    fi = torch.finfo(dtype)
    err = (out.double() - ref32.double()).abs()
    bound = fi.eps * ref32.double().abs() + fi.smallest_normal * fi.eps  # 1 ulp (subnormals: absolute)
    assert bool((err <= bound).all()), f"max err/bound {(err / bound).max().item()}"
    rounded = [ref32.to(dtype)] + ([_trunc_bf16(ref32)] if dtype == torch.bfloat16 else [])
    mismatch = min((out != r).float().mean().item() for r in rounded)
    assert mismatch <= 0.01, f"{mismatch:.3%} of the outputs differ from the once-rounded reference"


def _x(shape, dtype, g, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


# ---------------------------------------------------------------- rms_norm
def _rms_case(x, w, eps=1e-6, **kw):
    out = P.rms_norm_triton(x, w, eps, **kw)
    ref32 = R.rms_norm(x.float(), w, eps)  # the same math before the final rounding
    check(out, ref32, x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [1, 48, 128, 1000, 2048])
def test_rms_norm_shapes_weights(dtype, D):
    g = torch.Generator().manual_seed(D)
    weights = [None, (torch.rand(D, generator=g) + 0.5).to(torch.bfloat16), torch.randn(D, generator=g)]
    for rows in (0, 1, 3, 37):
        x = _x((rows, D), dtype, g, scale=3.0)
        for w in weights:
            _rms_case(x, w, eps=1e-6 if rows != 3 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_views_and_leading_dims(dtype):
    g = torch.Generator().manual_seed(7)
    base = _x((37, 576), dtype, g)
    w = torch.rand(512, generator=g).to(dtype)
    view = base[:, :512]  # the engine's kv_a[:, :512]
    xr, rows, stride = P._as_rows(view)
    assert xr.data_ptr() == view.data_ptr() and (rows, stride) == (37, 576)  # read in place, no copy
    _rms_case(view, w)
    _rms_case(base[5:9, 64:], None)  # offset start, odd width
    _rms_case(_x((2, 3, 48), dtype, g), torch.randn(48, generator=g))
    b3 = _x((2, 3, 53), dtype, g)
    v3 = b3[:, :, 2:50]  # leading dims collapse: one strided row dim
    assert P._as_rows(v3)[2] == 53
    _rms_case(v3, None)
    v4 = b3[:, :2, :48]  # leading dims do not collapse: copied first
    _rms_case(v4, torch.randn(48, generator=g))
    _rms_case(_x((48, 5), dtype, g).t(), None)  # column stride != 1
    _rms_case(_x((1, 48), dtype, g).expand(4, 48), None)  # row stride 0
    _rms_case(_x((100,), dtype, g), torch.randn(100, generator=g))  # 1-D
    assert P.rms_norm_triton(_x((3, 0), dtype, g), None, 1e-6).shape == (3, 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_chunked_long_rows_and_knobs(dtype):
    g = torch.Generator().manual_seed(11)
    w = torch.randn(1000, generator=g)
    x = _x((5, 1000), dtype, g, scale=10.0)
    _rms_case(x, w, max_block_d=128)  # 8 chunks, ragged last chunk
    _rms_case(x, None, block_d=64, block_m=4)
    _rms_case(x, w, block_m=1, num_warps=2)
    _rms_case(_x((6, 7168), dtype, g), torch.randn(7168, generator=g).to(torch.bfloat16))


def test_rms_norm_mixed_weight_dtypes():
    g = torch.Generator().manual_seed(3)
    x = _x((9, 130), torch.float16, g)
    _rms_case(x, torch.randn(130, generator=g).to(torch.bfloat16))
    xf = _x((9, 130), torch.float32, g)
    w64 = torch.randn(130, generator=g, dtype=torch.float64)  # reference casts it to fp32 too
    torch.testing.assert_close(P.rms_norm_triton(xf, w64, 1e-6), R.rms_norm(xf, w64, 1e-6), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- gated activations
def _act_case(x, situ, beta=4.0, lin=None, **kw):
    if situ:
        out = P.situ_and_mul_triton(x, beta, lin, **kw)
        ref32 = R.situ_and_mul(x.float(), beta, lin)
    else:
        out = P.silu_and_mul_triton(x, **kw)
        ref32 = R.silu_and_mul(x.float())
    check(out, ref32, x.dtype)


ACTS = [(False, 4.0, None), (True, 4.0, None), (True, 3.0, 2.5)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 24, 64, 500, 1024])
def test_gated_activations_shapes(dtype, n):
    g = torch.Generator().manual_seed(100 + n)
    for rows in (0, 1, 3, 37):
        x = _x((rows, 2 * n), dtype, g, scale=3.0)
        for situ, beta, lin in ACTS:
            _act_case(x, situ, beta, lin)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_activations_strided_leading_dims_knobs(dtype):
    g = torch.Generator().manual_seed(5)
    base = _x((37, 3100), dtype, g, scale=2.0)
    view = base[:, 10:3082]  # n = 1536, row stride 3100
    assert P._as_rows(view)[0].data_ptr() == view.data_ptr()
    for situ, beta, lin in ACTS:
        _act_case(view, situ, beta, lin)
        _act_case(_x((2, 3, 96), dtype, g), situ, beta, lin)
        _act_case(view[:7], situ, beta, lin, block_m=2, block_n=128, num_warps=1)
        _act_case(_x((2 * 48, 3), dtype, g).t(), situ, beta, lin)  # column stride != 1
    with pytest.raises(ValueError):
        P.silu_and_mul_triton(_x((2, 7), dtype, g))
    assert P.situ_and_mul_triton(_x((4, 0), dtype, g)).shape == (4, 0)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy overflow in the interpreter (inf handled)
def test_situ_tanh_accuracy_and_extremes():
    # fp32: tanh near 0 (polynomial branch), around the 0.3 switch, and huge |x| (no inf/NaN)
    g = torch.Generator().manual_seed(9)
    gate = torch.cat([torch.linspace(-3, 3, 4001), torch.tensor([0.0, 1e-30, -1e-20, 1e-6, 1.2, -1.2, 1.1999, 1.2001,
                                                                 88.0, -88.0, 100.0, -100.0, 1e4, -1e4, 3e38, -3e38])])
    up = torch.randn(gate.numel(), generator=g)
    x = torch.cat([gate, up])[None]
    for beta, lin in ((4.0, None), (1.0, 0.5), (4.0, 1e-3)):
        out = P.situ_and_mul_triton(x, beta, lin)
        ref = R.situ_and_mul(x, beta, lin)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-30)
    t = torch.cat([torch.linspace(-1, 1, 2001), torch.tensor([1e-4, -1e-5, 0.3, -0.3, 0.29999, 0.30001, 40.0])])
    # gate 50: beta * tanh(50) * sigmoid(50) == 1 in fp32, so with linear_beta 1 the output is tanh(up)
    out = P.situ_and_mul_triton(torch.cat([torch.full_like(t, 50.0), t])[None], 1.0, 1.0)
    torch.testing.assert_close(out[0], torch.tanh(t), rtol=2e-6, atol=0)


# ---------------------------------------------------------------- registration / dispatch
def test_dispatch_reaches_triton(monkeypatch):
    from k3serve.kernels import triton_ops

    monkeypatch.setenv("K3SERVE_KERNELS", "triton")
    calls = []
    for name in ("rms_norm_triton", "silu_and_mul_triton", "situ_and_mul_triton"):
        orig = getattr(P, name)
        monkeypatch.setattr(P, name, lambda *a, _o=orig, _n=name, **k: calls.append(_n) or _o(*a, **k))
    g = torch.Generator().manual_seed(2)
    x = _x((3, 64), torch.bfloat16, g)
    w = torch.randn(64, generator=g)
    check(ops.rms_norm(x, w, 1e-5), R.rms_norm(x.float(), w, 1e-5), x.dtype)
    check(ops.silu_and_mul(x), R.silu_and_mul(x.float()), x.dtype)
    check(ops.situ_and_mul(x, 2.0, 3.0), R.situ_and_mul(x.float(), 2.0, 3.0), x.dtype)
    assert calls == ["rms_norm_triton", "silu_and_mul_triton", "situ_and_mul_triton"]
    assert {"rms_norm", "silu_and_mul", "situ_and_mul"} <= set(triton_ops.IMPLS)
    # float64 stays on the reference ops
    xd = x.double()
    assert torch.equal(ops.rms_norm(xd, w, 1e-5), R.rms_norm(xd, w, 1e-5))
    assert torch.equal(ops.situ_and_mul(xd), R.situ_and_mul(xd))
    assert torch.equal(ops.silu_and_mul(xd), R.silu_and_mul(xd))
    assert len(calls) == 3
    assert P.supported(x) and not P.supported(xd)


# ---------------------------------------------------------------- add + RMSNorm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,knobs", [((5, 96), {}), ((3, 2, 200), {}), ((4, 300), {"max_block_d": 64}),
                                         ((1, 7168), {}), ((33, 40), {"block_m": 4})],
                         ids=["small", "3d", "chunked", "wide", "row-blocks"])
def test_add_rms_norm_is_the_add_and_the_norm_apart(dtype, shape, knobs):
    """One launch: the sum rounded to the inputs' dtype (== torch's add, bit for bit) and the norm of that rounded
    sum (== rms_norm_triton of it, bit for bit: same tiles), within the usual rounding of the fp64 reference."""
    g = torch.Generator().manual_seed(len(shape) * 1000 + shape[-1])
    x = _x(shape, dtype, g)
    r = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g)
    y, s = P.add_rms_norm_triton(x, r, w, 1e-5, **knobs)
    want = x + r
    if dtype == torch.bfloat16:  # the interpreter's fp32 -> bf16 may truncate where the GPU rounds (docstring)
        exact = (s == want) | (s == _trunc_bf16(x.float() + r.float()))
        assert bool(exact.all()) and s.dtype == dtype
    else:
        assert torch.equal(s, want) and s.dtype == dtype
    assert torch.equal(y, P.rms_norm_triton(s, w, 1e-5, **knobs))  # the norm of the stored (rounded) sum
    check(y, R.rms_norm(s.float(), w, 1e-5), dtype)
    ry, rs = R.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(rs, want) and torch.equal(ry, R.rms_norm(want, w, 1e-5))


def test_add_rms_norm_strided_rows_and_errors():
    g = torch.Generator().manual_seed(9)
    big = torch.randn(6, 160, generator=g)
    x = big[:, :128]  # a row stride of 160, read in place
    r = torch.randn(6, 128, generator=g)
    y, s = P.add_rms_norm_triton(x, r, None, 1e-6)
    assert torch.equal(s, x + r) and torch.equal(y, P.rms_norm_triton(x + r, None, 1e-6))
    with pytest.raises(ValueError):
        P.add_rms_norm_triton(x, r[:, :64], None, 1e-6)
    with pytest.raises(ValueError):
        P.add_rms_norm_triton(x, r.double(), None, 1e-6)
    with pytest.raises(ValueError):
        R.add_rms_norm(x, r.half(), None, 1e-6)


def test_add_rms_norm_dispatch(monkeypatch):
    monkeypatch.setenv("K3SERVE_KERNELS", "triton")
    calls = []
    orig = P.add_rms_norm_triton
    monkeypatch.setattr(P, "add_rms_norm_triton", lambda *a, **k: calls.append(1) or orig(*a, **k))
    g = torch.Generator().manual_seed(4)
    x, r, w = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g), torch.randn(64, generator=g)
    y, s = ops.add_rms_norm(x, r, w, 1e-5)
    assert calls == [1] and torch.equal(s, x + r)
    yd, sd = ops.add_rms_norm(x.double(), r.double(), w, 1e-5)  # float64 stays on the reference op
    assert calls == [1] and torch.equal(yd, R.rms_norm(x.double() + r.double(), w, 1e-5))
    monkeypatch.setenv("K3SERVE_KERNELS", "")  # CPU tensors outside triton mode: the reference op
    y2, s2 = ops.add_rms_norm(x, r, w, 1e-5)
    assert calls == [1] and torch.equal(y2, R.rms_norm(x + r, w, 1e-5)) and torch.equal(s2, x + r)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kda_gate_matches_reference(dtype, lower_bound):
    """KDA's log-decay gate in one launch: fp32 out within 5e-6 (relative, plus 1e-12 absolute) of the reference on
    raw values across softplus's range (past its threshold of 20, near it, around 0, and far below, where
    log1p(e^z) ~ e^z is 1e-9 and smaller), strided rows, 0 / 1 / 37 rows; wrong weight shapes are a ValueError."""
    g = torch.Generator().manual_seed(3)
    H, D = 3, 16
    A_log = torch.randn(H, generator=g)
    bias = torch.randn(H * D, generator=g)
    for T in (0, 1, 37):
        raw = torch.randn(T, H * D + 8, generator=g) * 12
        if T:
            raw[0, :6] = torch.tensor([25.0, 20.5, 19.5, -9.0, -30.0, -60.0])
            raw[-1, :3] = torch.tensor([1e-3, -1e-3, 0.0])
        x = raw.to(dtype)[:, : H * D].view(T, H, D)  # a column slice: row stride H*D + 8
        got = P.kda_gate_triton(x, A_log, bias, lower_bound)
        want = R.kda_gate(x.double(), A_log.double(), bias.double(), lower_bound)
        assert got.dtype == torch.float32 and got.shape == (T, H, D)
        assert ((got.double() - want).abs() <= 5e-6 * want.abs() + 1e-12).all()
    with pytest.raises(ValueError, match="kda_gate"):
        P.kda_gate_triton(x, A_log[:2], bias, lower_bound)
    with pytest.raises(ValueError, match="kda_gate"):
        P.kda_gate_triton(x, A_log, bias[:-1], lower_bound)


def test_kda_gate_dispatch(monkeypatch):
    """ops.kda_gate under K3SERVE_KERNELS=triton runs the kernel for fp32/bf16 inputs and the reference for float64."""
    from k3serve.kernels import triton_ops

    assert triton_ops.IMPLS["kda_gate"] is triton_ops._kda_gate
    calls = []
    real = P.kda_gate_triton
    monkeypatch.setattr(P, "kda_gate_triton", lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))
    monkeypatch.setenv("K3SERVE_KERNELS", "triton")
    x = torch.randn(5, 2, 8)
    a, b = torch.randn(2), torch.randn(16)
    got = ops.kda_gate(x, a, b)
    assert calls == [torch.float32] and torch.allclose(got, R.kda_gate(x, a, b), rtol=5e-6, atol=1e-12)
    assert ops.kda_gate(x.double(), a, b).dtype == torch.float64 and calls == [torch.float32]


@pytest.mark.parametrize("knobs", [{}, dict(max_block_d=32)], ids=["one-chunk", "chunked"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_gated_matches_reference(out_dtype, knobs):
    """KDA's gated output norm in one launch: rms_norm(x) * sigmoid(gate) in fp32, rounded once to out_dtype; bf16 x
    and a strided gate (a column slice), 0 / 1 / 37 rows of [tokens, heads, V]; the chunked long-row path; fp32 out
    within 2e-6 of the reference, bf16 out within one bf16 ulp of its fp32 value; a gate of another shape: ValueError."""
    g = torch.Generator().manual_seed(9)
    H, V = 3, 128
    w = torch.randn(V, generator=g)
    for T in (0, 1, 37):
        x = torch.randn(T, H, V, generator=g).bfloat16()
        gate = (torch.randn(T, H * V + 16, generator=g) * 4).bfloat16()[:, : H * V].view(T, H, V)
        got = P.rms_norm_gated_triton(x, gate, w, 1e-5, out_dtype, **knobs)
        want = R.rms_norm_gated(x, gate, w, 1e-5, torch.float32).double()
        assert got.dtype == out_dtype and got.shape == (T, H, V)
        tol = 2e-6 if out_dtype == torch.float32 else 2.0**-7
        assert ((got.double() - want).abs() <= tol * want.abs() + 1e-6).all()
    with pytest.raises(ValueError, match="rms_norm_gated"):
        P.rms_norm_gated_triton(x, gate[:, :2], w, 1e-5)
    with pytest.raises(ValueError, match="rms_norm_gated"):
        R.rms_norm_gated(x, gate[:, :2], w, 1e-5)


def test_rms_norm_gated_reference_is_the_composite():
    """The reference op is the engine's former composite (workers/engine/k3_forward.py): rms_norm of x cast to the
    compute dtype, times sigmoid of the gate cast to it, one cast at the end; bit for bit, fp32 and fp64."""
    g = torch.Generator().manual_seed(10)
    for dt, acc in ((torch.bfloat16, torch.float32), (torch.float64, torch.float64)):
        x, gate = torch.randn(5, 2, 16, generator=g).to(dt), torch.randn(5, 2, 16, generator=g).to(dt)
        w = torch.randn(16, generator=g).to(acc)
        old = (R.rms_norm(x.to(acc), w, 1e-6) * torch.sigmoid(gate.to(acc))).to(dt)
        assert torch.equal(R.rms_norm_gated(x, gate, w, 1e-6, dt), old)


def test_rms_norm_gated_dispatch(monkeypatch):
    """ops.rms_norm_gated under K3SERVE_KERNELS=triton: the kernel for 16-bit / fp32 inputs; the reference when x,
    the gate or the weight is float64."""
    from k3serve.kernels import triton_ops

    assert triton_ops.IMPLS["rms_norm_gated"] is triton_ops._rms_norm_gated
    calls = []
    real = P.rms_norm_gated_triton
    monkeypatch.setattr(P, "rms_norm_gated_triton", lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))
    monkeypatch.setenv("K3SERVE_KERNELS", "triton")
    x, gate, w = torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(8)
    got = ops.rms_norm_gated(x, gate, w, 1e-6, torch.bfloat16)
    assert calls == [torch.float32] and got.dtype == torch.bfloat16
    for args in ((x.double(), gate, w), (x, gate.double(), w), (x, gate, w.double())):
        out = ops.rms_norm_gated(*args, 1e-6, torch.float32)
        assert torch.equal(out, R.rms_norm_gated(*args, 1e-6, torch.float32))
    assert calls == [torch.float32]
