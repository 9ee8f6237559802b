"""`k3serve make-model`: write a complete generated K3-architecture checkpoint directory.

    k3serve make-model --preset tiny|small --out DIR [--seed N] [--set KEY=VALUE]... [--device D] [--dtype T]

The directory gets config.json (kimi_k3 wrapper, hub spelling), model.safetensors (or shards + index),
tiktoken.model + tokenizer_config.json (from `k3serve.tokenizer`) and generation_config.json.
Routed experts are MXFP4 unless `--set quantization_config=null`.

`--set` repeats; KEY is a dotted path inside the text config, VALUE is JSON when it parses as JSON, else a
string. When `linear_attn_config.kda_layers` is set and `full_attn_layers` is not, the latter becomes the
complement (and vice versa); when only `num_hidden_layers` changes, the preset's 3:1 pattern (MLA at every
4th layer) is regenerated. The result is validated like any config (errors name the field).

Presets:
* tiny  — CPU-fast: hidden 256, 8 layers (3:1 KDA:MLA), AttnRes block 2 (4 blocks), 32 experts top-4 in a
  128-wide latent (LatentMoE, MXFP4), 2 shared experts, SiTU, one MTP layer, the tokenizer's ~576 ids.
* small — GPU-scale (~4.5 B parameters): hidden 2048, 24 layers, 64 experts top-8, latent 1024. Generated
  on the GPU when one is present (no per-expert Python loops), written in ~2 GB shards.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

import torch

from .config import ConfigError, K3Config, mxfp4_quantization_config

PRESETS = ("tiny", "small")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16, "float64": torch.float64}


def _pattern(num_layers: int) -> tuple[list[int], list[int]]:
    """The presets' 3:1 layout, 1-based: MLA at every 4th layer (4, 8, ...), KDA elsewhere."""
    full = [i for i in range(1, num_layers + 1) if i % 4 == 0]
    return [i for i in range(1, num_layers + 1) if i % 4], full


def preset_text_config(preset: str) -> dict[str, Any]:
    """The text config (hub spelling) of a preset, without the tokenizer-derived ids/vocab."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {list(PRESETS)}")
    tiny = preset == "tiny"
    L = 8 if tiny else 24
    kda, full = _pattern(L)
    return {
        "model_type": "kimi_linear",
        "hidden_size": 256 if tiny else 2048,
        "num_hidden_layers": L,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096 if tiny else 32768,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "intermediate_size": 512 if tiny else 6144,
        "linear_attn_config": {
            "kda_layers": kda,
            "full_attn_layers": full,
            "num_heads": 4 if tiny else 16,
            "head_dim": 64 if tiny else 128,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
        },
        "num_attention_heads": 4 if tiny else 16,
        "num_key_value_heads": 4 if tiny else 16,
        "q_lora_rank": 128 if tiny else 768,
        "kv_lora_rank": 64 if tiny else 512,
        "qk_nope_head_dim": 32 if tiny else 128,
        "qk_rope_head_dim": 16 if tiny else 64,
        "v_head_dim": 32 if tiny else 128,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attn_res_block_size": 2 if tiny else 4,
        "num_experts": 32 if tiny else 64,
        "num_experts_per_token": 4 if tiny else 8,
        "num_expert_group": 1,
        "topk_group": 1,
        "use_grouped_topk": True,
        "topk_method": "noaux_tc",
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "moe_intermediate_size": 128 if tiny else 768,
        "num_shared_experts": 2,
        "routed_expert_hidden_size": 128 if tiny else 1024,
        "latent_moe_use_norm": True,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": 1,
        "quantization_config": mxfp4_quantization_config(),
    }


def parse_set(item: str) -> tuple[list[str], Any]:
    """'a.b=VALUE' -> (['a', 'b'], value); VALUE is JSON when it parses, else the raw string."""
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(key or item, "a --set item must look like KEY=VALUE with a dotted KEY", item)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.split("."), value


def apply_sets(text: dict, sets: list[str]) -> dict:
    """Apply `--set` items to a copy of a text config (see the module docstring for derived fields)."""
    t = copy.deepcopy(text)
    keys = set()
    for item in sets:
        path, value = parse_set(item)
        node = t
        for i, part in enumerate(path[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(".".join(path[: i + 1]), "is not an object, so it has no sub-keys", nxt)
            node = nxt
        node[path[-1]] = value
        keys.add(".".join(path))
    lac = t.get("linear_attn_config")
    L = t.get("num_hidden_layers")
    if isinstance(lac, dict) and isinstance(L, int) and not isinstance(L, bool) and L > 0:
        set_kda, set_full = "linear_attn_config.kda_layers" in keys, "linear_attn_config.full_attn_layers" in keys
        everything = set(range(1, L + 1))
        if set_kda and not set_full and isinstance(lac.get("kda_layers"), list):
            lac["full_attn_layers"] = sorted(everything - set(lac["kda_layers"]))
        elif set_full and not set_kda and isinstance(lac.get("full_attn_layers"), list):
            lac["kda_layers"] = sorted(everything - set(lac["full_attn_layers"]))
        elif not set_kda and not set_full and "num_hidden_layers" in keys:
            lac["kda_layers"], lac["full_attn_layers"] = _pattern(L)
    return t


def build_config(preset: str, sets: list[str] = (), vocab_size: int = 576, special_ids: dict | None = None) -> K3Config:
    """The validated K3Config of a preset with `--set` overrides (`vocab_size` is the tokenizer's, a floor)."""
    text = preset_text_config(preset)
    text["vocab_size"] = vocab_size
    text.update(special_ids or {})
    text = apply_sets(text, list(sets))
    v = text.get("vocab_size")
    if isinstance(v, int) and not isinstance(v, bool) and v < vocab_size:
        raise ConfigError("vocab_size", f"must be >= the tokenizer's vocabulary ({vocab_size})", v)
    return K3Config.from_dict({"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
                               "text_config": text})


def default_device(preset: str) -> str:
    """tiny: always the CPU (portable, deterministic bytes); small: the GPU when there is one."""
    if preset == "small" and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def make_model(
    out_dir: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    sets: list[str] = (),
    device: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int | None = None,
) -> K3Config:
    """Write a complete checkpoint directory; returns its config. Deterministic per (preset, seed, sets, device)."""
    from k3serve.tokenizer import K3Tokenizer, write_tokenizer_files

    from .checkpoint import save_checkpoint
    from .init_weights import init_weights

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer_files(str(out))
    tok = K3Tokenizer.from_dir(str(out))
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    cfg = build_config(preset, sets, vocab, ids)
    cfg.torch_dtype = str(dtype).removeprefix("torch.")
    if max_shard_bytes is None and preset == "small":
        max_shard_bytes = 2 * 1024**3
    with torch.no_grad():
        weights = init_weights(cfg, seed=seed, device=device or default_device(preset), dtype=dtype)
        save_checkpoint(cfg, weights, out, max_shard_bytes=max_shard_bytes)
    (out / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
    return cfg


# ------------------------------------------------------------------------------------------------ CLI


def _size(text: str) -> int:
    units = {"kb": 1024, "mb": 1024**2, "gb": 1024**3, "b": 1}
    t = text.strip().lower()
    for u, mult in units.items():
        if t.endswith(u) and t[: -len(u)].strip():
            return int(float(t[: -len(u)]) * mult)
    return int(t)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=PRESETS, default="tiny")
    parser.add_argument("--out", required=True, help="output directory (created)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="override a text-config field (dotted KEY; JSON VALUE or a string); repeatable")
    parser.add_argument("--device", default=None, help="where to generate (default: cpu for tiny, cuda if present for small)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="float weights' dtype on disk")
    parser.add_argument("--max-shard-size", type=_size, default=None, help="e.g. 2GB (default: one file; 2GB for small)")


def run(args: argparse.Namespace) -> int:
    import sys
    import time

    t0 = time.time()
    try:
        cfg = make_model(args.out, args.preset, args.seed, args.sets, args.device, DTYPES[args.dtype],
                         args.max_shard_size)
    except ConfigError as e:
        print(f"k3serve make-model: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"out": str(args.out), "preset": args.preset, "seed": args.seed,
                      "num_hidden_layers": cfg.num_hidden_layers, "vocab_size": cfg.vocab_size,
                      "seconds": round(time.time() - t0, 2)}))
    return 0
