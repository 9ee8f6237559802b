"""Skinny GEMM for decode-sized batches: y[M, N] = x[M, K] @ w[N, K]^T with M <= 16 rows, one launch.

Contract: `k3serve.kernels.reference.linear(x, weight, dtype)`: both operands rounded to the compute dtype
`dtype` (default x's) as they are loaded, products summed in fp32, y in `dtype`. So a cast of x before the
projection (`linear(x.to(fp32), w_fp32)` for the router, `linear(y_fp32.to(bf16), w)` after the KDA decode) is
folded into the load instead of being a kernel of its own.

Why: at decode batch sizes a projection reads its whole weight (4-50 MB in the `small` preset) to make 1-16
rows; cuBLAS takes ~5 µs for the 4-17 MB ones (docs/kernels-notes.md, session 3), launch-bound below the
H200's bandwidth. Two paths, both reading every weight byte once with 16-byte loads along K:
* M == 1 ("fma"): each program owns BLOCK_N output rows and keeps a [BLOCK_N, BLOCK_K] fp32 partial-product
  tile in registers over the K loop (no reduction inside the loop), one reduction at the end. BLOCK_K up to
  the whole row, so one iteration has a large load in flight per program.
* 2 <= M <= 16 ("dot"): x padded to 16 rows, tl.dot per [BLOCK_N, BLOCK_K] weight tile (mma), software-
  pipelined over K (num_stages).
No split-K: the grid is cdiv(N, BLOCK_N), BLOCK_N sized so that the grid covers the SMs several times.
Grids depend on shapes only (no host sync): the calls are captured in CUDA graphs. Knobs (keyword arguments
of `skinny_linear_triton`, for the GPU sweep benchmarks/sweep_gemv.py): block_n, block_k, num_warps, num_stages.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import TL_DTYPE, interpreting, next_pow2

MAX_ROWS = 16
"""Largest M this kernel takes; larger batches stay on cuBLAS (torch.nn.functional.linear)."""

_TILE_BYTES = 16384
"""Weight bytes per program per K iteration on the M == 1 path (enough loads in flight per SM)."""


@triton.jit
def _gemv_fma_kernel(x_ptr, w_ptr, y_ptr, N, K, x_stride, w_stride, CDT: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
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


@triton.jit
def _gemv_dot_kernel(x_ptr, w_ptr, y_ptr, M, N, K, x_stride, w_stride, y_stride, CDT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     PRECISION: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = rn < N
    rn_safe = tl.where(mn, rn, 0).to(tl.int64)
    rm = tl.arange(0, BLOCK_M)
    mm = rm < M
    rm_safe = tl.where(mm, rm, 0).to(tl.int64)
    w_row = w_ptr + rn_safe[:, None] * w_stride
    x_row = x_ptr + rm_safe[:, None] * x_stride
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + cols
        if EVEN_K:
            w = tl.load(w_row + kk[None, :])
            x = tl.load(x_row + kk[None, :])
        else:
            mk = kk < K
            w = tl.load(w_row + kk[None, :], mask=mk[None, :], other=0.0)
            x = tl.load(x_row + kk[None, :], mask=mk[None, :], other=0.0)
        acc = tl.dot(x.to(CDT), tl.trans(w.to(CDT)), acc, input_precision=PRECISION)
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * y_stride + rn[None, :], acc.to(CDT),
             mask=mm[:, None] & mn[None, :])


def supported(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """True when this kernel takes the call: 2-D x with 1..16 rows and unit column stride, a 2-D weight with unit
    column stride, fp16/bf16/fp32 operands and compute dtype, K a multiple of 8 (16-byte rows), on CUDA (or on
    the CPU under the Triton interpreter)."""
    dt = dtype or x.dtype
    on = x.is_cuda or (interpreting() and x.device.type == "cpu")
    return (on and weight.device == x.device and x.dim() == 2 and weight.dim() == 2
            and 1 <= x.shape[0] <= MAX_ROWS and x.shape[1] == weight.shape[1] and x.shape[1] % 8 == 0
            and x.dtype in TL_DTYPE and weight.dtype in TL_DTYPE and dt in TL_DTYPE
            and (x.stride(1) == 1 or x.shape[1] == 1) and weight.stride(1) == 1)


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_config(M: int, N: int, K: int, elem: int, sms: int) -> dict:
    """The knobs for one shape (see the module docstring)."""
    if M == 1:
        bk = min(next_pow2(K), max(256, _TILE_BYTES // (4 * elem)))
        bn = max(1, min(64, _TILE_BYTES // (bk * elem)))
        while bn > 1 and triton.cdiv(N, bn) < 2 * sms:
            bn //= 2
        return dict(block_n=bn, block_k=bk, num_warps=4, num_stages=1)
    bk = min(next_pow2(K), 256 if elem <= 2 else 128)
    bn = 32 if triton.cdiv(N, 32) >= 2 * sms else 16
    return dict(block_n=bn, block_k=bk, num_warps=4, num_stages=4)


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype | None = None, *,
                         block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                         num_stages: int | None = None) -> torch.Tensor:
    """`reference.linear` for `supported` inputs (M <= 16 rows): y [M, N] in `dtype` (default x's dtype)."""
    dt = dtype or x.dtype
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=dt, device=x.device)
    if N == 0:
        return y
    elem = max(x.element_size(), weight.element_size())
    cfg = default_config(M, N, K, elem, _sms(x.device))
    bn = block_n or cfg["block_n"]
    bk = block_k or cfg["block_k"]
    nw = num_warps or cfg["num_warps"]
    ns = num_stages or cfg["num_stages"]
    grid = (triton.cdiv(N, bn),)
    even = K % bk == 0
    if M == 1:
        _gemv_fma_kernel[grid](x, weight, y, N, K, x.stride(0), weight.stride(0), CDT=TL_DTYPE[dt], BLOCK_N=bn,
                               BLOCK_K=bk, EVEN_K=even, num_warps=nw, num_stages=ns)
    else:
        bn = max(bn, 16)  # tl.dot needs every dimension >= 16
        bk = max(bk, 16)
        even = K % bk == 0
        grid = (triton.cdiv(N, bn),)
        prec = "ieee" if dt == torch.float32 else "tf32"
        _gemv_dot_kernel[grid](x, weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0), CDT=TL_DTYPE[dt],
                               BLOCK_M=MAX_ROWS, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=even, PRECISION=prec,
                               num_warps=nw, num_stages=ns)
    return y
