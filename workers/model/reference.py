"""The reference forward pass and greedy generator: the oracle for every engine feature.

Written for clarity, not speed: one sequence, the full sequence recomputed at every step, no caches.

    logits = ReferenceModel(cfg, weights, dtype).logits(token_ids)       # [T, V]
    new_ids = reference_generate(model_dir, prompt_ids, max_new_tokens)   # greedy, new ids only

Stack (design doc §1): embedding -> L decoder layers (KDA or MLA attention, dense MLP or (Latent)MoE)
joined by Block Attention Residuals (or a plain pre-norm residual when attn_res_block_size is null, as in
Kimi-Linear) -> final RMSNorm -> lm_head. The MTP drafter layers: workers/model/mtp.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from k3serve.kernels.reference.mxfp4 import mxfp4_dequantize

from .attn_res import AttnResState
from .config import K3Config
from .functional import LayerWeights, acc_dtype, rms_norm
from .kda import kda_forward
from .mla import mla_forward
from .moe import dense_mlp, moe_forward


def dequantize_experts(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A copy of `weights` whose MXFP4 expert tensors are replaced by dense `experts.w13` / `experts.w2`.

    MXFP4 dequantization is exact in float32/float64, so this changes no value; it only avoids
    decoding the same experts again on every forward pass.
    """
    out = dict(weights)
    for name in [n for n in weights if n.endswith("experts.w13_packed")]:
        base = name[: -len("w13_packed")]
        for m in ("w13", "w2"):
            out[base + m] = mxfp4_dequantize(out.pop(base + m + "_packed"), out.pop(base + m + "_scale"), dtype)
    return out


class ReferenceModel:
    """A K3 / Kimi-Linear text model over a canonical weight dict (see `loader.load_model_weights`)."""

    def __init__(self, cfg: K3Config, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float64):
        self.cfg = cfg
        self.w = dequantize_experts(weights, dtype)
        self.dtype = dtype

    def _attention(self, i: int, x: torch.Tensor) -> torch.Tensor:
        lw = LayerWeights(self.w, f"model.layers.{i}.self_attn.")
        if self.cfg.is_kda_layer(i):
            return kda_forward(x, lw, self.cfg)[0]
        return mla_forward(x, lw, self.cfg, torch.arange(x.shape[0], device=x.device))

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.is_moe_layer(i):
            return moe_forward(x, LayerWeights(self.w, f"model.layers.{i}.block_sparse_moe."), self.cfg)
        return dense_mlp(x, LayerWeights(self.w, f"model.layers.{i}.mlp."), self.cfg)

    def hidden_states(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Token ids `[T]` -> the hidden state before the final norm `[T, H]` (model dtype)."""
        cfg, w = self.cfg, self.w
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=w["model.embed_tokens.weight"].device)
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"token_ids must be a non-empty 1-D sequence, got shape {tuple(ids.shape)}")
        if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
            raise ValueError(f"token ids must lie in [0, {cfg.vocab_size})")
        eps = cfg.rms_norm_eps
        emb = w["model.embed_tokens.weight"][ids].to(self.dtype)
        if cfg.attn_res_block_size is None:
            h = emb
            for i in range(cfg.num_hidden_layers):
                lw = LayerWeights(w, f"model.layers.{i}.")
                h = h + self._attention(i, rms_norm(h, lw["input_layernorm.weight"], eps))
                h = h + self._mlp(i, rms_norm(h, lw["post_attention_layernorm.weight"], eps))
            return h
        state = AttnResState(emb, cfg.attn_res_block_size, cfg.num_attn_res_blocks)
        mlp_out = None
        for i in range(cfg.num_hidden_layers):
            lw = LayerWeights(w, f"model.layers.{i}.")
            x = state.pre_attn(i, mlp_out, lw["self_attention_res_norm.weight"], lw["self_attention_res_proj.weight"],
                               lw["input_layernorm.weight"], eps)
            a = self._attention(i, x)
            y = state.post_attn(i, a, lw["mlp_res_norm.weight"], lw["mlp_res_proj.weight"],
                                lw["post_attention_layernorm.weight"], eps)
            mlp_out = self._mlp(i, y)
        return state.final(mlp_out, w["model.output_attn_res_norm.weight"], w["model.output_attn_res_proj.weight"], eps)

    def logits(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Token ids `[T]` -> logits `[T, V]` in the accumulation dtype (float32, float64 for float64 models)."""
        h = rms_norm(self.hidden_states(token_ids), self.w["model.norm.weight"], self.cfg.rms_norm_eps)
        return (h @ self.w["lm_head.weight"].to(self.dtype).T).to(acc_dtype(self.dtype))


def load_reference_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float64, device: str | torch.device = "cpu"
) -> ReferenceModel:
    from .loader import load_model_weights

    cfg, weights = load_model_weights(model_dir, dtype=dtype, device=device)
    return ReferenceModel(cfg, weights, dtype)


def greedy_generate(
    model: ReferenceModel, prompt_ids: Sequence[int], max_new_tokens: int, stop_token_ids: Iterable[int] | None = None
) -> list[int]:
    """Greedy decoding by full recomputation: each step runs the whole sequence and takes argmax of the
    last position (lowest id on ties). Stops after max_new_tokens, or right after a token in stop_token_ids."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    stops = set(stop_token_ids or ())
    seq = [int(t) for t in prompt_ids]
    new: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = int(torch.argmax(model.logits(seq)[-1]))
            new.append(nxt)
            seq.append(nxt)
            if nxt in stops:
                break
    return new


def reference_generate(
    model_dir: str | Path,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    dtype: torch.dtype = torch.float64,
    device: str | torch.device = "cpu",
    stop_token_ids: Iterable[int] | None = None,
) -> list[int]:
    """Load `model_dir` and greedily generate; returns the new token ids only (EOS does not stop it unless
    it is passed in stop_token_ids)."""
    model = load_reference_model(model_dir, dtype=dtype, device=device)
    return greedy_generate(model, prompt_ids, max_new_tokens, stop_token_ids)
