"""Test helpers shared by every test suite: random valid configs and small random checkpoints.

    cfg = random_config(seed)                    # a small, valid, randomly shaped K3Config
    cfg, weights = write_random_model(dir, seed)  # config.json + model.safetensors (no tokenizer)

`random_config` varies everything the architecture allows: kimi_k3 vs kimi_linear, the KDA/MLA layout,
bounded or softplus decay gate, full- or low-rank KDA output gate, conv width, q-LoRA or not, NoPE or
RoPE, MLA output gate, AttnRes block size or plain residual, SiTU or SiLU, dense-only or MoE, grouped
top-k, sigmoid or softmax router, LatentMoE with or without its norm, MXFP4 or float experts, shared
experts, first_k_dense_replace / moe_layer_freq, tied embeddings, MTP layers. Shapes stay tiny.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from .config import K3Config, mxfp4_quantization_config


def random_text_config(seed: int) -> dict:
    """A random valid text config in the hub spelling (see `random_config`)."""
    r = random.Random(seed)
    L = r.randint(2, 6)
    H = r.choice([32, 64])
    kinds = [r.random() < 0.6 for _ in range(L)]
    kinds[r.randrange(L)] = True  # at least one KDA layer
    mla_forced = r.randrange(L)
    while kinds.count(False) == 0:
        kinds[mla_forced] = False  # at least one MLA layer
    moe = r.random() < 0.85
    mxfp4 = moe and r.random() < 0.6
    t: dict = {
        "model_type": "kimi_linear",
        "vocab_size": r.choice([61, 97, 128]),
        "hidden_size": H,
        "num_hidden_layers": L,
        "rms_norm_eps": r.choice([1e-5, 1e-6]),
        "tie_word_embeddings": r.random() < 0.3,
        "max_position_embeddings": 512,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "linear_attn_config": {
            "kda_layers": [i + 1 for i in range(L) if kinds[i]],
            "full_attn_layers": [i + 1 for i in range(L) if not kinds[i]],
            "num_heads": r.choice([1, 2, 4]),
            "head_dim": r.choice([8, 16]),
            "short_conv_kernel_size": r.choice([2, 3, 4]),
            "gate_lower_bound": r.choice([None, -5.0, round(r.uniform(-4.5, -0.5), 3)]),
            "use_full_rank_gate": r.random() < 0.5,
        },
        "num_attention_heads": r.choice([1, 2, 4]),
        "q_lora_rank": r.choice([None, 16, 32]),
        "kv_lora_rank": r.choice([16, 32]),
        "qk_nope_head_dim": r.choice([8, 16]),
        "qk_rope_head_dim": r.choice([4, 8]),
        "v_head_dim": r.choice([8, 16]),
        "mla_use_nope": r.random() < 0.5,
        "mla_use_output_gate": r.random() < 0.5,
        "rope_theta": r.choice([10000.0, 50000.0]),
        "attn_res_block_size": r.choice([None, r.randint(1, L)]),
        "intermediate_size": r.choice([48, 96]),
        "num_nextn_predict_layers": r.choice([0, 0, 1]),
    }
    if r.random() < 0.6:
        t.update(hidden_act="situ", activation_situ_beta=r.choice([4.0, 2.0]),
                 activation_situ_linear_beta=r.choice([None, 25.0, 3.0]))
    else:
        t["hidden_act"] = "silu"
    if moe:
        E = r.choice([4, 8, 16])
        groups = r.choice([g for g in (1, 2, 4) if E % g == 0 and E // g >= 2])
        topk_group = r.randint(1, groups)
        k = r.randint(1, min(4, topk_group * (E // groups)))
        latent = r.choice([None, 32]) if H > 32 or r.random() < 0.5 else None
        t.update(
            num_experts=E,
            num_experts_per_token=k,
            num_expert_group=groups,
            topk_group=topk_group,
            moe_router_activation_func="sigmoid" if r.random() < 0.8 else "softmax",
            moe_renormalize=r.random() < 0.7,
            routed_scaling_factor=r.choice([1.0, 2.5]),
            moe_intermediate_size=r.choice([32, 64]),
            num_shared_experts=r.choice([0, 1, 2]),
            routed_expert_hidden_size=latent,
            latent_moe_use_norm=latent is not None and r.random() < 0.7,
            first_k_dense_replace=r.randint(0, min(2, L - 1)),
            moe_layer_freq=r.choice([1, 1, 2]),
        )
        if mxfp4:
            t["quantization_config"] = mxfp4_quantization_config()
    return t


def random_config(seed: int) -> K3Config:
    """A random valid K3Config (deterministic per seed); about 60% kimi_k3, the rest kimi_linear."""
    text = random_text_config(seed)
    if random.Random(seed + 7919).random() < 0.6:
        return K3Config.from_dict({"model_type": "kimi_k3", "text_config": text})
    return K3Config.from_dict(text)


def write_random_model(
    out_dir: str | Path, seed: int = 0, cfg: K3Config | None = None, dtype: torch.dtype = torch.float32,
    max_shard_bytes: int | None = None,
) -> tuple[K3Config, dict[str, torch.Tensor]]:
    """Write config.json + safetensors for `cfg` (default `random_config(seed)`) with random weights
    (`init_weights`, float ones in `dtype`). No tokenizer files. Returns (cfg, canonical weights)."""
    from .checkpoint import save_checkpoint
    from .init_weights import init_weights

    cfg = cfg or random_config(seed)
    weights = init_weights(cfg, seed=seed, device="cpu", dtype=dtype)
    save_checkpoint(cfg, weights, out_dir, max_shard_bytes=max_shard_bytes)
    return cfg, weights
