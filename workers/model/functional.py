"""Shared math for the reference model: precision policy, RMSNorm, activations, RoPE, weight views.

Precision policy (design doc §1): activations and matmuls run in the model dtype; norms, softmaxes,
gates, the KDA recurrence and the MoE accumulation run in the *accumulation dtype*, float32 — or
float64 when the model dtype is float64, so that float64 runs carry no float32 rounding at all.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 models, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, Kimi/vLLM convention: normalize in the accumulation dtype, cast back
    to x's dtype, then multiply by `weight` (in x's dtype). `weight=None` means no scale."""
    acc = acc_dtype(x.dtype)
    xf = x.to(acc)
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else y * weight.to(x.dtype)


def gated_rms_norm(o: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA output norm: `RMSNorm(o; weight) * sigmoid(gate)`, all in the accumulation dtype (weight included),
    cast to o's dtype at the end. Normalizes over the last dim (the head dim)."""
    acc = acc_dtype(o.dtype)
    of = o.to(acc)
    y = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps) * weight.to(acc)
    return (y * torch.sigmoid(gate.to(acc))).to(o.dtype)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, computed in the accumulation dtype, returned in gate's dtype."""
    acc = acc_dtype(gate.dtype)
    return (F.silu(gate.to(acc)) * up.to(acc)).to(gate.dtype)


def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """SiTU (design doc §1.5): gate' = beta*tanh(gate/beta)*sigmoid(gate);
    up' = linear_beta*tanh(up/linear_beta) if linear_beta else up; returns gate'*up' (acc dtype, cast back)."""
    acc = acc_dtype(gate.dtype)
    g = gate.to(acc)
    u = up.to(acc)
    g2 = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    u2 = linear_beta * torch.tanh(u / linear_beta) if linear_beta is not None else u
    return (g2 * u2).to(gate.dtype)


def act_and_mul(gate: torch.Tensor, up: torch.Tensor, cfg) -> torch.Tensor:
    """The MLP activation `cfg.hidden_act` ('silu' | 'situ') applied as act(gate) * up."""
    if cfg.hidden_act == "situ":
        return situ_and_mul(gate, up, cfg.situ_beta, cfg.situ_linear_beta)
    return silu_and_mul(gate, up)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T with weight `[out, in]` (cast to x's dtype)."""
    return F.linear(x, weight.to(x.dtype))


def rope_interleaved(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """DeepSeek-style RoPE on the last dim (pairs (0,1), (2,3), ...): `x[..., T, (heads,) D]`.

    `positions` is `[T]`; x is `[T, D]` or `[T, heads, D]`. Angles in the accumulation dtype.
    """
    acc = acc_dtype(x.dtype)
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=acc, device=x.device) / d))
    ang = positions.to(acc)[:, None] * inv_freq[None, :]  # [T, D/2]
    if x.dim() == 3:
        ang = ang[:, None, :]
    cos, sin = torch.cos(ang), torch.sin(ang)
    xf = x.to(acc)
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


class LayerWeights(Mapping):
    """A read-only view of `weights` under `prefix`: `LayerWeights(w, "model.layers.3.")["input_layernorm.weight"]`."""

    def __init__(self, weights: Mapping[str, torch.Tensor], prefix: str):
        self._w = weights
        self.prefix = prefix

    def __getitem__(self, key: str) -> torch.Tensor:
        try:
            return self._w[self.prefix + key]
        except KeyError:
            raise KeyError(f"missing weight {self.prefix + key!r}") from None

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and (self.prefix + key) in self._w

    def __iter__(self) -> Iterator[str]:
        n = len(self.prefix)
        return (k[n:] for k in self._w if k.startswith(self.prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def sub(self, prefix: str) -> LayerWeights:
        return LayerWeights(self._w, self.prefix + prefix)
