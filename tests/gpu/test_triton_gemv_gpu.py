"""GPU correctness of the skinny GEMM (k3serve.kernels.triton.gemv) through `k3serve.kernels.ops.linear`, on the
`small` preset's decode shapes and random ones, against float64 products of the same rounded operands: bf16 and
fp16 within 1 ulp of the float64 value (fp32 accumulation, one rounding) plus fp32 reordering; fp32 rtol 1e-5 of
sum |x||w| (exact fp32 products). Every element of the fresh output is compared. Also: 2..16 rows with small
weights (the router), strided rows, the folded casts (bf16 x with fp32 weights in fp32, fp32 x into bf16),
capture + replay in a CUDA graph, and the calls the kernel does not take (17 rows, several rows with a large
weight) staying on cuBLAS.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from k3serve.kernels import ops  # noqa: E402
from k3serve.kernels.triton import gemv as G  # noqa: E402

DEV = "cuda"
BF, F32, F16 = torch.bfloat16, torch.float32, torch.float16
SMALL_SHAPES = [(8336, 2048), (2048, 2048), (3392, 2048), (3072, 768), (4096, 2048), (2048, 1024), (2048, 1536),
                (12288, 2048), (2048, 6144), (64, 2048), (576, 2048)]  # (N, K) of the small preset's projections


def check(y, x, w, dt):
    assert y.is_cuda and y.dtype == dt and y.shape == (x.shape[0], w.shape[0])
    xd, wd = x.to(dt).double(), w.to(dt).double()
    ref = xd @ wd.T
    err = (y.double() - ref).abs()
    scale = xd.abs() @ wd.abs().T
    if dt == F32:
        bound = 1e-5 * scale + 1e-30
    else:
        bound = torch.finfo(dt).eps * ref.abs() + 1e-6 * scale + 1e-30
    assert torch.isfinite(y).all()
    assert bool((err <= bound).all()), f"max err/bound {float((err / bound).max()):.3g}"


def test_small_preset_shapes_bf16_one_row():
    g = torch.Generator().manual_seed(1)
    for N, K in SMALL_SHAPES:
        x = torch.randn(1, K, generator=g).to(BF).to(DEV)
        w = (torch.randn(N, K, generator=g) / K ** 0.5).to(BF).to(DEV)
        assert G.supported(x, w)
        check(ops.linear(x, w), x, w, BF)


@pytest.mark.parametrize("M", [2, 8, 16])
def test_router_rows(M):
    """The router's call: bf16 x [M, 2048], fp32 weight [64, 2048], fp32 products (the cast folded in)."""
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, 2048, generator=g).to(BF).to(DEV)
    w = (torch.randn(64, 2048, generator=g) / 45).to(DEV)
    assert G.supported(x, w, F32)
    check(ops.linear(x, w, F32), x, w, F32)


@pytest.mark.parametrize("seed", range(4))
def test_random_shapes_dtypes_and_casts(seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(100 + seed)
    for _ in range(6):
        M = rng.choice([1, 1, 1, 3, 16])
        N, K = (rng.randint(1, 5000), 8 * rng.randint(1, 700)) if M == 1 else (rng.randint(1, 200), 8 * rng.randint(1, 256))
        x_dt, w_dt, dt = rng.choice([(BF, BF, None), (F32, F32, None), (F16, F16, None), (F32, BF, BF),
                                     (BF, F32, F32)])
        wide = torch.randn(M, K + 24, generator=g).to(x_dt).to(DEV)
        x = wide[:, 8:8 + K]  # strided rows, as the merged projections' parts are
        w = (torch.randn(N, K, generator=g) / K ** 0.5).to(w_dt).to(DEV)
        check(ops.linear(x, w, dt), x, w, dt or x_dt)


def test_cuda_graph_replay_and_cublas_above_16_rows():
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(2048, 2048, generator=g) / 45).to(BF).to(DEV)
    x = torch.randn(1, 2048, generator=g).to(BF).to(DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ops.linear(x, w)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ops.linear(x, w)
    for _ in range(2):
        x.copy_(torch.randn(1, 2048, generator=g).to(BF))
        graph.replay()
        torch.cuda.synchronize()
        check(y, x, w, BF)
    for rows in (17, 2):
        xr = torch.randn(rows, 2048, generator=g).to(BF).to(DEV)
        assert not G.supported(xr, w)
        torch.testing.assert_close(ops.linear(xr, w), torch.nn.functional.linear(xr, w))
