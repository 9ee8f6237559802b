"""K3Config: both Kimi-Linear spellings, the kimi_k3 wrapper, round trips, errors naming the field, --set."""

import copy

import pytest

from k3serve.workers.model.config import ConfigError, K3Config, mxfp4_quantization_config
from k3serve.workers.model.make_model import build_config, preset_text_config
from k3serve.workers.model.testing import random_config

# The hub's Kimi-Linear-48B-A3B config.json keys and values (transcribed), shortened to 8 layers.
HUB_KIMI_LINEAR = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 8,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 72,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "model_max_length": 1048576,
    "tie_word_embeddings": False,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "pad_token_id": 163839,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "linear_attn_config": {"full_attn_layers": [4, 8], "kda_layers": [1, 2, 3, 5, 6, 7], "num_heads": 32,
                           "head_dim": 128, "short_conv_kernel_size": 4},
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_shared_experts": 1,
    "moe_intermediate_size": 1024,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 2.446,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "num_nextn_predict_layers": 0,
    "torch_dtype": "bfloat16",
}


def test_hub_kimi_linear_spelling():
    c = K3Config.from_dict(HUB_KIMI_LINEAR)
    assert c.model_type == "kimi_linear"
    assert c.kda_layer_ids == [0, 1, 2, 4, 5, 6] and c.mla_layer_ids == [3, 7]
    assert [c.is_kda_layer(i) for i in range(8)] == [True, True, True, False, True, True, True, False]
    assert (c.kda_num_heads, c.kda_head_dim, c.conv_kernel_size) == (32, 128, 4)
    assert c.gate_lower_bound is None and c.use_full_rank_gate is False
    assert c.max_position_embeddings == 1048576 and c.q_lora_rank is None and c.mla_use_nope
    assert c.num_experts == 256 and c.num_experts_per_token == 8 and c.routed_scaling_factor == 2.446
    assert [c.is_moe_layer(i) for i in range(8)] == [False] + [True] * 7
    assert c.attn_res_block_size is None and c.num_attn_res_blocks == 0
    assert c.routed_expert_hidden_size is None and c.expert_hidden_size == 2304
    assert not c.experts_mxfp4 and c.hidden_act == "silu" and c.eos_token_ids == [163585]


def test_transformers_spelling_from_transformers_config():
    from transformers import KimiLinearConfig

    hf = KimiLinearConfig(vocab_size=64, hidden_size=32, num_hidden_layers=5, num_attention_heads=2,
                          num_key_value_heads=2, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
                          v_head_dim=8, num_local_experts=8, num_experts_per_tok=2, linear_num_heads=2,
                          linear_head_dim=8, linear_conv_kernel_dim=3, moe_intermediate_size=16,
                          layer_types=["linear_attention", "full_attention"] * 2 + ["linear_attention"])
    d = hf.to_dict()
    assert "layer_types" in d and "linear_attn_config" not in d
    c = K3Config.from_dict(d)
    assert c.kda_layer_ids == [0, 2, 4] and c.mla_layer_ids == [1, 3]
    assert (c.kda_num_heads, c.kda_head_dim, c.conv_kernel_size) == (2, 8, 3)
    assert c.num_experts == 8 and c.num_experts_per_token == 2 and c.num_shared_experts == 1
    assert c.first_k_dense_replace == 1 and c.moe_layer_freq == 1
    assert c.mla_use_nope  # transformers' MLA has no rotary embedding
    assert c.routed_scaling_factor == pytest.approx(2.446) and c.max_position_embeddings == 1048576


def test_kimi_k3_wrapper_and_quantization_at_top_level():
    text = preset_text_config("tiny")
    qc = text.pop("quantization_config")
    text["vocab_size"] = 576
    d = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": text,
         "quantization_config": qc, "vision_config": {"patch_size": 14}, "media_placeholder_token_id": 163605}
    c = K3Config.from_dict(d)
    assert c.model_type == "kimi_k3" and c.experts_mxfp4
    assert c.num_attn_res_blocks == 4 and c.attn_res_block_size == 2
    assert c.kda_layer_ids == [0, 1, 2, 4, 5, 6] and c.mla_layer_ids == [3, 7]
    assert all(c.is_kda_layer(i) for i in range(0, 8, 2))  # K3's observation holds for the preset
    assert c.use_full_rank_gate and c.gate_lower_bound == -5.0 and c.mla_use_output_gate
    assert c.hidden_act == "situ" and (c.situ_beta, c.situ_linear_beta) == (4.0, 25.0)
    assert c.routed_expert_hidden_size == 128 and c.latent_moe_use_norm and c.num_shared_experts == 2
    assert not c.is_kda_layer(8) and c.is_moe_layer(8)  # the MTP layer: MLA + MoE
    out = c.to_dict()
    assert out["vision_config"] == {"patch_size": 14} and out["quantization_config"] == qc
    assert out["text_config"]["quantization_config"] == qc
    assert K3Config.from_dict(out) == c


@pytest.mark.parametrize("seed", range(40))
def test_random_configs_round_trip(seed):
    c = random_config(seed)
    assert K3Config.from_dict(c.to_dict()) == c
    assert sorted(c.kda_layer_ids + c.mla_layer_ids) == list(range(c.num_hidden_layers))


def _hub(**changes):
    d = copy.deepcopy(HUB_KIMI_LINEAR)
    for k, v in changes.items():
        node, key = d, k
        if "." in k:
            a, key = k.split(".")
            node = d[a]
        if v is _DROP:
            node.pop(key)
        else:
            node[key] = v
    return d


_DROP = object()

BAD = [
    ({"model_type": "llama"}, "model_type"),
    ({"linear_attn_config.kda_layers": [0, 1, 2, 4, 5, 6]}, "linear_attn_config.kda_layers"),
    ({"linear_attn_config.kda_layers": [1, 2, 3, 4, 5, 6, 7]}, "linear_attn_config.full_attn_layers"),
    ({"linear_attn_config.kda_layers": [1, 2, 3, 5, 6]}, "linear_attn_config.kda_layers"),
    ({"linear_attn_config.kda_layers": [1, 1, 2, 3, 5, 6, 7]}, "linear_attn_config.kda_layers"),
    ({"linear_attn_config.full_attn_layers": _DROP}, "linear_attn_config.full_attn_layers"),
    ({"linear_attn_config.gate_lower_bound": 0.5}, "linear_attn_config.gate_lower_bound"),
    ({"linear_attn_config.gate_lower_bound": -6.0}, "linear_attn_config.gate_lower_bound"),
    ({"linear_attn_config.num_heads": 0}, "linear_attn_config.num_heads"),
    ({"linear_attn_config.use_full_rank_gate": "yes"}, "linear_attn_config.use_full_rank_gate"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"hidden_act": "situ"}, "activation_situ_beta"),
    ({"num_experts_per_token": 300}, "num_experts_per_token"),
    ({"num_expert_group": 3}, "num_expert_group"),
    ({"num_expert_group": 4, "topk_group": 5}, "topk_group"),
    ({"num_expert_group": 4, "topk_group": 1, "num_experts_per_token": 65}, "num_experts_per_token"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"moe_router_activation_func": "relu"}, "moe_router_activation_func"),
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
    ({"kv_lora_rank": _DROP}, "kv_lora_rank"),
    ({"num_local_experts": 128}, "num_local_experts"),
    ({"latent_moe_use_norm": True}, "latent_moe_use_norm"),
    ({"rope_scaling": {"type": "yarn", "factor": 4}}, "rope_scaling"),
    ({"mla_use_nope": False, "qk_rope_head_dim": 63}, "qk_rope_head_dim"),
    ({"vocab_size": "big"}, "vocab_size"),
    ({"rms_norm_eps": 0}, "rms_norm_eps"),
    ({"routed_expert_hidden_size": 100, "quantization_config": mxfp4_quantization_config()},
     "routed_expert_hidden_size"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config.quant_method"),
    ({"quantization_config": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}},
     "quantization_config.format"),
    ({"layer_types": ["full_attention"] * 8}, "layer_types"),
    ({"mlp_layer_types": ["dense", "sparse", "sparse", "dense"] + ["sparse"] * 4}, "mlp_layer_types"),
    ({"mlp_layer_types": ["sparse", "dense"] * 4}, "first_k_dense_replace"),  # implies 0, config says 1
    ({"first_k_dense_replace": -1}, "first_k_dense_replace"),
    ({"num_experts": None, "quantization_config": mxfp4_quantization_config()}, "quantization_config"),
]


@pytest.mark.parametrize("changes,field", BAD, ids=[f for _, f in BAD])
def test_invalid_values_name_the_field(changes, field):
    with pytest.raises(ConfigError) as ei:
        K3Config.from_dict(_hub(**changes))
    assert ei.value.field == field
    assert f"`{field}`" in str(ei.value)


def test_wrapper_errors_use_the_text_config_prefix():
    d = {"model_type": "kimi_k3", "text_config": _hub(hidden_act="gelu")}
    with pytest.raises(ConfigError, match="`text_config.hidden_act`"):
        K3Config.from_dict(d)
    with pytest.raises(ConfigError, match="`text_config`"):
        K3Config.from_dict({"model_type": "kimi_k3"})


def test_set_overrides_derive_the_layer_pattern():
    c = build_config("tiny", ["num_hidden_layers=6", "linear_attn_config.kda_layers=[1,2,4,5]"])
    assert c.num_hidden_layers == 6 and c.kda_layer_ids == [0, 1, 3, 4] and c.mla_layer_ids == [2, 5]
    c = build_config("tiny", ["num_hidden_layers=12"])
    assert c.mla_layer_ids == [3, 7, 11]
    c = build_config("tiny", ["linear_attn_config.full_attn_layers=[2]"])
    assert c.mla_layer_ids == [1]
    c = build_config("tiny", ["hidden_act=silu", "quantization_config=null", "attn_res_block_size=null"])
    assert c.hidden_act == "silu" and not c.experts_mxfp4 and c.attn_res_block_size is None


def test_set_errors_name_the_field():
    with pytest.raises(ConfigError, match="`text_config.hidden_act`"):
        build_config("tiny", ["hidden_act=gelu"])  # not JSON -> the string "gelu"
    with pytest.raises(ConfigError, match="`text_config.linear_attn_config.kda_layers`"):
        build_config("tiny", ["linear_attn_config.kda_layers=[0,1]"])
    with pytest.raises(ConfigError, match="`vocab_size`"):
        build_config("tiny", ["vocab_size=100"], vocab_size=576)
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        build_config("tiny", ["hidden_size"])
    with pytest.raises(ConfigError, match="`hidden_size`"):
        build_config("tiny", ["hidden_size.x=1"])


def test_mtp_layers_need_mla_fields_even_without_mla_layers():
    from k3serve.workers.model.spec import expected_weights

    c = build_config("tiny", ["linear_attn_config.kda_layers=[1,2,3,4,5,6,7,8]"])
    assert c.mla_layer_ids == [] and c.num_nextn_predict_layers == 1 and c.kv_lora_rank == 64
    assert expected_weights(c)["model.layers.8.self_attn.kv_b_proj.weight"].shape == (4 * (32 + 32), 64)
    with pytest.raises(ConfigError, match="`text_config.kv_lora_rank`"):
        build_config("tiny", ["linear_attn_config.kda_layers=[1,2,3,4,5,6,7,8]", "kv_lora_rank=null"])
