"""Checkpoint format and loader: make-model round trip, sharding, spellings, fused names, error listing."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k3serve.cli import main as cli_main
from k3serve.workers.model.init_weights import init_weights
from k3serve.workers.model.loader import CheckpointError, load_model_weights
from k3serve.workers.model.paths import ensure_tiny_model, model_cache_dir
from k3serve.workers.model.spec import expected_weights
from k3serve.workers.model.testing import random_config, write_random_model

torch.set_num_threads(1)


def _read_all(d):
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(d, f), "pt") as fh:
                out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def test_tiny_make_model_load_round_trip_identical(tiny_model_dir):
    files = sorted(os.listdir(tiny_model_dir))
    assert files == ["config.json", "generation_config.json", "model.safetensors", "tiktoken.model",
                     "tokenizer_config.json"]
    cfg, w = load_model_weights(tiny_model_dir, dtype=torch.bfloat16)
    raw = json.loads((tiny_model_dir / "config.json").read_text())
    assert raw["model_type"] == "kimi_k3" and raw["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert raw["text_config"]["model_type"] == "kimi_linear"
    assert raw["quantization_config"]["format"] == "mxfp4-pack-quantized"
    want = init_weights(cfg, seed=0, device="cpu", dtype=torch.bfloat16)
    assert list(w) == list(want)
    for k in want:
        assert w[k].dtype == want[k].dtype and torch.equal(w[k], want[k]), k
    # on-disk names: hub spelling, one tensor per expert, hub shapes
    disk = _read_all(tiny_model_dir)
    assert "model.layers.1.block_sparse_moe.experts.31.w3.weight_packed" in disk
    assert disk["model.layers.1.block_sparse_moe.experts.0.w1.weight_scale"].shape == (128, 128 // 32)
    assert disk["model.layers.0.self_attn.q_conv1d.weight"].shape == (256, 1, 4)
    assert disk["model.layers.0.self_attn.A_log"].shape == (1, 1, 4, 1)
    assert disk["model.layers.0.self_attn.A_log"].dtype == torch.float32
    assert disk["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.8.eh_proj.weight" in w  # MTP layer loaded (unused by the reference)
    assert not any("experts.0.w1.weight" == k.rsplit("block_sparse_moe.", 1)[-1] for k in disk)


def test_tiny_model_is_cached_and_atomic(tiny_model_dir):
    assert ensure_tiny_model() == tiny_model_dir
    assert tiny_model_dir.parent == model_cache_dir() / "models"
    assert [p for p in tiny_model_dir.parent.iterdir() if p.name.startswith(".")] == []  # no temp dirs left


@pytest.mark.parametrize("seed", [0, 1, 5, 7, 10, 16])
def test_random_models_round_trip_including_shards(tmp_path, seed):
    cfg, w = write_random_model(tmp_path, seed, max_shard_bytes=20_000 if seed % 2 else None)
    if seed % 2:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    cfg2, w2 = load_model_weights(tmp_path, dtype=torch.float32)
    assert cfg2 == cfg and list(w2) == list(w)
    for k in w:
        assert w2[k].dtype == w[k].dtype and torch.equal(w2[k], w[k]), k


def test_dtypes_on_load(tmp_path):
    for s in range(100):
        cfg = random_config(s)
        if cfg.experts_mxfp4 and cfg.kda_layer_ids and cfg.tie_word_embeddings:
            break
    write_random_model(tmp_path, s, cfg, dtype=torch.bfloat16)
    specs = expected_weights(cfg)
    for dtype, fp32 in ((torch.float64, torch.float64), (torch.bfloat16, torch.float32), (torch.float32, torch.float32)):
        _, w = load_model_weights(tmp_path, dtype=dtype)
        for k, t in w.items():
            want = {"uint8": torch.uint8, "fp32": fp32, "float": dtype}[specs[k].kind]
            assert t.dtype == want, (k, t.dtype)
        assert w["lm_head.weight"] is w["model.embed_tokens.weight"]


def _rewrite(src, dst, transform):
    tensors = transform(dict(_read_all(src)))
    os.makedirs(dst, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = f.read()
    with open(os.path.join(dst, "config.json"), "w") as f:
        f.write(cfg)


def test_fused_and_alternative_names_load_identically(tmp_path, tiny_model_dir):
    cfg, want = load_model_weights(tiny_model_dir, dtype=torch.float32)

    def fuse(t):
        out = {}
        for i in range(cfg.num_hidden_layers):
            a = f"model.layers.{i}.self_attn."
            if cfg.is_kda_layer(i):
                parts = [t.pop(a + n + ".weight") for n in ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj")]
                rows = sum(p.shape[0] for p in parts)
                pad = torch.zeros((-rows) % 16, cfg.hidden_size, dtype=parts[0].dtype)
                out[a + "in_proj_qkvgfab.weight"] = torch.cat(parts + [pad])
                out[a + "conv1d.weight"] = torch.cat([t.pop(a + f"{x}_conv1d.weight") for x in "qkv"])
                out[a + "forget_gate.A_log"] = t.pop(a + "A_log")  # transformers' in-memory spelling
            else:
                out[a + "fused_qkv_a_g_proj.weight"] = torch.cat(
                    [t.pop(a + n + ".weight") for n in ("q_a_proj", "kv_a_proj_with_mqa", "g_proj")])
            m = f"model.layers.{i}.mlp."
            if m + "gate_proj.weight" in t:
                out[m + "gate_up_proj.weight"] = torch.cat([t.pop(m + "gate_proj.weight"), t.pop(m + "up_proj.weight")])
            moe = f"model.layers.{i}.block_sparse_moe."
            for k in [k for k in t if k.startswith(moe + "gate.")]:
                out[k.replace("block_sparse_moe.", "mlp.")] = t.pop(k)  # MoE under `mlp.` (transformers)
        out.update({"language_model." + k: v for k, v in t.items()})  # K3 multimodal prefix
        out["vision_tower.patch_embed.weight"] = torch.zeros(3)  # skipped for kimi_k3
        return out

    _rewrite(tiny_model_dir, tmp_path, fuse)
    cfg2, got = load_model_weights(tmp_path, dtype=torch.float32)
    assert cfg2 == cfg and list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_missing_unexpected_and_shape_errors_are_listed_together(tmp_path, tiny_model_dir):
    def damage(t):
        t.pop("model.layers.3.self_attn.kv_b_proj.weight")
        t.pop("model.layers.2.block_sparse_moe.experts.5.w3.weight_packed")
        t["model.layers.0.self_attn.bogus.weight"] = torch.zeros(2)
        t["model.layers.2.block_sparse_moe.experts.40.w1.weight_packed"] = torch.zeros(128, 64, dtype=torch.uint8)
        t["model.norm.weight"] = torch.zeros(7)
        t["model.layers.1.block_sparse_moe.experts.0.w2.weight_scale"] = torch.zeros(128, 4)  # float, not uint8
        return t

    _rewrite(tiny_model_dir, tmp_path, damage)
    with pytest.raises(CheckpointError) as ei:
        load_model_weights(tmp_path)
    e = ei.value
    assert sorted(e.missing) == ["model.layers.2.block_sparse_moe.experts.5.w3.weight_packed",
                                 "model.layers.3.self_attn.kv_b_proj.weight"]
    assert sorted(x.split(" ")[0] for x in e.unexpected) == [
        "model.layers.0.self_attn.bogus.weight", "model.layers.2.block_sparse_moe.experts.40.w1.weight_packed"]
    assert sorted(x.split(":")[0] for x in e.mismatched) == [
        "model.layers.1.block_sparse_moe.experts.0.w2.weight_scale", "model.norm.weight"]
    msg = str(e)
    for name in ("kv_b_proj", "bogus", "experts.40", "model.norm.weight", "experts.5.w3"):
        assert name in msg


def test_unquantized_experts_for_an_mxfp4_config_are_rejected(tmp_path):
    for s in range(100):
        cfg = random_config(s)
        if cfg.experts_mxfp4:
            break
    plain = cfg.replace(quantization_config=None)
    assert not plain.experts_mxfp4
    write_random_model(tmp_path, s, plain)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    with pytest.raises(CheckpointError) as ei:
        load_model_weights(tmp_path)
    assert any(".weight_packed" in m for m in ei.value.missing)
    assert any("experts.0.w1.weight" in u for u in ei.value.unexpected)


def test_cli_make_model_with_sets(tmp_path):
    out = tmp_path / "m"
    rc = cli_main(["make-model", "--preset", "tiny", "--out", str(out), "--seed", "3",
                   "--set", "num_hidden_layers=3", "--set", "num_experts=8", "--set", "num_nextn_predict_layers=0",
                   "--set", "linear_attn_config.kda_layers=[1,3]", "--set", "quantization_config=null"])
    assert rc == 0
    cfg, w = load_model_weights(out)
    assert cfg.num_hidden_layers == 3 and cfg.kda_layer_ids == [0, 2] and cfg.num_experts == 8
    assert not cfg.experts_mxfp4 and w["model.layers.1.block_sparse_moe.experts.w13"].shape[0] == 8
    assert cfg.vocab_size == 576 and cfg.eos_token_id is not None
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg.eos_token_id
    rc = cli_main(["make-model", "--out", str(tmp_path / "bad"), "--set", "topk_group=5"])
    assert rc == 2
