"""Skinny GEMM for decode steps of one sequence: y[M, N] = x[M, K] @ w[N, K]^T with M = 1 row (up to 16 rows when
the weight is small), one launch.

Contract: `k3serve.kernels.reference.linear(x, weight, dtype)`: both operands rounded to the compute dtype
`dtype` (default x's) as they are loaded, products summed in fp32, y in `dtype`. So a cast of x before the
projection (`linear(x.to(fp32), w_fp32)` for the router, `linear(y_fp32.to(bf16), w)` after the KDA decode) is
folded into the load instead of being a kernel of its own.

Why: at decode batch sizes a projection reads its whole weight (4-50 MB in the `small` preset) to make one row;
cuBLAS takes 4.6-16 µs for those at M = 1, launch- and latency-bound below the H200's bandwidth
(benchmarks/sweep_gemv.py; docs/kernels-notes.md, session 4). Each program owns BLOCK_N output rows of one input
row and keeps a [BLOCK_N, BLOCK_K] fp32 partial-product tile in registers over the K loop (16-byte loads along K,
no reduction inside the loop), one reduction at the end; BLOCK_K up to 2048, so one iteration has a large load
in flight per program. No split-K: the grid is (input rows, cdiv(N, BLOCK_N)), BLOCK_N sized so that the grid
covers the SMs at least twice.

Which calls it takes (`supported`): every M == 1 projection; 2..16 rows only when the weight is small enough
(<= 2 MB, e.g. the fp32 router) that the programs of the other rows re-read it from L2 rather than HBM - there
the gain is the folded cast. Larger decode batches stay on cuBLAS: a tl.dot variant for 2..16 rows measured
0.7-1.1x cuBLAS (session 4, run 12) and was dropped.
Grids depend on shapes only (no host sync): the calls are captured in CUDA graphs. Knobs (keyword arguments
of `skinny_linear_triton`, for the GPU sweep benchmarks/sweep_gemv.py): block_n, block_k, num_warps, num_stages.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import TL_DTYPE, interpreting, next_pow2

MAX_ROWS = 16
"""Largest M this kernel takes (only with a small weight, see `supported`); larger batches stay on cuBLAS."""

SMALL_WEIGHT_BYTES = 2 << 20
"""With 2..MAX_ROWS rows the weight is read once per row: only weights up to this size (L2-resident)."""

_TILE_BYTES = 16384
"""Weight bytes per program per K iteration on the M == 1 path (enough loads in flight per SM)."""


@triton.jit
def _gemv_fma_kernel(x_ptr, w_ptr, y_ptr, N, K, x_stride, w_stride, y_stride, CDT: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # the input row: the fastest grid axis, so one weight tile's readers run together
    x_ptr += row * x_stride
    y_ptr += row * y_stride
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = rn < N
    rn_safe = tl.where(mn, rn, 0).to(tl.int64)  # rows past N read row 0 (in bounds), their sums are dropped
    w_row = w_ptr + rn_safe[:, None] * w_stride
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + cols
        if EVEN_K:
            w = tl.load(w_row + kk[None, :])
            x = tl.load(x_ptr + kk)
        else:
            mk = kk < K
            w = tl.load(w_row + kk[None, :], mask=mk[None, :], other=0.0)
            x = tl.load(x_ptr + kk, mask=mk, other=0.0)
        acc += w.to(CDT).to(tl.float32) * x.to(CDT).to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + rn, y.to(CDT), mask=mn)


def supported(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """True when this kernel takes the call: 2-D x with one row (or up to MAX_ROWS rows with a weight of at most
    SMALL_WEIGHT_BYTES) and unit column stride, a 2-D weight with unit column stride, fp16/bf16/fp32 operands and
    compute dtype, K a multiple of 8 (16-byte rows), on CUDA (or on the CPU under the Triton interpreter)."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS:  # first: the prefill-sized calls leave here
        return False
    M = x.shape[0]
    if M > 1 and weight.numel() * weight.element_size() > SMALL_WEIGHT_BYTES:
        return False
    dt = dtype or x.dtype
    on = x.is_cuda or (interpreting() and x.device.type == "cpu")
    return (on and weight.device == x.device and weight.dim() == 2
            and x.shape[1] == weight.shape[1] and x.shape[1] % 8 == 0
            and x.dtype in TL_DTYPE and weight.dtype in TL_DTYPE and dt in TL_DTYPE
            and (x.stride(1) == 1 or x.shape[1] == 1) and weight.stride(1) == 1)


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the CPU interpreter: few, large programs (it runs them one by one)
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_config(N: int, K: int, elem: int, sms: int) -> dict:
    """The knobs for one shape (see the module docstring): a <= 16 KB weight tile per K iteration, BLOCK_K up to
    2048, BLOCK_N halved until the grid has two programs per SM (measured within 4 % of the best of 8 settings on
    every small-preset shape at M = 1, run 12)."""
    bk = min(next_pow2(K), max(256, _TILE_BYTES // (4 * elem)))
    bn = max(1, min(64, _TILE_BYTES // (bk * elem)))
    while bn > 1 and triton.cdiv(N, bn) < 2 * sms:
        bn //= 2
    return dict(block_n=bn, block_k=bk, num_warps=4, num_stages=1)


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype | None = None, *,
                         block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                         num_stages: int | None = None) -> torch.Tensor:
    """`reference.linear` for `supported` inputs: y [M, N] in `dtype` (default x's dtype)."""
    dt = dtype or x.dtype
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=dt, device=x.device)
    if N == 0 or M == 0:
        return y
    elem = max(x.element_size(), weight.element_size())
    cfg = default_config(N, K, elem, _sms(x.device))
    bn = block_n or cfg["block_n"]
    bk = block_k or cfg["block_k"]
    _gemv_fma_kernel[(M, triton.cdiv(N, bn))](
        x, weight, y, N, K, x.stride(0), weight.stride(0), y.stride(0), CDT=TL_DTYPE[dt], BLOCK_N=bn, BLOCK_K=bk,
        EVEN_K=K % bk == 0, num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"])
    return y
