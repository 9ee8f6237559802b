"""GPU correctness of the Triton rms_norm / silu_and_mul / situ_and_mul (k3serve.kernels.triton.pointwise)
against the reference ops, called through `k3serve.kernels.ops` (so the registration in
`k3serve.kernels.triton_ops` is what is tested).

Reference: the reference op on fp32 copies of the inputs (its value before the one final rounding). fp32 outputs:
rtol 2e-5 (the GPU's exp/rsqrt/division are not correctly rounded); fp16/bf16: every element within 1 ulp of that
value and at most 1% of them not equal to it rounded once. Also: the engine's strided views, a large prefill-sized
case, and capture + replay in a CUDA graph (the grids must not depend on data).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from k3serve.kernels import ops, reference  # noqa: E402

DEV = "cuda"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_seed = [4321]


def gen() -> torch.Generator:
    _seed[0] += 1
    return torch.Generator().manual_seed(_seed[0])


def rnd(shape, dtype, g, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


def check(out: torch.Tensor, ref32: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.is_cuda and out.dtype == dtype and out.shape == ref32.shape and out.is_contiguous()
    if out.numel() == 0:
        return
    assert torch.isfinite(out).all()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref32, rtol=2e-5, atol=1e-6)
        return
    fi = torch.finfo(dtype)
    err = (out.double() - ref32.double()).abs()
    bound = fi.eps * ref32.double().abs() + fi.smallest_normal * fi.eps
    assert bool((err <= bound).all()), f"max err/bound {(err / bound).max().item()}"
    mismatch = (out != ref32.to(dtype)).float().mean().item()
    assert mismatch <= 0.01, f"{mismatch:.3%} differ from the once-rounded reference"


# (each new shape/dtype/weight combination is a Triton compile: the weights cycle with the row counts)
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [1, 128, 1000, 2048, 7168])
def test_rms_norm_gpu(D, dt):
    g = gen()
    for rows, wdt in ((0, None), (1, torch.bfloat16), (37, None), (300, torch.float32)):
        x = rnd((rows, D), dt, g, 3.0)
        w = None if wdt is None else rnd((D,), wdt, g)
        check(ops.rms_norm(x, w, 1e-6), reference.rms_norm(x.float(), w, 1e-6), dt)


@pytest.mark.parametrize("dt", DTYPES)
def test_rms_norm_views_gpu(dt):
    g = gen()
    kv_a = rnd((45, 576), dt, g)
    w = rnd((512,), dt, g)
    check(ops.rms_norm(kv_a[:, :512], w, 1e-6), reference.rms_norm(kv_a[:, :512].float(), w, 1e-6), dt)
    x3 = rnd((2, 3, 7, 136), dt, g)[..., :128]  # [T, H, D] heads of a wider buffer
    check(ops.rms_norm(x3, None, 1e-5), reference.rms_norm(x3.float(), None, 1e-5), dt)
    xt = rnd((64, 9), dt, g).t()
    check(ops.rms_norm(xt, w[:64], 1e-5), reference.rms_norm(xt.float(), w[:64], 1e-5), dt)
    x = rnd((33, 7168), dt, g, 10.0)
    w7 = rnd((7168,), torch.float32, g)
    # imported here, not at collection: a module-level import of a Triton kernel module would decorate the
    # shared @triton.jit helpers before the CPU interpreter tests can set TRITON_INTERPRET (see _triton_cpu)
    from k3serve.kernels.triton import pointwise

    check(pointwise.rms_norm_triton(x, w7, 1e-6, max_block_d=1024), reference.rms_norm(x.float(), w7, 1e-6), dt)


def test_rms_norm_large_gpu():
    g = gen()
    x = rnd((4096, 7168), torch.bfloat16, g)
    w = rnd((7168,), torch.bfloat16, g)
    check(ops.rms_norm(x, w, 1e-6), reference.rms_norm(x.float(), w, 1e-6), torch.bfloat16)
    xs = rnd((4096, 2304), torch.bfloat16, g)[:, :2048]
    check(ops.rms_norm(xs, w[:2048], 1e-6), reference.rms_norm(xs.float(), w[:2048], 1e-6), torch.bfloat16)


ACTS = [(False, 4.0, None), (True, 4.0, None), (True, 3.0, 2.5)]


def _act(x, situ, beta, lin):
    if situ:
        return ops.situ_and_mul(x, beta, lin), reference.situ_and_mul(x.float(), beta, lin)
    return ops.silu_and_mul(x), reference.silu_and_mul(x.float())


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 500, 1536])
def test_gated_activations_gpu(n, dt):
    g = gen()
    for rows, acts in ((0, ACTS), (1, ACTS), (37, ACTS[2:]), (300, ACTS)):
        x = rnd((rows, 2 * n), dt, g, 3.0)
        for situ, beta, lin in acts:
            out, ref32 = _act(x, situ, beta, lin)
            check(out, ref32, dt)


@pytest.mark.parametrize("dt", DTYPES)
def test_gated_activations_views_and_large_gpu(dt):
    g = gen()
    base = rnd((41, 3100), dt, g, 2.0)
    for situ, beta, lin in ACTS:
        for x in (base[:, 10:3082], rnd((2, 3, 96), dt, g), rnd((2 * 48, 3), dt, g).t()):
            check(*_act(x, situ, beta, lin), dt)
    x = rnd((4096, 2 * 1536), dt, g, 3.0)
    for situ, beta, lin in ACTS:
        check(*_act(x, situ, beta, lin), dt)
    ext = torch.tensor([0.0, 1e-6, -1e-6, 0.5, -0.5, 30.0, -30.0, 100.0, -100.0, 1e4, -1e4], device=DEV)
    x = torch.cat([ext, ext.flip(0)])[None].to(dt)
    for situ, beta, lin in ACTS:
        out, ref32 = _act(x, situ, beta, lin)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), ref32.to(dt).float(), rtol=2e-2, atol=1e-5)


def test_cuda_graph_capture_gpu():
    g = gen()
    x = rnd((5, 576), torch.bfloat16, g)
    w = rnd((512,), torch.bfloat16, g)
    a = rnd((5, 2 * 768), torch.bfloat16, g)
    fns = [lambda: ops.rms_norm(x[:, :512], w, 1e-6), lambda: ops.silu_and_mul(a),
           lambda: ops.situ_and_mul(a, 4.0, 2.0)]
    refs = [lambda: reference.rms_norm(x[:, :512].float(), w, 1e-6), lambda: reference.silu_and_mul(a.float()),
            lambda: reference.situ_and_mul(a.float(), 4.0, 2.0)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [f() for f in fns]
    x.copy_(rnd((5, 576), torch.bfloat16, g))
    a.copy_(rnd((5, 2 * 768), torch.bfloat16, g))
    graph.replay()
    torch.cuda.synchronize()
    for out, ref in zip(outs, refs):
        check(out, ref(), torch.bfloat16)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("D,knobs", [(1024, {}), (7168, {}), (1000, {"max_block_d": 128})],
                         ids=["1024", "7168", "chunked"])
def test_add_rms_norm_gpu(D, dt, knobs):
    """One launch == torch's add and the Triton norm of its result, bit for bit (the sum rounded once, as the add
    rounds; the norm of that rounded sum, same tiles); the chunked form reads its own stores back after a barrier.
    Also under capture: replayed on new inputs."""
    from k3serve.kernels.triton import pointwise as P

    g = gen()
    for rows in (1, 32, 513):
        x, r, w = rnd((rows, D), dt, g), rnd((rows, D), dt, g, 4.0), rnd((D,), torch.float32, g)
        y, s = P.add_rms_norm_triton(x, r, w, 1e-6, **knobs) if knobs else ops.add_rms_norm(x, r, w, 1e-6)
        assert torch.equal(s, x + r)
        assert torch.equal(y, P.rms_norm_triton(x + r, w, 1e-6, **knobs))
        check(y, reference.rms_norm((x + r).float(), w, 1e-6), dt)
    x, r = rnd((8, D), dt, g), rnd((8, D), dt, g)
    graph = torch.cuda.CUDAGraph()
    ops.add_rms_norm(x, r, w, 1e-6)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        y, s = ops.add_rms_norm(x, r, w, 1e-6)
    x.copy_(rnd((8, D), dt, g))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(s, x + r) and torch.equal(y, ops.rms_norm(x + r, w, 1e-6))


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_kda_gate_gpu(dt, lower_bound):
    """KDA's log-decay gate (one launch through ops.kda_gate) against the float64 reference: a prefill-sized column
    slice (the engine's f_b projection rows), raw values across softplus's range; within 2e-5 relative (the GPU's
    fast exp) plus 1e-12 absolute; the same in a CUDA graph replay."""
    g = gen()
    T, H, D = 4099, 16, 128
    A_log = torch.randn(H, generator=g).to(DEV)
    bias = torch.randn(H * D, generator=g).to(DEV)
    raw = torch.randn(T, H * D + 64, generator=g) * 12
    raw[0, :6] = torch.tensor([25.0, 20.5, 19.5, -9.0, -30.0, -60.0])
    x = raw.to(dt).to(DEV)[:, : H * D].view(T, H, D)
    want = reference.kda_gate(x.double().cpu(), A_log.double().cpu(), bias.double().cpu(), lower_bound)
    got = ops.kda_gate(x, A_log, bias, lower_bound)
    torch.cuda.synchronize()
    assert got.dtype == torch.float32 and got.shape == (T, H, D)
    assert ((got.double().cpu() - want).abs() <= 2e-5 * want.abs() + 1e-12).all()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.kda_gate(x, A_log, bias, lower_bound)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_gated_gpu(out_dtype):
    """KDA's gated output norm (one launch through ops.rms_norm_gated) at a prefill size, bf16 x and gate, fp32
    weight (the engine's call): fp32 out within 2e-5 of the reference's fp32 value, bf16 out within one ulp of it
    (at most 1 % not equal to it rounded once)."""
    g = gen()
    T, H, V = 4099, 16, 128
    x = rnd((T, H, V), torch.bfloat16, g)
    gate = rnd((T, H, V), torch.bfloat16, g, 4.0)
    w = torch.randn(V, generator=g).to(DEV)
    check(ops.rms_norm_gated(x, gate, w, 1e-5, out_dtype), reference.rms_norm_gated(x, gate, w, 1e-5, torch.float32),
          out_dtype)
