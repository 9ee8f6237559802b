"""A batched, differentiable forward pass of the K3 model for training, over canonical weight names.

    h = hidden_states(w, cfg, ids)                  # ids [B, T] -> pre-final-norm hidden [B, T, H]
    logits = lm_logits(w, cfg, h)                    # [B, T, V]
    mtp_logits, h_next = mtp_hidden(w, cfg, 0, h[:, :-1], ids[:, 1:])   # predicts ids[:, 2:]

It computes the same function as `workers/model/reference.py` and `workers/model/mtp.py` (tests compare
them in float64 on random configs), reusing their pieces where they are batch-agnostic (RMSNorm, AttnRes,
the decay gate, activations, the router) and replacing the three per-sequence loops:

* KDA: the short conv as one depthwise conv1d; the recurrence by FLA's `chunk_kda` (when `kda="fla"`,
  on CUDA) or by a batched chunk form in plain PyTorch (`kda_chunked`, the WY form of
  kernels/reference/kda_chunked.py with the chunks' intra-chunk parts computed all at once);
* MLA: expanded attention with `scaled_dot_product_attention` (causal);
* MoE: every routed expert on every token, weighted by the router's top-k weights (zero elsewhere): the
  same sum as the reference's gather, without per-expert indexing. With `fake_quant`, routed expert
  weights pass through MXFP4 quantize/dequantize in the forward pass (straight-through gradient), so
  training sees the weights the exported checkpoint will hold.

Weights `w` may be float32 leaves with requires_grad (training) or any dtype (evaluation); the router's
`e_score_correction_bias` is a plain tensor that training moves for load balance (`route_counts`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3serve.kernels.reference.mxfp4 import mxfp4_dequantize, mxfp4_quantize

from ..attn_res import AttnResState
from ..config import K3Config
from ..functional import (
    LayerWeights,
    acc_dtype,
    act_and_mul,
    gated_rms_norm,
    linear,
    rms_norm,
    rope_interleaved,
)
from ..kda import kda_decay_gate, kda_output_gate, l2_normalize
from ..moe import dense_mlp, route

CHUNK = 16
FLA_FAILED: list[str] = []  # set when an FLA call raised; kda_layer then uses kda_chunked


# ------------------------------------------------------------------------------------------------- KDA
def kda_chunked(q, k, v, g, beta, chunk: int = CHUNK) -> torch.Tensor:
    """The KDA recurrence from a zero state, batched, in chunk (WY) form. q, k `[B, T, h, K]` (already
    normalized and scaled: q̂·K^-1/2, k̂), v `[B, T, h, V]`, g `[B, T, h, K]` log-decay, beta `[B, T, h]`.
    Returns o `[B, T, h, V]` (acc dtype). Equal to `kda.kda_recurrence` up to rounding."""
    acc = acc_dtype(q.dtype) if q.dtype != torch.bfloat16 else torch.float32
    B, T, h, K = q.shape
    V = v.shape[-1]
    pad = (-T) % chunk
    if pad:
        z = lambda t: F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))  # noqa: E731
        q, k, v, g = z(q), z(k), z(v), z(g)
        beta = F.pad(beta, (0, 0, 0, pad))
    N = (T + pad) // chunk
    # [B, h, N, n, *]
    r = lambda t: t.to(acc).reshape(B, N, chunk, h, -1).permute(0, 3, 1, 2, 4)  # noqa: E731
    q, k, v, g = r(q), r(k), r(v), r(g)
    beta = beta.to(acc).reshape(B, N, chunk, h).permute(0, 3, 1, 2)
    G = g.cumsum(dim=3)
    incl = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    diff = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~incl[:, :, None], float("-inf"))
    decay = torch.exp(diff)  # [B, h, N, t, s, K]
    a_kk = torch.einsum("bhntk,bhnsk,bhntsk->bhnts", k, k, decay).tril(-1) * beta[..., :, None]
    a_qk = torch.einsum("bhntk,bhnsk,bhntsk->bhnts", q, k, decay)
    eye = torch.eye(chunk, dtype=acc, device=q.device)
    eG = torch.exp(G)
    rhs = beta[..., None] * torch.cat([k * eG, v], dim=-1)
    wu = torch.linalg.solve_triangular(eye + a_kk, rhs, upper=False, unitriangular=True)
    wk, u0 = wu[..., :K], wu[..., K:]
    qg = q * eG
    kd = k * torch.exp(G[..., -1:, :] - G)  # k̂_s e^{G_n - G_s}
    gn = eG[..., -1, :]  # [B, h, N, K]
    S = torch.zeros(B, h, V, K, dtype=acc, device=q.device)
    outs = []
    for c in range(N):
        u = u0[:, :, c] - torch.einsum("bhtk,bhvk->bhtv", wk[:, :, c], S)
        outs.append(torch.einsum("bhtk,bhvk->bhtv", qg[:, :, c], S) + a_qk[:, :, c] @ u)
        S = S * gn[:, :, c, None, :] + torch.einsum("bhsv,bhsk->bhvk", u, kd[:, :, c])
    o = torch.stack(outs, dim=2)  # [B, h, N, n, V]
    return o.permute(0, 2, 3, 1, 4).reshape(B, N * chunk, h, V)[:, :T]


def single_config_autotune() -> None:
    """Make every Triton autotuner created from now on keep one config (a 4-warp one when there is one):
    FLA's kernels then compile once per shape instead of benchmarking every config (minutes on a fresh
    machine for this small model). Call before importing `fla`."""
    from triton.runtime import autotuner

    if getattr(autotuner.Autotuner, "_k3_single", False):
        return
    orig = autotuner.Autotuner.__init__

    def init(self, fn, arg_names, configs, *a, **k):
        four = [c for c in configs if getattr(c, "num_warps", None) == 4]
        orig(self, fn, arg_names, (four or list(configs))[:1], *a, **k)

    autotuner.Autotuner.__init__ = init
    autotuner.Autotuner._k3_single = True


def _kda_fla(q, k, v, g, beta) -> torch.Tensor:
    from fla.ops.kda import chunk_kda

    o, _ = chunk_kda(q.to(torch.bfloat16).contiguous(), k.to(torch.bfloat16).contiguous(),
                     v.to(torch.bfloat16).contiguous(), g.float().contiguous(), beta.to(torch.bfloat16).contiguous(),
                     scale=1.0)
    return o


def kda_layer(x: torch.Tensor, w: LayerWeights, cfg: K3Config, kda: str = "chunked") -> torch.Tensor:
    """One KDA layer on a batch `[B, T, H]` (the normed layer input) -> `[B, T, H]`."""
    B, T, _ = x.shape
    h, d = cfg.kda_num_heads, cfg.kda_head_dim
    P = h * d
    qkv = torch.cat([linear(x, w["q_proj.weight"]), linear(x, w["k_proj.weight"]), linear(x, w["v_proj.weight"])], -1)
    conv_w = torch.cat([w["q_conv1d.weight"], w["k_conv1d.weight"], w["v_conv1d.weight"]], 0)  # [3P, K]
    Kc = conv_w.shape[1]
    acc = acc_dtype(x.dtype)
    xc = F.pad(qkv.to(acc).transpose(1, 2), (Kc - 1, 0))
    qkv = F.silu(F.conv1d(xc, conv_w.to(acc)[:, None, :], groups=3 * P)).transpose(1, 2).to(x.dtype)
    q, k, v = (t.reshape(B, T, h, d) for t in qkv.split(P, dim=-1))
    raw_g = linear(linear(x, w["f_a_proj.weight"]), w["f_b_proj.weight"]).reshape(B * T, h, d)
    g = kda_decay_gate(raw_g, w["A_log"], w["dt_bias"], cfg.gate_lower_bound).reshape(B, T, h, d)
    beta = torch.sigmoid(linear(x, w["b_proj.weight"]).to(acc))
    qh = l2_normalize(q.to(acc)) * d**-0.5
    kh = l2_normalize(k.to(acc))
    if kda == "fla" and not FLA_FAILED:
        try:
            o = _kda_fla(qh, kh, v, g, beta)
        except Exception as e:  # noqa: BLE001 - a shape FLA cannot compile: the portable path, from now on
            FLA_FAILED.append(f"{type(e).__name__}: {e}"[:300])
            o = kda_chunked(qh, kh, v.to(acc), g, beta)
    else:
        o = kda_chunked(qh, kh, v.to(acc), g, beta)
    o = o.to(x.dtype)
    gate = kda_output_gate(x, w).reshape(B, T, h, d)
    y = gated_rms_norm(o, w["o_norm.weight"], gate, cfg.rms_norm_eps).reshape(B, T, P)
    return linear(y, w["o_proj.weight"])


# ------------------------------------------------------------------------------------------------- MLA
def mla_qkv(x: torch.Tensor, w: LayerWeights, cfg: K3Config, positions: torch.Tensor):
    """MLA's projections of `x` [B, N, H] at `positions` [N], expanded per head (the layout of
    `scaled_dot_product_attention`): q [B, nh, N, dn+dr], k [B, nh, N, dn+dr], v [B, nh, N, dv]."""
    B, N, _ = x.shape
    nh, dn, dr, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank is not None:
        q = linear(rms_norm(linear(x, w["q_a_proj.weight"]), w["q_a_layernorm.weight"], cfg.rms_norm_eps),
                   w["q_b_proj.weight"])
    else:
        q = linear(x, w["q_proj.weight"])
    q = q.reshape(B, N, nh, dn + dr)
    q_nope, q_pe = q[..., :dn], q[..., dn:]
    kv_a = linear(x, w["kv_a_proj_with_mqa.weight"])
    c_kv = rms_norm(kv_a[..., :r], w["kv_a_layernorm.weight"], cfg.rms_norm_eps)
    k_pe = kv_a[..., r:]
    if not cfg.mla_use_nope and dr > 0:
        q_pe = rope_interleaved(q_pe.transpose(0, 1).reshape(N, B * nh, dr), positions, cfg.rope_theta)
        q_pe = q_pe.reshape(N, B, nh, dr).transpose(0, 1)
        k_pe = rope_interleaved(k_pe.transpose(0, 1), positions, cfg.rope_theta).transpose(0, 1)
    kv = linear(c_kv, w["kv_b_proj.weight"]).reshape(B, N, nh, -1)
    k_nope, v = kv[..., :dn], kv[..., dn:]
    qf = torch.cat([q_nope, q_pe], -1).transpose(1, 2)
    kf = torch.cat([k_nope, k_pe[:, :, None, :].expand(B, N, nh, dr)], -1).transpose(1, 2)
    return qf, kf, v.transpose(1, 2)


def mla_out(o: torch.Tensor, x: torch.Tensor, w: LayerWeights, cfg: K3Config) -> torch.Tensor:
    """The attention output `o` [B, N, nh * dv] of the layer input `x` [B, N, H] -> [B, N, H]: the optional
    sigmoid output gate g_proj(x) (acc dtype), then o_proj."""
    if cfg.mla_use_output_gate:
        a = acc_dtype(o.dtype)
        o = (o.to(a) * torch.sigmoid(linear(x, w["g_proj.weight"]).to(a))).to(x.dtype)
    return linear(o, w["o_proj.weight"])


def mla_layer(x: torch.Tensor, w: LayerWeights, cfg: K3Config) -> torch.Tensor:
    """One MLA layer on a batch `[B, T, H]` (causal, positions 0..T-1) -> `[B, T, H]`."""
    B, T, _ = x.shape
    q, k, v = mla_qkv(x, w, cfg, torch.arange(T, device=x.device))
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return mla_out(o.transpose(1, 2).reshape(B, T, -1), x, w, cfg)


# ------------------------------------------------------------------------------------------------- MoE
def fake_mxfp4(t: torch.Tensor) -> torch.Tensor:
    """t with MXFP4-rounded values in the forward pass and the identity gradient."""
    with torch.no_grad():
        q = mxfp4_dequantize(*mxfp4_quantize(t.detach().float()), torch.float32).to(t.dtype)
    return t + (q - t).detach()


def expert_stacks(w: LayerWeights, dtype: torch.dtype, fake_quant: bool):
    if "experts.w13_packed" in w:
        return (mxfp4_dequantize(w["experts.w13_packed"], w["experts.w13_scale"], dtype),
                mxfp4_dequantize(w["experts.w2_packed"], w["experts.w2_scale"], dtype))
    w13, w2 = w["experts.w13"], w["experts.w2"]
    if fake_quant:
        w13, w2 = fake_mxfp4(w13), fake_mxfp4(w2)
    return w13.to(dtype), w2.to(dtype)


def moe_layer(x: torch.Tensor, w: LayerWeights, cfg: K3Config, fake_quant: bool = False,
              counts: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE block on `[B, T, H]` -> `[B, T, H]`; adds the tokens routed to each expert into `counts`."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    bias = w["gate.e_score_correction_bias"] if "gate.e_score_correction_bias" in w else None
    ids, weights = route(x2, w["gate.weight"], bias, cfg)
    if counts is not None:
        counts += torch.bincount(ids.reshape(-1), minlength=cfg.num_experts).to(counts.dtype)
    dense = torch.zeros(x2.shape[0], cfg.num_experts, dtype=weights.dtype, device=x.device)
    dense = dense.scatter(1, ids, weights)
    z = linear(x2, w["routed_expert_down_proj.weight"]) if cfg.routed_expert_hidden_size is not None else x2
    w13, w2 = expert_stacks(w, z.dtype, fake_quant)
    inter = cfg.moe_intermediate_size
    hid = torch.einsum("nd,efd->nef", z, w13)
    y = torch.einsum("nei,edi->ned", act_and_mul(hid[..., :inter], hid[..., inter:], cfg), w2)
    r = torch.einsum("ne,ned->nd", dense.to(y.dtype), y).to(x.dtype)
    if cfg.routed_expert_hidden_size is not None:
        if cfg.latent_moe_use_norm:
            r = rms_norm(r, w["routed_expert_norm.weight"], cfg.rms_norm_eps)
        r = linear(r, w["routed_expert_up_proj.weight"])
    if cfg.num_shared_experts > 0:
        r = r + dense_mlp(x2, w.sub("shared_experts."), cfg)
    return r.reshape(shape)


# ------------------------------------------------------------------------------------------------- stack
class Options:
    def __init__(self, kda: str = "chunked", fake_quant: bool = False, counts: dict | None = None,
                 checkpoint: bool = False):
        self.kda, self.fake_quant, self.counts, self.checkpoint = kda, fake_quant, counts, checkpoint


def _attention(w, cfg, i, x, opt):
    lw = LayerWeights(w, f"model.layers.{i}.self_attn.")
    return kda_layer(x, lw, cfg, opt.kda) if cfg.is_kda_layer(i) else mla_layer(x, lw, cfg)


def _mlp(w, cfg, i, x, opt):
    if cfg.is_moe_layer(i):
        counts = None if opt.counts is None else opt.counts.setdefault(
            i, torch.zeros(cfg.num_experts, device=x.device))
        return moe_layer(x, LayerWeights(w, f"model.layers.{i}.block_sparse_moe."), cfg, opt.fake_quant, counts)
    return dense_mlp(x, LayerWeights(w, f"model.layers.{i}.mlp."), cfg)


def hidden_states(w, cfg: K3Config, ids: torch.Tensor, opt: Options | None = None, dtype=None) -> torch.Tensor:
    """ids `[B, T]` -> the hidden state before the final norm `[B, T, H]`."""
    opt = opt or Options()
    emb = w["model.embed_tokens.weight"][ids]
    if dtype is not None:
        emb = emb.to(dtype)
    eps = cfg.rms_norm_eps
    if cfg.attn_res_block_size is None:
        h = emb
        for i in range(cfg.num_hidden_layers):
            lw = LayerWeights(w, f"model.layers.{i}.")
            h = h + _attention(w, cfg, i, rms_norm(h, lw["input_layernorm.weight"], eps), opt)
            h = h + _mlp(w, cfg, i, rms_norm(h, lw["post_attention_layernorm.weight"], eps), opt)
        return h
    state = AttnResState(emb, cfg.attn_res_block_size, cfg.num_attn_res_blocks)
    mlp_out = None
    for i in range(cfg.num_hidden_layers):
        lw = LayerWeights(w, f"model.layers.{i}.")
        x = state.pre_attn(i, mlp_out, lw["self_attention_res_norm.weight"], lw["self_attention_res_proj.weight"],
                           lw["input_layernorm.weight"], eps)
        a = _attention(w, cfg, i, x, opt)
        y = state.post_attn(i, a, lw["mlp_res_norm.weight"], lw["mlp_res_proj.weight"],
                            lw["post_attention_layernorm.weight"], eps)
        mlp_out = _mlp(w, cfg, i, y, opt)
    return state.final(mlp_out, w["model.output_attn_res_norm.weight"], w["model.output_attn_res_proj.weight"], eps)


def lm_logits(w, cfg: K3Config, h: torch.Tensor) -> torch.Tensor:
    """Pre-norm hidden `[..., H]` -> logits `[..., V]` (final norm + lm_head)."""
    return linear(rms_norm(h, w["model.norm.weight"], cfg.rms_norm_eps), w["lm_head.weight"])


def mtp_hidden(w, cfg: K3Config, j: int, h_prev: torch.Tensor, next_ids: torch.Tensor,
               opt: Options | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MTP layer j on a batch: h_prev `[B, T, H]`, next_ids `[B, T]` (positions 0..T-1) ->
    (logits `[B, T, V]`, h_next `[B, T, H]`). Same function as `mtp.mtp_layer_forward`."""
    from ..mtp import mtp_embed_weight, mtp_head_weight

    opt = opt or Options()
    i = cfg.num_hidden_layers + j
    lw = LayerWeights(w, f"model.layers.{i}.")
    eps = cfg.rms_norm_eps
    e = mtp_embed_weight(w, cfg, j)[next_ids].to(h_prev.dtype)
    e = torch.cat([torch.zeros_like(e[:, :1]), e[:, 1:]], dim=1)  # position 0 is zeroed
    u = linear(torch.cat([rms_norm(e, lw["enorm.weight"], eps), rms_norm(h_prev, lw["hnorm.weight"], eps)], -1),
               lw["eh_proj.weight"])
    v = u + mla_layer(rms_norm(u, lw["input_layernorm.weight"], eps), lw.sub("self_attn."), cfg)
    v = v + _mlp(w, cfg, i, rms_norm(v, lw["post_attention_layernorm.weight"], eps), opt)
    logits = linear(rms_norm(v, lw["shared_head.norm.weight"], eps), mtp_head_weight(w, cfg, j))
    return logits, v


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean token cross-entropy in float32 (over `mask`'s true positions when given)."""
    lf = logits.float().reshape(-1, logits.shape[-1])
    t = targets.reshape(-1)
    if mask is None:
        return F.cross_entropy(lf, t)
    m = mask.reshape(-1)
    return (F.cross_entropy(lf, t, reduction="none") * m).sum() / m.sum().clamp_min(1)


__all__ = ["Options", "cross_entropy", "hidden_states", "kda_chunked", "lm_logits", "mtp_hidden"]
