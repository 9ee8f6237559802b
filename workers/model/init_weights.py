"""Random weights for generated checkpoints: finite activations, non-degenerate logits, deterministic per seed.

Every tensor draws from its own generator seeded by (seed, name), so the result does not depend on the
order of generation, and everything is produced on the target device (fast on a GPU: no per-expert
loops; MXFP4 experts are quantized layer by layer in one call).

Scales (fan_in = the input width): linear layers N(0, 1/fan_in), with the sublayer output projections
(o_proj, down_proj, routed_expert_up_proj, or the experts' w2 without a latent) scaled by 1/sqrt(2L);
embeddings N(0, 1); lm_head N(0, 4/H) (logit std ~2); norm weights 1 + 0.05 N(0,1); AttnRes
pseudo-queries N(0, 1/H) (source logits ~N(0,1)); router N(0, 1/H) with a correction bias 0.05 N(0,1);
KDA A_log = log U(1, 16), dt_bias = softplus^-1(dt) with log dt ~ U(log 1e-3, log 1e-1) (FLA's init),
conv taps U(-1/sqrt(K), 1/sqrt(K)); routed experts share a common component (see EXPERT_SPREAD).
"""

from __future__ import annotations

import math
import zlib

import torch

from k3serve.kernels.reference.mxfp4 import mxfp4_quantize

from .config import K3Config
from .loader import target_dtype
from .spec import WeightSpec, expected_weights

EXPERT_SPREAD = 0.3
"""Share of per-expert noise in expert weights (the rest is common to all experts): with fully independent
experts, a near-tie in routing that bf16 rounding flips changes the layer output completely and bf16 runs
diverge from float64 within a few tokens; at 0.3 routing still matters but such flips stay small."""


_OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight", "routed_expert_up_proj.weight")


def output_scale(cfg: K3Config) -> float:
    """Extra factor on the sublayer output projections: 1/sqrt(2L) (GPT-2's residual scaling). Random deep
    stacks are chaotic otherwise: bf16 rounding alone would change most argmaxes of a 24-layer model."""
    return 1.0 / math.sqrt(2 * cfg.num_hidden_layers)


def _gen(seed: int, name: str, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return g


def _randn(shape, g, device, std: float) -> torch.Tensor:
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32) * std


def _rand(shape, g, device, lo: float, hi: float) -> torch.Tensor:
    return torch.rand(shape, generator=g, device=device, dtype=torch.float32) * (hi - lo) + lo


def _experts(shape, g, device) -> torch.Tensor:
    """Stacked expert weights `[E, out, in]`: a shared component plus an EXPERT_SPREAD share of per-expert noise."""
    std = 1.0 / math.sqrt(shape[-1])
    common = _randn((1, *shape[1:]), g, device, std)
    own = _randn(shape, g, device, std)
    return math.sqrt(1.0 - EXPERT_SPREAD**2) * common + EXPERT_SPREAD * own


def _init_tensor(name: str, spec: WeightSpec, cfg: K3Config, g, device) -> torch.Tensor:  # noqa: C901
    shape = spec.shape
    H = cfg.hidden_size
    leaf = name.rsplit(".", 2)
    if name.endswith("A_log"):
        return torch.log(_rand(shape, g, device, 1.0, 16.0))
    if name.endswith("dt_bias"):
        dt = torch.exp(_rand(shape, g, device, math.log(1e-3), math.log(1e-1))).clamp_min(1e-4)
        return dt + torch.log(-torch.expm1(-dt))
    if name.endswith("conv1d.weight"):
        b = 1.0 / math.sqrt(shape[-1])
        return _rand(shape, g, device, -b, b)
    if name.endswith("e_score_correction_bias"):
        return _randn(shape, g, device, 0.05)
    if name.endswith("_res_proj.weight"):
        return _randn(shape, g, device, 1.0 / math.sqrt(H))
    if name.endswith(("norm.weight", "layernorm.weight")):
        return 1.0 + _randn(shape, g, device, 0.05)
    if name.endswith("embed_tokens.weight"):
        return _randn(shape, g, device, 1.0)
    if name.endswith(("lm_head.weight", "shared_head.head.weight")):
        return _randn(shape, g, device, 2.0 / math.sqrt(H))
    if len(shape) == 3:  # stacked experts [E, out, in]
        w = _experts(shape, g, device)
        return w * output_scale(cfg) if name.endswith("w2") and cfg.routed_expert_hidden_size is None else w
    if len(shape) == 2:
        out_scale = output_scale(cfg) if name.endswith(_OUTPUT_PROJECTIONS) else 1.0
        return _randn(shape, g, device, out_scale / math.sqrt(shape[-1]))
    raise ValueError(f"no init rule for {name} {shape} ({leaf})")


def init_weights(
    cfg: K3Config, seed: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """Canonical weights (names of `spec.expected_weights`) for `cfg`, on `device`, float ones in `dtype`.

    MXFP4 experts (cfg.experts_mxfp4) are drawn in float32 and quantized. The optional MTP extras
    (`shared_head.head`, per-layer `embed_tokens`) are not generated; a tied lm_head is the embedding.
    """
    device = torch.device(device)
    specs = expected_weights(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, spec in specs.items():
        if spec.default in ("absent", "tied") or (spec.kind == "uint8" and not name.endswith("_packed")):
            continue
        if spec.kind == "uint8":  # w13_packed / w2_packed: draw the float weight, quantize, set both tensors
            base = name[: -len("_packed")]
            E, rows, half = spec.shape
            w = _experts((E, rows, half * 2), _gen(seed, base, device), device)
            if base.endswith("w2") and cfg.routed_expert_hidden_size is None:
                w = w * output_scale(cfg)
            out[name], out[base + "_scale"] = mxfp4_quantize(w)
            del w
            continue
        t = _init_tensor(name, spec, cfg, _gen(seed, name, device), device)
        out[name] = t.to(target_dtype(spec, dtype))
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return {k: out[k] for k in specs if k in out}
