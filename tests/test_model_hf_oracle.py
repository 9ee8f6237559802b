"""Hugging Face transformers' KimiLinear as an independent oracle for the shared (non-K3-only) parts.

A small random KimiLinearForCausalLM (weights re-drawn at useful scales, non-zero router correction bias)
is saved with save_pretrained; our loader reads the hub tensor names it writes and our reference must
reproduce its logits (float32: 1e-4 relative; float64: 1e-5 — transformers itself rounds through float32
inside its norms and KDA kernels even for float64 models) and its greedy generations (transformers decodes
with its recurrent/latent caches; we recompute the full sequence).

rms_norm_eps is 1e-6 because transformers builds MLA's q_a/kv_a layernorms with a fixed eps of 1e-6, while
vLLM (and we) use config.rms_norm_eps; with eps = 1e-6 both agree.
"""

import math

import pytest
import torch

from k3serve.workers.model.loader import load_model_weights
from k3serve.workers.model.reference import ReferenceModel, greedy_generate

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

CONFIGS = {
    "noqlora": dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2, q_lora_rank=None,
                    num_local_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
                    norm_topk_prob=True, routed_scaling_factor=2.446),
    "qlora_grouped": dict(num_hidden_layers=3, layer_types=["full_attention", "linear_attention", "linear_attention"],
                          q_lora_rank=16, num_local_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2,
                          n_shared_experts=2, norm_topk_prob=False, routed_scaling_factor=1.5),
}


def _hf_model(name: str, seed: int):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(seed)
    cfg = KimiLinearConfig(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                           num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_rope_head_dim=8,
                           v_head_dim=16, qk_nope_head_dim=16, linear_head_dim=16, linear_num_heads=2,
                           linear_conv_kernel_dim=4, rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2, **CONFIGS[name])
    m = KimiLinearForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    H = cfg.hidden_size
    with torch.no_grad():
        for n, p in list(m.named_parameters()) + list(m.named_buffers()):
            if n.endswith(("A_log", "dt_bias")):
                continue  # transformers' FLA-style init is already realistic
            if n.endswith("e_score_correction_bias"):
                new = torch.randn(p.shape, generator=g) * 0.1
            elif n.endswith("norm.weight") or n.endswith("layernorm.weight"):
                new = 1 + 0.1 * torch.randn(p.shape, generator=g)
            elif n.endswith("embed_tokens.weight"):
                new = torch.randn(p.shape, generator=g)
            elif n.endswith("lm_head.weight"):
                new = torch.randn(p.shape, generator=g) * 2 / math.sqrt(H)
            elif n.endswith("conv1d.weight"):
                new = (torch.rand(p.shape, generator=g) * 2 - 1) / math.sqrt(p.shape[-1])
            else:
                new = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])
            p.copy_(new.to(p.dtype))
    return m


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    _hf_model(request.param, seed=len(request.param)).save_pretrained(d)
    return d


def _hf_load(d, dtype):
    from transformers import KimiLinearForCausalLM

    m = KimiLinearForCausalLM.from_pretrained(d, dtype=dtype, experts_implementation="eager").eval()
    m.generation_config.eos_token_id = None  # the reference does not stop at EOS
    return m


def test_hub_names_are_what_transformers_writes(saved):
    from safetensors import safe_open

    with safe_open(str(saved / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.self_attn.q_conv1d.weight" in keys or "model.layers.0.self_attn.q_conv1d.weight" in keys
    assert any(k.endswith("block_sparse_moe.experts.0.w1.weight") for k in keys)
    assert any(k.endswith("gate.e_score_correction_bias") for k in keys)


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-4), (torch.float64, 1e-5)])
def test_logits_match_transformers(saved, dtype, rtol):
    cfg, w = load_model_weights(saved, dtype=dtype)
    assert cfg.model_type == "kimi_linear" and cfg.attn_res_block_size is None
    hf = _hf_load(saved, dtype)
    ids = torch.tensor([5, 17, 3, 88, 41, 41, 9, 60, 23, 7, 70, 12])
    with torch.no_grad():
        want = hf(ids[None]).logits[0].to(torch.float64)
    got = ReferenceModel(cfg, w, dtype).logits(ids).to(torch.float64)
    assert want.std() > 0.5  # non-trivial logits
    err = (got - want).abs().max() / want.abs().max()
    assert err < rtol, f"relative error {err:.2e}"
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_greedy_generation_matches_transformers(saved):
    cfg, w = load_model_weights(saved, dtype=torch.float64)
    hf = _hf_load(saved, torch.float64)
    model = ReferenceModel(cfg, w, torch.float64)
    for prompt in ([1, 50, 3], [7, 8, 9, 10, 11, 60, 61]):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0)
        want = out[0, len(prompt):].tolist()
        assert len(want) == 10 and len(set(want)) > 2
        assert greedy_generate(model, prompt, 10) == want
