"""Row-wise glue ops in Triton, one launch per call: RMSNorm (alone, or after a residual add), the gated
activations SiLU-and-mul and SiTU-and-mul, and KDA's log-decay gate. Contracts: `k3serve.kernels.reference.rms_norm`,
`.add_rms_norm`, `.silu_and_mul`, `.situ_and_mul` (fp32 math for fp16/bf16/fp32 inputs, one rounding to x's dtype at
the end; float64 stays on the reference ops) and `.kda_gate` (fp32 out).

Inputs are seen as [rows, D] with unit last-dim stride and any row stride (e.g. `kv_a[:, :512]` of a [T, 576]
tensor is read in place); layouts that do not collapse to that are made contiguous first. Outputs are new
contiguous tensors. Grids depend on the shapes only (no host sync), so the calls can be captured in CUDA graphs.

Tiling: `_rms_norm_kernel` handles a [BLOCK_M rows, BLOCK_D] tile per program (several rows per program when D
is small or the row count is large); when D exceeds `max_block_d` it loops over the row in chunks (two passes:
sum of squares, then scale). `_gated_act_kernel` has a 2-D grid (row blocks, output-column blocks).
Knobs (keyword arguments of the wrappers, for GPU sweeps): `block_m`, `block_d` / `block_n`, `num_warps`,
`max_block_d`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import TL_DTYPE, interpreting, next_pow2

_TILE = 4096
"""Default elements per program tile (rows x columns) when several rows share a program."""


@triton.jit
def _tanh(y):
    """tanh in fp32, ~1e-7 relative everywhere: odd Taylor polynomial for |y| < 0.3 (avoids the cancellation
    of 1 - exp(-2|y|) near 0), else sign(y) * (1 - e) / (1 + e) with e = exp(-2|y|) in (0, 0.55] (no overflow)."""
    a = tl.abs(y)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    big = tl.where(y < 0, -big, big)
    y2 = y * y
    # tanh y = y (1 - y^2/3 + 2y^4/15 - 17y^6/315 + 62y^8/2835 - 1382y^10/155925); |y| < 0.3: error < 1e-9 rel
    p = -1382.0 / 155925.0
    p = p * y2 + 62.0 / 2835.0
    p = p * y2 - 17.0 / 315.0
    p = p * y2 + 2.0 / 15.0
    p = p * y2 - 1.0 / 3.0
    small = y + y * (y2 * p)
    return tl.where(a < 0.3, small, big)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, n_rows, x_stride, eps, res_ptr, res_stride, sum_ptr, D: tl.constexpr,
                     HAS_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, NUM_CHUNKS: tl.constexpr,
                     HAS_RES: tl.constexpr, gate_ptr=None, gate_stride=0, HAS_GATE: tl.constexpr = False):
    """y = rms_norm(x) per row; HAS_RES: first s = x + res rounded to s's dtype (stored, contiguous rows), and the
    norm of s (the two ops apart, fused: one read of x and res, no second read of s when the row fits);
    HAS_GATE: y times sigmoid(gate) (rows of gate at gate_stride) before its one rounding to y's dtype."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mr = rows < n_rows
    r64 = rows.to(tl.int64)
    x_row = x_ptr + r64[:, None] * x_stride
    y_row = y_ptr + r64[:, None] * D
    cols = tl.arange(0, BLOCK_D)
    if HAS_RES:
        res_row = res_ptr + r64[:, None] * res_stride
        sum_row = sum_ptr + r64[:, None] * D
    if NUM_CHUNKS == 1:  # the whole row in registers: one read of x
        mc = cols < D
        m = mr[:, None] & mc[None, :]
        xf = tl.load(x_row + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_RES:
            sv = (xf + tl.load(res_row + cols[None, :], mask=m, other=0.0).to(tl.float32)).to(sum_ptr.dtype.element_ty)
            tl.store(sum_row + cols[None, :], sv, mask=m)
            xf = sv.to(tl.float32)
        ms = tl.sum(xf * xf, axis=1) / D
        y = xf * (1.0 / tl.sqrt_rn(ms + eps))[:, None]
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=mc, other=0.0).to(tl.float32)[None, :]
        if HAS_GATE:
            y = y * tl.sigmoid(tl.load(gate_ptr + r64[:, None] * gate_stride + cols[None, :], mask=m,
                                       other=0.0).to(tl.float32))
        tl.store(y_row + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=m)
    else:  # long rows: sum of squares over chunks, then a second pass that scales
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for c in tl.static_range(NUM_CHUNKS):
            cc = c * BLOCK_D + cols
            m = mr[:, None] & (cc < D)[None, :]
            xf = tl.load(x_row + cc[None, :], mask=m, other=0.0).to(tl.float32)
            if HAS_RES:
                sv = (xf + tl.load(res_row + cc[None, :], mask=m, other=0.0).to(tl.float32)).to(
                    sum_ptr.dtype.element_ty)
                tl.store(sum_row + cc[None, :], sv, mask=m)
                xf = sv.to(tl.float32)
            acc += xf * xf
        ms = tl.sum(acc, axis=1) / D
        r = (1.0 / tl.sqrt_rn(ms + eps))[:, None]
        if HAS_RES:
            tl.debug_barrier()  # the block's stores of s visible to all its threads before they read s back
        for c in tl.static_range(NUM_CHUNKS):
            cc = c * BLOCK_D + cols
            mc = cc < D
            m = mr[:, None] & mc[None, :]
            if HAS_RES:  # the rounded sum this program stored in the first pass
                y = tl.load(sum_row + cc[None, :], mask=m, other=0.0).to(tl.float32) * r
            else:
                y = tl.load(x_row + cc[None, :], mask=m, other=0.0).to(tl.float32) * r
            if HAS_W:
                y = y * tl.load(w_ptr + cc, mask=mc, other=0.0).to(tl.float32)[None, :]
            if HAS_GATE:
                y = y * tl.sigmoid(tl.load(gate_ptr + r64[:, None] * gate_stride + cc[None, :], mask=m,
                                           other=0.0).to(tl.float32))
            tl.store(y_row + cc[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _gated_act_kernel(x_ptr, y_ptr, n_rows, x_stride, beta, lin_beta, N: tl.constexpr, SITU: tl.constexpr,
                      HAS_LIN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = (rows < n_rows)[:, None] & (cols < N)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    src = x_ptr + r64 * x_stride + cols[None, :]
    g = tl.load(src, mask=m, other=0.0).to(tl.float32)
    u = tl.load(src + N, mask=m, other=0.0).to(tl.float32)
    if SITU:
        g = beta * _tanh(g / beta) * tl.sigmoid(g)
        if HAS_LIN:
            u = lin_beta * _tanh(u / lin_beta)
    else:
        g = g * tl.sigmoid(g)
    tl.store(y_ptr + r64 * N + cols[None, :], (g * u).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _kda_gate_kernel(x_ptr, alog_ptr, bias_ptr, y_ptr, n_rows, x_stride, lower_bound, C: tl.constexpr,
                     HD: tl.constexpr, HAS_LB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """g[t, c] for c = h * HD + d: z = raw_g + dt_bias, a = e^{A_log[h]}; lower_bound * sigmoid(a z) or
    -a softplus(z) (z past 20: z itself; log1p(e) for e = e^z < 0.1 by its series to e^8, where log(1 + e) would lose
    the rounding of 1 + e, and the GPU's fast log its absolute error near 1, relative to a small result)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mc = cols < C
    m = (rows < n_rows)[:, None] & mc[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * x_stride + cols[None, :], mask=m, other=0.0).to(tl.float32)
    z = x + tl.load(bias_ptr + cols, mask=mc, other=0.0).to(tl.float32)[None, :]
    a = tl.exp(tl.load(alog_ptr + cols // HD, mask=mc, other=0.0).to(tl.float32))[None, :]
    if HAS_LB:
        g = lower_bound * tl.sigmoid(a * z)
    else:
        e = tl.exp(tl.minimum(z, 20.0))
        s = tl.minimum(e, 0.1)  # (the series is only kept below 0.1: no overflow where it is not)
        ser = s * (1.0 + s * (-0.5 + s * (1.0 / 3.0 + s * (-0.25 + s * (0.2 + s * (-1.0 / 6.0 + s * (1.0 / 7.0
                                                                                          - 0.125 * s)))))))
        sp = tl.where(z > 20.0, z, tl.where(e < 0.1, ser, tl.log(1.0 + e)))
        g = -a * sp
    tl.store(y_ptr + r64 * C + cols[None, :], g, mask=m)


def supported(x: torch.Tensor) -> bool:
    """True for fp16/bf16/fp32 tensors on CUDA (or on the CPU under the Triton interpreter)."""
    return x.dtype in TL_DTYPE and (x.is_cuda or (interpreting() and x.device.type == "cpu"))


def _as_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(tensor, row count, row stride) viewing x as [rows, x.shape[-1]] with unit column stride, in place when
    the leading dims collapse into one strided dim, else via `.contiguous()`."""
    D = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    lead = [(s, st) for s, st in zip(x.shape[:-1], x.stride()[:-1]) if s != 1]
    ok = D <= 1 or x.stride(-1) == 1
    ok = ok and all(lead[i][1] == lead[i + 1][1] * lead[i + 1][0] for i in range(len(lead) - 1))
    if not ok:
        x = x.contiguous()
        lead = [(s, D) for s, _ in lead]
    return x, rows, (lead[-1][1] if lead else D)


def _warps(tile: int) -> int:
    return max(1, min(16, tile // 256))


def _tile_2d(rows: int, n: int, block_m: int | None, block_n: int | None, num_warps: int | None
             ) -> tuple[int, int, int]:
    """(rows, columns, warps) per program of the 2-D elementwise kernels where no knob is given: up to 1024 columns,
    rows to fill a _TILE-element tile (at most the row count), warps from the tile."""
    bn = block_n or min(next_pow2(n), 1024)
    bm = block_m or min(next_pow2(rows), max(1, _TILE // bn))
    return bm, bn, num_warps or _warps(bm * bn)


def _norm_rows(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
               block_m: int | None, block_d: int | None, max_block_d: int, num_warps: int | None,
               gate: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One `_rms_norm_kernel` launch: (y, s) with s = x + residual (None without a residual) and y its norm (times
    sigmoid(gate) with a gate; y in out_dtype, default x's)."""
    D = x.shape[-1]
    y = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    s = None if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    xr, rows, stride = _as_rows(x)
    rr, _, rstride = (xr, rows, stride) if residual is None else _as_rows(residual)
    gr, _, gstride = (xr, rows, 0) if gate is None else _as_rows(gate)
    if rows == 0 or D == 0:
        return y, s
    if weight is not None:
        if weight.shape[-1] != D or weight.numel() != D:
            raise ValueError(f"weight shape {tuple(weight.shape)} does not match last dim {D}")
        if weight.dtype not in TL_DTYPE:  # the reference casts the weight to fp32 too
            weight = weight.to(torch.float32)
        weight = weight.reshape(D).contiguous()
    bd = block_d or min(next_pow2(D), max_block_d)
    chunks = triton.cdiv(D, bd)
    bm = block_m or min(next_pow2(rows), max(1, _TILE // bd))
    nw = num_warps or _warps(bm * bd)
    _rms_norm_kernel[(triton.cdiv(rows, bm),)](
        xr, weight if weight is not None else xr, y, rows, stride, float(eps), rr, rstride, y if s is None else s,
        D=D, HAS_W=weight is not None, BLOCK_M=bm, BLOCK_D=bd, NUM_CHUNKS=chunks, HAS_RES=s is not None,
        gate_ptr=gr, gate_stride=gstride, HAS_GATE=gate is not None, num_warps=nw)
    return y, s


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, block_m: int | None = None,
                    block_d: int | None = None, max_block_d: int = 8192,
                    num_warps: int | None = None) -> torch.Tensor:
    """Triton `reference.rms_norm` (fp16/bf16/fp32 x). Knobs: `block_m` rows per program (default: fill a
    4096-element tile, at most the row count), `block_d` columns per chunk (default: next_pow2(D) when that is
    <= `max_block_d`, else `max_block_d` with a chunked two-pass loop), `num_warps` (default from the tile)."""
    return _norm_rows(x, None, weight, eps, block_m, block_d, max_block_d, num_warps)[0]


def rms_norm_gated_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None, eps: float,
                          out_dtype: torch.dtype | None = None, *, block_m: int | None = None,
                          block_d: int | None = None, max_block_d: int = 8192,
                          num_warps: int | None = None) -> torch.Tensor:
    """Triton `reference.rms_norm_gated`: rms_norm(x) * sigmoid(gate) in fp32, rounded once to out_dtype (default
    x's), ONE launch (KDA's gated output norm over [tokens x heads, V] rows). Knobs as `rms_norm_triton`."""
    if gate.shape != x.shape:
        raise ValueError(f"rms_norm_gated: gate {tuple(gate.shape)} must have x's shape {tuple(x.shape)}")
    return _norm_rows(x, None, weight, eps, block_m, block_d, max_block_d, num_warps, gate=gate,
                      out_dtype=out_dtype)[0]


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
                        block_m: int | None = None, block_d: int | None = None, max_block_d: int = 8192,
                        num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `reference.add_rms_norm`: (rms_norm(s), s) with s = x + residual, in ONE launch. s is rounded to the
    inputs' dtype before the norm reads it, so both outputs equal the add and `rms_norm_triton` apart, bit for bit
    (same tiles, same sums). Same knobs as `rms_norm_triton`."""
    if x.shape != residual.shape or x.dtype != residual.dtype or x.device != residual.device:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} "
                         f"{residual.dtype} must match")
    return _norm_rows(x, residual, weight, eps, block_m, block_d, max_block_d, num_warps)


def _gated(x: torch.Tensor, situ: bool, beta: float, linear_beta: float | None, block_m: int | None,
           block_n: int | None, num_warps: int | None) -> torch.Tensor:
    if x.shape[-1] % 2:
        raise ValueError(f"gated activation needs an even last dimension, got {tuple(x.shape)}")
    n = x.shape[-1] // 2
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    xr, rows, stride = _as_rows(x)
    if rows == 0 or n == 0:
        return y
    bm, bn, nw = _tile_2d(rows, n, block_m, block_n, num_warps)
    has_lin = linear_beta is not None
    _gated_act_kernel[(triton.cdiv(rows, bm), triton.cdiv(n, bn))](
        xr, y, rows, stride, float(beta), float(linear_beta) if has_lin else 1.0, N=n, SITU=situ, HAS_LIN=has_lin,
        BLOCK_M=bm, BLOCK_N=bn, num_warps=nw)
    return y


def silu_and_mul_triton(x: torch.Tensor, *, block_m: int | None = None, block_n: int | None = None,
                        num_warps: int | None = None) -> torch.Tensor:
    """Triton `reference.silu_and_mul`: x[..., 2n] = gate | up -> silu(gate) * up, [..., n] in x's dtype.
    Knobs: `block_m` rows and `block_n` output columns per program (default: block_n = min(next_pow2(n), 1024),
    rows to fill a 4096-element tile), `num_warps`."""
    return _gated(x, False, 0.0, None, block_m, block_n, num_warps)


def situ_and_mul_triton(x: torch.Tensor, beta: float = 4.0, linear_beta: float | None = None, *,
                        block_m: int | None = None, block_n: int | None = None,
                        num_warps: int | None = None) -> torch.Tensor:
    """Triton `reference.situ_and_mul` (same arguments; knobs as `silu_and_mul_triton`)."""
    return _gated(x, True, beta, linear_beta, block_m, block_n, num_warps)


def kda_gate_triton(raw_g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None = None,
                    *, block_m: int | None = None, block_n: int | None = None,
                    num_warps: int | None = None) -> torch.Tensor:
    """Triton `reference.kda_gate`: raw_g [T, H, D] (any row stride), A_log [H], dt_bias [H*D] -> g [T, H, D] fp32,
    one launch (the PyTorch form is five elementwise kernels over [T, H*D] in a prefill step). Knobs as
    `silu_and_mul_triton`."""
    T, H, D = raw_g.shape
    if A_log.numel() != H or dt_bias.numel() != H * D:
        raise ValueError(f"kda_gate: A_log {tuple(A_log.shape)} / dt_bias {tuple(dt_bias.shape)} vs raw_g {(T, H, D)}")
    y = torch.empty(T, H, D, dtype=torch.float32, device=raw_g.device)
    xr, rows, stride = _as_rows(raw_g.reshape(T, H * D))
    if rows == 0:
        return y
    C = H * D
    bm, bn, nw = _tile_2d(rows, C, block_m, block_n, num_warps)
    has_lb = lower_bound is not None
    _kda_gate_kernel[(triton.cdiv(rows, bm), triton.cdiv(C, bn))](
        xr, A_log.contiguous(), dt_bias.contiguous(), y, rows, stride, float(lower_bound) if has_lb else 0.0, C=C, HD=D,
        HAS_LB=has_lb, BLOCK_M=bm, BLOCK_N=bn, num_warps=nw)
    return y
