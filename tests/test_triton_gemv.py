"""The skinny GEMM (kernels/triton/gemv.py) under the CPU interpreter against `reference.linear` computed in
float64 from the same rounded operands: random shapes (M 1..16 with small weights, N and K not multiples of the
tiles), mixed operand dtypes with the compute-dtype cast folded into the load, strided rows,
several K iterations, and the dispatch through `k3serve.kernels.ops.linear`.

Tolerances: fp32 outputs rtol 1e-5 of the row scale (fp32 sums in another order); bf16/fp16 outputs within one
ulp of the float64 value (fp32 accumulation, one rounding at the end) plus the interpreter's bf16 truncation.
"""

import random

import _triton_cpu  # (sets TRITON_INTERPRET=1 first)
import pytest
import torch

from k3serve.kernels import ops, triton_ops
from k3serve.kernels import reference as R
from k3serve.kernels.triton import gemv as G

pytestmark = _triton_cpu.skip_on_cuda

BF, F32, F16 = torch.bfloat16, torch.float32, torch.float16


def _to(t: torch.Tensor, dt: torch.dtype, trunc: bool) -> torch.Tensor:
    """t rounded to dt; `trunc`: fp32 -> bf16 by truncation, as the interpreter converts (the GPU rounds)."""
    if trunc and t.dtype == F32 and dt == BF:
        return ((t.view(torch.int32) >> 16) << 16).view(F32).to(BF)
    return t.to(dt)


def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, dt: torch.dtype) -> None:
    assert y.dtype == dt and y.shape == (x.shape[0], w.shape[0])
    assert torch.isfinite(y).all()
    worst = []
    for trunc in (False, True):
        xd, wd = _to(x, dt, trunc).double(), _to(w, dt, trunc).double()
        ref = xd @ wd.T
        err = (y.double() - ref).abs()
        scale = xd.abs() @ wd.abs().T  # sum |x||w|: what summing in another order moves
        if dt == F32:
            bound = 1e-5 * scale + 1e-30
        else:
            bound = 2 * torch.finfo(dt).eps * ref.abs() + 1e-6 * scale + 1e-30
        worst.append(float((err / bound).max()))
    assert min(worst) <= 1.0, f"max err/bound {worst}"


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes_and_dtypes(seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    M = rng.choice([1, 1, 2, 3, 8, 16])
    N = rng.randint(1, 300)
    K = 8 * rng.randint(1, 90)
    x_dt, w_dt, dt = rng.choice([(BF, BF, None), (F32, F32, None), (F16, F16, None), (F32, BF, BF),
                                 (BF, F32, F32)])
    x = torch.randn(M, K, generator=g).to(x_dt)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(w_dt)
    assert G.supported(x, w, dt)
    y = G.skinny_linear_triton(x, w, dt)
    check(y, x, w, dt or x_dt)


@pytest.mark.parametrize("M", [1, 5])
def test_strided_rows_and_several_k_iterations(M):
    """x as a column slice of a wider tensor (row stride != K, as the merged projections' split parts are), small
    tiles so the K loop runs several masked iterations and the grid has a partial last block."""
    g = torch.Generator().manual_seed(M)
    wide = torch.randn(M, 400, generator=g).to(BF)
    x = wide[:, 16:16 + 200]
    w = torch.randn(37, 200, generator=g).to(BF)
    assert x.stride(0) == 400 and G.supported(x, w)
    for bn, bk in [(4, 64), (16, 32)]:
        check(G.skinny_linear_triton(x, w, block_n=bn, block_k=bk), x, w, BF)


def test_dispatch_and_fallbacks(monkeypatch):
    """ops.linear: M <= 16 with a small weight on the kernel, M = 17, 0 rows, K not a multiple of 8, 3-D x and 2 rows
    with a large weight on the reference op (same values either way); SKINNY_GEMM off sends everything there."""
    monkeypatch.setenv("K3SERVE_KERNELS", "triton")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 64, generator=g).to(BF)
    calls = []
    orig = G.skinny_linear_triton
    monkeypatch.setattr(G, "skinny_linear_triton", lambda *a, **k: calls.append(a[0].shape) or orig(*a, **k))
    for shape in [(16, 64), (17, 64), (0, 64), (2, 3, 64)]:
        x = torch.randn(*shape, generator=g).to(BF)
        y = ops.linear(x, w)
        torch.testing.assert_close(y.float(), R.linear(x, w).float(), rtol=1e-2, atol=1e-2)
    assert calls == [(16, 64)]
    x = torch.randn(1, 12, generator=g)
    assert not G.supported(x, torch.randn(5, 12, generator=g))  # K % 8 != 0
    big = torch.empty(1024, 1024, dtype=F32)  # 4 MB: one row yes, two rows no
    assert G.supported(torch.randn(1, 1024), big) and not G.supported(torch.randn(2, 1024), big)
    monkeypatch.setattr(triton_ops, "SKINNY_GEMM", False)
    ops.linear(torch.randn(1, 64, generator=g).to(BF), w)
    assert calls == [(16, 64)]


def test_default_config_fills_the_gpu():
    """At least two programs per SM where N allows, a weight tile of at most 16 KB per K iteration."""
    for N, K in [(2048, 2048), (8336, 2048), (2048, 1024), (64, 2048), (2048, 6144), (2048, 128)]:
        for elem in (2, 4):
            c = G.default_config(N, K, elem, 132)
            assert c["block_n"] * c["block_k"] * elem <= 16384
            assert -(-N // c["block_n"]) >= min(264, N)
