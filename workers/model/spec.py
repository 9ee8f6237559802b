"""The canonical in-memory weight names and shapes of a K3 / Kimi-Linear text model.

`expected_weights(cfg)` lists every tensor `load_model_weights` returns (a contract other engineers code
against), with its shape and kind:

* kind "float": stored in the model dtype;
* kind "fp32":  kept in float32 (float64 when the model dtype is float64): conv1d weights, A_log, dt_bias,
  the router weight and its correction bias;
* kind "uint8": MXFP4 packed nibbles and E8M0 scales.

`default` says what happens when a checkpoint lacks the tensor: None = required, "zeros" = filled with
zeros (the router correction bias), "absent" = simply not returned (optional MTP extras), "tied" = the
embedding tensor itself (lm_head with tie_word_embeddings).
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import K3Config


@dataclass(frozen=True)
class WeightSpec:
    shape: tuple[int, ...]
    kind: str = "float"  # "float" | "fp32" | "uint8"
    default: str | None = None  # None | "zeros" | "absent" | "tied"


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def _kda_spec(cfg: K3Config, p: str) -> dict[str, WeightSpec]:
    H, h, d, K = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size
    P = h * d
    a = p + "self_attn."
    s = {
        a + "q_proj.weight": WeightSpec((P, H)),
        a + "k_proj.weight": WeightSpec((P, H)),
        a + "v_proj.weight": WeightSpec((P, H)),
        a + "f_a_proj.weight": WeightSpec((d, H)),
        a + "f_b_proj.weight": WeightSpec((P, d)),
        a + "b_proj.weight": WeightSpec((h, H)),
        a + "q_conv1d.weight": WeightSpec((P, K), "fp32"),
        a + "k_conv1d.weight": WeightSpec((P, K), "fp32"),
        a + "v_conv1d.weight": WeightSpec((P, K), "fp32"),
        a + "A_log": WeightSpec((h,), "fp32"),
        a + "dt_bias": WeightSpec((P,), "fp32"),
        a + "o_norm.weight": WeightSpec((d,)),
        a + "o_proj.weight": WeightSpec((H, P)),
    }
    if cfg.use_full_rank_gate:
        s[a + "g_proj.weight"] = WeightSpec((P, H))
    else:
        s[a + "g_a_proj.weight"] = WeightSpec((d, H))
        s[a + "g_b_proj.weight"] = WeightSpec((P, d))
    return s


def _mla_spec(cfg: K3Config, p: str) -> dict[str, WeightSpec]:
    H, h = cfg.hidden_size, cfg.num_attention_heads
    dn, dr, dv, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    a = p + "self_attn."
    s: dict[str, WeightSpec] = {}
    if cfg.q_lora_rank is not None:
        s[a + "q_a_proj.weight"] = WeightSpec((cfg.q_lora_rank, H))
        s[a + "q_a_layernorm.weight"] = WeightSpec((cfg.q_lora_rank,))
        s[a + "q_b_proj.weight"] = WeightSpec((h * (dn + dr), cfg.q_lora_rank))
    else:
        s[a + "q_proj.weight"] = WeightSpec((h * (dn + dr), H))
    s[a + "kv_a_proj_with_mqa.weight"] = WeightSpec((r + dr, H))
    s[a + "kv_a_layernorm.weight"] = WeightSpec((r,))
    s[a + "kv_b_proj.weight"] = WeightSpec((h * (dn + dv), r))
    s[a + "o_proj.weight"] = WeightSpec((H, h * dv))
    if cfg.mla_use_output_gate:
        s[a + "g_proj.weight"] = WeightSpec((h * dv, H))
    return s


def _mlp_spec(H: int, inter: int, p: str) -> dict[str, WeightSpec]:
    return {
        p + "gate_proj.weight": WeightSpec((inter, H)),
        p + "up_proj.weight": WeightSpec((inter, H)),
        p + "down_proj.weight": WeightSpec((H, inter)),
    }


def _moe_spec(cfg: K3Config, p: str) -> dict[str, WeightSpec]:
    H, E, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    din = cfg.expert_hidden_size
    m = p + "block_sparse_moe."
    s = {
        m + "gate.weight": WeightSpec((E, H), "fp32"),
        m + "gate.e_score_correction_bias": WeightSpec((E,), "fp32", "zeros"),
    }
    if cfg.experts_mxfp4:
        s[m + "experts.w13_packed"] = WeightSpec((E, 2 * inter, din // 2), "uint8")
        s[m + "experts.w13_scale"] = WeightSpec((E, 2 * inter, din // 32), "uint8")
        s[m + "experts.w2_packed"] = WeightSpec((E, din, inter // 2), "uint8")
        s[m + "experts.w2_scale"] = WeightSpec((E, din, inter // 32), "uint8")
    else:
        s[m + "experts.w13"] = WeightSpec((E, 2 * inter, din))
        s[m + "experts.w2"] = WeightSpec((E, din, inter))
    if cfg.routed_expert_hidden_size is not None:
        lat = cfg.routed_expert_hidden_size
        s[m + "routed_expert_down_proj.weight"] = WeightSpec((lat, H))
        if cfg.latent_moe_use_norm:
            s[m + "routed_expert_norm.weight"] = WeightSpec((lat,))
        s[m + "routed_expert_up_proj.weight"] = WeightSpec((H, lat))
    if cfg.num_shared_experts > 0:
        s.update(_mlp_spec(H, cfg.shared_intermediate_size, m + "shared_experts."))
    return s


def decoder_layer_spec(cfg: K3Config, i: int, attn_res: bool) -> dict[str, WeightSpec]:
    """Weights of decoder layer i (0-based; i >= num_hidden_layers for MTP layers)."""
    H = cfg.hidden_size
    p = layer_prefix(i)
    s = {p + "input_layernorm.weight": WeightSpec((H,)), p + "post_attention_layernorm.weight": WeightSpec((H,))}
    if attn_res:
        for n in ("self_attention_res", "mlp_res"):
            s[p + f"{n}_norm.weight"] = WeightSpec((H,))
            s[p + f"{n}_proj.weight"] = WeightSpec((1, H))
    s.update(_kda_spec(cfg, p) if cfg.is_kda_layer(i) else _mla_spec(cfg, p))
    if cfg.is_moe_layer(i):
        s.update(_moe_spec(cfg, p))
    else:
        s.update(_mlp_spec(H, cfg.intermediate_size, p + "mlp."))
    return s


def mtp_layer_spec(cfg: K3Config, j: int) -> dict[str, WeightSpec]:
    """MTP layer j (checkpoint index num_hidden_layers + j): its extras plus an MLA decoder layer without AttnRes."""
    H, V = cfg.hidden_size, cfg.vocab_size
    i = cfg.num_hidden_layers + j
    p = layer_prefix(i)
    s = {
        p + "eh_proj.weight": WeightSpec((H, 2 * H)),
        p + "enorm.weight": WeightSpec((H,)),
        p + "hnorm.weight": WeightSpec((H,)),
        p + "shared_head.norm.weight": WeightSpec((H,)),
        p + "shared_head.head.weight": WeightSpec((V, H), default="absent"),
        p + "embed_tokens.weight": WeightSpec((V, H), default="absent"),
    }
    s.update(decoder_layer_spec(cfg, i, attn_res=False))
    return s


def expected_weights(cfg: K3Config) -> dict[str, WeightSpec]:
    """Every canonical tensor name of the model -> its WeightSpec (insertion order = model order)."""
    H, V = cfg.hidden_size, cfg.vocab_size
    s = {"model.embed_tokens.weight": WeightSpec((V, H))}
    attn_res = cfg.attn_res_block_size is not None
    for i in range(cfg.num_hidden_layers):
        s.update(decoder_layer_spec(cfg, i, attn_res))
    for j in range(cfg.num_nextn_predict_layers):
        s.update(mtp_layer_spec(cfg, j))
    if attn_res:
        s["model.output_attn_res_norm.weight"] = WeightSpec((H,))
        s["model.output_attn_res_proj.weight"] = WeightSpec((1, H))
    s["model.norm.weight"] = WeightSpec((H,))
    s["lm_head.weight"] = WeightSpec((V, H), default="tied" if cfg.tie_word_embeddings else None)
    return s
