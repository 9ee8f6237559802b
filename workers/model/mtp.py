"""The MTP drafter layer (design doc §1.7), reference form: no caches, whole sequences recomputed.

MTP layer j (checkpoint index `num_hidden_layers + j`, weights in `spec.mtp_layer_spec`) at position t
takes the target's pre-final-norm hidden state `h_t` and the token that follows it, `x_{t+1}`:

    e = embed(x_{t+1}), zeroed where position == 0
    u = eh_proj([RMSNorm(e; enorm) ; RMSNorm(h_t; hnorm)])            (2H -> H, e first)
    v = u + Attn(RMSNorm(u; input_layernorm))                          (MLA over the layer's own
    h' = v + MLP(RMSNorm(v; post_attention_layernorm))                  sequence of inputs; no AttnRes)
    logits = RMSNorm(h'; shared_head.norm) @ head.T                    (predicts x_{t+2})

`embed` / `head` are the layer's own `embed_tokens` / `shared_head.head` when the checkpoint has them,
else the target's embedding / lm_head. `h'` (pre-norm) is the hidden state the next draft step uses.

    logits, h_next = mtp_layer_forward(model, j, h_prev, next_ids)          # one layer, a whole sequence
    target_next, drafts = mtp_propose(model, token_ids, k)                 # greedy: k drafted tokens

Drafting (`mtp_propose`): the target runs over `token_ids` (x_0..x_{T-1}) and picks x_T greedily; step
s = 0..k-1 runs MTP layer `s % num_nextn_predict_layers` over the pairs (h_0, x_1) .. (h_{T-1}, x_T)
followed by the pairs drafted so far, (h'_{prev step}, d_s), and takes the argmax at the last position.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .functional import LayerWeights, acc_dtype, linear, rms_norm
from .mla import mla_forward
from .moe import dense_mlp, moe_forward
from .reference import ReferenceModel


def mtp_embed_weight(w, cfg, j: int) -> torch.Tensor:
    own = f"model.layers.{cfg.num_hidden_layers + j}.embed_tokens.weight"
    return w[own] if own in w else w["model.embed_tokens.weight"]


def mtp_head_weight(w, cfg, j: int) -> torch.Tensor:
    own = f"model.layers.{cfg.num_hidden_layers + j}.shared_head.head.weight"
    return w[own] if own in w else w["lm_head.weight"]


def mtp_layer_forward(
    model: ReferenceModel, j: int, h_prev: torch.Tensor, next_ids: Sequence[int] | torch.Tensor,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MTP layer j over one sequence of (h_t, x_{t+1}) pairs.

    h_prev `[T, H]` (the target's pre-norm hidden states, or earlier MTP outputs), next_ids `[T]`,
    positions `[T]` (default 0..T-1). Returns (logits `[T, V]` in the acc dtype, h_next `[T, H]`).
    """
    cfg, w, dtype = model.cfg, model.w, model.dtype
    if not 0 <= j < cfg.num_nextn_predict_layers:
        raise ValueError(f"MTP layer {j} does not exist (num_nextn_predict_layers={cfg.num_nextn_predict_layers})")
    i = cfg.num_hidden_layers + j
    lw = LayerWeights(w, f"model.layers.{i}.")
    ids = torch.as_tensor(next_ids, dtype=torch.long, device=h_prev.device)
    if positions is None:
        positions = torch.arange(ids.shape[0], device=h_prev.device)
    eps = cfg.rms_norm_eps
    e = mtp_embed_weight(w, cfg, j)[ids].to(dtype)
    e = e.masked_fill((positions == 0)[:, None], 0)
    h = h_prev.to(dtype)
    u = linear(torch.cat([rms_norm(e, lw["enorm.weight"], eps), rms_norm(h, lw["hnorm.weight"], eps)], -1),
               lw["eh_proj.weight"])
    v = u + mla_forward(rms_norm(u, lw["input_layernorm.weight"], eps), lw.sub("self_attn."), cfg, positions)
    x = rms_norm(v, lw["post_attention_layernorm.weight"], eps)
    if cfg.is_moe_layer(i):
        v = v + moe_forward(x, lw.sub("block_sparse_moe."), cfg)
    else:
        v = v + dense_mlp(x, lw.sub("mlp."), cfg)
    logits = rms_norm(v, lw["shared_head.norm.weight"], eps) @ mtp_head_weight(w, cfg, j).to(dtype).T
    return logits.to(acc_dtype(dtype)), v


def mtp_propose(model: ReferenceModel, token_ids: Sequence[int], k: int) -> tuple[int, list[int]]:
    """Greedy MTP drafting after `token_ids`: (the target's next token x_T, k drafted tokens after it)."""
    cfg = model.cfg
    if cfg.num_nextn_predict_layers < 1:
        raise ValueError("the model has no MTP layer (num_nextn_predict_layers = 0)")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    ids = [int(t) for t in token_ids]
    with torch.no_grad():
        hidden = model.hidden_states(ids)
        normed = rms_norm(hidden, model.w["model.norm.weight"], cfg.rms_norm_eps)
        target_next = int(torch.argmax(normed[-1] @ model.w["lm_head.weight"].to(model.dtype).T))
        hs = list(hidden.unbind(0))
        toks = ids[1:] + [target_next]
        drafts: list[int] = []
        for s in range(k):
            logits, h_next = mtp_layer_forward(model, s % cfg.num_nextn_predict_layers, torch.stack(hs), toks)
            d = int(torch.argmax(logits[-1]))
            drafts.append(d)
            hs.append(h_next[-1])
            toks.append(d)
    return target_next, drafts
