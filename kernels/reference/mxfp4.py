"""MXFP4 (OCP microscaling FP4) weights: quantize, dequantize and matmul-with-dequant, in plain PyTorch.

Format (design doc §1.6):
* Elements are FP4 E2M1, two per byte: element 2i sits in the LOW nibble, element 2i+1 in the HIGH nibble.
  A nibble is a sign bit (bit 3) plus a 3-bit magnitude code; codes 0..7 mean `E2M1_VALUES`.
* Every 32 consecutive elements along the input (last, K) dimension share one E8M0 scale byte `s`,
  meaning 2**(s - 127).
* Dequantized value = (-1)**sign * E2M1_VALUES[code] * 2**(s - 127).

Shapes: a weight `w[..., N, K]` (K % 32 == 0) is stored as `packed uint8 [..., N, K // 2]` and
`scales uint8 [..., N, K // 32]`.

Quantization rule (vLLM's): per group, exponent = floor(log2(amax)) - 2 (so the group maximum maps
into [4, 8) and saturates at 6), then every element rounds to the nearest representable E2M1 value
(ties to the even code). An all-zero group gets scale byte 0.

Only torch is imported here: this module must import on a GPU box with nothing else installed.
"""

from __future__ import annotations

import torch

MXFP4_BLOCK = 32
"""Elements per shared E8M0 scale."""

E8M0_BIAS = 127

E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The 8 magnitudes of FP4 E2M1, indexed by the 3-bit magnitude code."""

# Midpoints between consecutive magnitudes; a tie rounds to the even code.
_MIDPOINTS: tuple[float, ...] = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round already-scaled values to FP4 E2M1 nibbles (uint8 in 0..15; |x| > 6 saturates to 6).

    Round to nearest, ties to the even magnitude code. A value that rounds to zero gets a clear sign bit.
    """
    x = x.to(_work_dtype(x))
    mag = x.abs()
    bounds = torch.tensor(_MIDPOINTS, dtype=mag.dtype, device=mag.device)
    code = torch.bucketize(mag, bounds, right=False)  # bounds[code-1] < mag <= bounds[code]
    # mag == bounds[code] is a tie between codes code and code+1: bucketize picked `code`; take the even one.
    at_bound = mag == bounds[code.clamp(max=len(_MIDPOINTS) - 1)]
    code = code + (at_bound & (code % 2 == 1) & (code < len(_MIDPOINTS))).to(code.dtype)
    sign = (x < 0) & (code > 0)
    return (code | (sign.to(code.dtype) << 3)).to(torch.uint8)


def e2m1_decode(nibbles: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Map FP4 E2M1 nibbles (uint8 values 0..15) to their real values in `dtype`."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=dtype, device=nibbles.device)
    return table[nibbles.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """`codes uint8 [..., K]` (values 0..15, K even) -> `uint8 [..., K // 2]`, element 2i in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles: last dimension {codes.shape[-1]} must be even")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """`uint8 [..., K // 2]` -> nibble codes `uint8 [..., K]` (inverse of `pack_nibbles`)."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `w[..., N, K]` (any float dtype, K % 32 == 0) to MXFP4.

    Returns `(packed uint8 [..., N, K // 2], scales uint8 [..., N, K // 32])` on w's device.
    """
    if w.dim() < 1 or w.shape[-1] % MXFP4_BLOCK:
        raise ValueError(f"mxfp4_quantize: last dimension of shape {tuple(w.shape)} must be a multiple of 32")
    if not w.is_floating_point():
        raise TypeError(f"mxfp4_quantize: expected a float tensor, got {w.dtype}")
    x = w.to(_work_dtype(w))
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = groups.abs().amax(dim=-1)
    # frexp: amax = m * 2**e with m in [0.5, 1), so floor(log2(amax)) = e - 1 exactly.
    _, e = torch.frexp(amax)
    exponent = (e.to(torch.int32) - 1) - 2
    biased = torch.where(amax > 0, exponent + E8M0_BIAS, torch.zeros_like(exponent))
    biased = biased.clamp(0, 254)
    scaled = torch.ldexp(groups, -(biased - E8M0_BIAS).to(groups.dtype).unsqueeze(-1))
    codes = e2m1_encode(scaled).reshape(x.shape)
    return pack_nibbles(codes), biased.to(torch.uint8)


def mxfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`packed uint8 [..., N, K/2]`, `scales uint8 [..., N, K/32]` -> `Tensor[..., N, K]` in `dtype`.

    The arithmetic is exact in float32 (every MXFP4 value has at most 2 significant bits); the result is
    then cast to `dtype` (exact in bf16 as well unless the scale is far out of bf16's normal range).
    """
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"mxfp4_dequantize: expected uint8 tensors, got {packed.dtype} and {scales.dtype}")
    k = packed.shape[-1] * 2
    if scales.shape[-1] * MXFP4_BLOCK != k or scales.shape[:-1] != packed.shape[:-1]:
        raise ValueError(
            f"mxfp4_dequantize: packed {tuple(packed.shape)} and scales {tuple(scales.shape)} disagree "
            f"(need scales[..., K/32] for packed[..., K/2])"
        )
    work = torch.float64 if dtype == torch.float64 else torch.float32
    vals = e2m1_decode(unpack_nibbles(packed), work)
    vals = vals.reshape(*vals.shape[:-1], k // MXFP4_BLOCK, MXFP4_BLOCK)
    exp = scales.to(torch.int32) - E8M0_BIAS
    out = torch.ldexp(vals, exp.to(work).unsqueeze(-1))
    return out.reshape(*packed.shape[:-1], k).to(dtype)


def mxfp4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`x[..., K] @ W.T` with `W[N, K]` given as MXFP4 (`packed [N, K/2]`, `scales [N, K/32]`) -> `[..., N]`.

    The weight is dequantized to x's dtype first (reference semantics: dequantize, then matmul).
    """
    w = mxfp4_dequantize(packed, scales, dtype=x.dtype)
    return x @ w.transpose(-1, -2)


__all__ = [
    "E2M1_VALUES",
    "MXFP4_BLOCK",
    "e2m1_decode",
    "e2m1_encode",
    "mxfp4_dequantize",
    "mxfp4_linear",
    "mxfp4_quantize",
    "pack_nibbles",
    "unpack_nibbles",
]
