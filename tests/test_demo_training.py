"""The demo model's training code: BPE tokenizer files, the batched training forward against the reference
(float64, random configs), the chunked KDA, MXFP4 fake-quant, and a tiny end-to-end run with resume."""

import json

import pytest
import torch

from k3serve.tokenizer import SPECIAL_TOKEN_OFFSETS, K3Tokenizer
from k3serve.workers.model.kda import kda_recurrence, l2_normalize
from k3serve.workers.model.loader import load_model_weights
from k3serve.workers.model.mtp import mtp_layer_forward
from k3serve.workers.model.reference import ReferenceModel
from k3serve.workers.model.testing import write_random_model
from k3serve.workers.model.train import forward as F
from k3serve.workers.model.train.bpe import count_pieces, train_bpe, write_k3_tokenizer
from k3serve.workers.model.train.corpus import is_heldout, is_validation
from k3serve.workers.model.train.run import main as train_main

torch.set_num_threads(1)

TEXT = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\nclass Box:\n"
        "    def __init__(self, size):\n        self.size = size\n") * 20


def test_bpe_writes_a_k3_tokenizer(tmp_path):
    ranks = train_bpe([TEXT], 300)
    assert len(ranks) == 300 and sorted(ranks.values()) == list(range(300))
    assert all(ranks[bytes([b])] == b for b in range(256))
    pieces = count_pieces([TEXT])
    pairs = {}
    for p, n in pieces.items():
        for a, b in zip(p, p[1:]):
            pairs[(a, b)] = pairs.get((a, b), 0) + n
    best = min(pairs, key=lambda x: (-pairs[x], x))
    assert ranks[bytes(best)] == 256  # the first merge is the most frequent pair
    assert train_bpe([TEXT], 300) == ranks  # deterministic
    total = write_k3_tokenizer(str(tmp_path), ranks)
    tok = K3Tokenizer.from_dir(str(tmp_path))
    assert total == tok.vocab_size == 300 + 256
    for off, name in SPECIAL_TOKEN_OFFSETS.items():
        assert tok.special_id(name) == 300 + off
    for s in (TEXT, "unseen: ünïcödé 中文 <|open|>", ""):
        assert tok.decode(tok.encode(s)) == s
    assert len(tok.encode(TEXT)) < len(TEXT.encode()) / 2  # the merges compress the training text


def test_kda_chunked_equals_the_recurrence():
    g = torch.Generator().manual_seed(0)
    B, T, h, K, V = 2, 37, 2, 8, 6  # T not a multiple of the chunk
    q = torch.randn(B, T, h, K, generator=g, dtype=torch.float64)
    k = torch.randn(B, T, h, K, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, h, V, generator=g, dtype=torch.float64)
    gate = -5 * torch.rand(B, T, h, K, generator=g, dtype=torch.float64)
    beta = torch.rand(B, T, h, generator=g, dtype=torch.float64)
    o = F.kda_chunked(l2_normalize(q) * K**-0.5, l2_normalize(k), v, gate, beta)  # as kda_layer calls it
    for b in range(B):
        ref, _ = kda_recurrence(q[b], k[b], v[b], gate[b], beta[b])
        torch.testing.assert_close(o[b], ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("seed", [0, 3, 4, 6, 9])
def test_training_forward_equals_the_reference(seed, tmp_path):
    cfg, w = write_random_model(tmp_path, seed, dtype=torch.float64)
    ref = ReferenceModel(cfg, w, torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (2, 19), generator=torch.Generator().manual_seed(seed))
    h = F.hidden_states(ref.w, cfg, ids)
    logits = F.lm_logits(ref.w, cfg, h)
    for b in range(2):
        torch.testing.assert_close(logits[b], ref.logits(ids[b]), rtol=1e-9, atol=1e-9)
    if cfg.num_nextn_predict_layers:
        ml, hn = F.mtp_hidden(ref.w, cfg, 0, h[:, :-1], ids[:, 1:])
        for b in range(2):
            rl, rh = mtp_layer_forward(ref, 0, ref.hidden_states(ids[b])[:-1], ids[b, 1:])
            torch.testing.assert_close(ml[b], rl, rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(hn[b], rh, rtol=1e-9, atol=1e-9)


def test_fake_mxfp4_rounds_forward_and_passes_gradients():
    from k3serve.kernels.reference.mxfp4 import mxfp4_dequantize, mxfp4_quantize

    w = torch.randn(3, 8, 64, requires_grad=True)
    q = F.fake_mxfp4(w)
    torch.testing.assert_close(q, mxfp4_dequantize(*mxfp4_quantize(w.detach()), torch.float32), rtol=0, atol=0)
    (q * torch.arange(64.0)).sum().backward()
    torch.testing.assert_close(w.grad, torch.arange(64.0).expand(3, 8, 64))


TINY = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 64,
        "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "num_heads": 1, "head_dim": 16,
                               "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": True},
        "num_attention_heads": 1, "num_key_value_heads": 1, "q_lora_rank": 16, "kv_lora_rank": 16,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "num_experts": 4, "num_experts_per_token": 1,
        "moe_intermediate_size": 32, "routed_expert_hidden_size": 32}


def test_tiny_training_run_exports_a_loadable_checkpoint_and_resumes(tmp_path):
    lib = tmp_path / "lib"
    (lib / "pkg").mkdir(parents=True)
    held = [n for n in range(2000) if is_heldout(f"pkg/m{n}.py")][:2]
    valid = [n for n in range(2000) if is_validation(f"pkg/m{n}.py")][:2]
    for n in [*range(10), *held, *valid]:
        (lib / "pkg" / f"m{n}.py").write_text(TEXT.replace("add", f"add{n}") +
                                              f'\n\ndef f{n}(x):\n    """Return x plus {n}, as an int."""\n    return x + {n}\n')
    args = ["--stdlib", str(lib), "--device", "cpu", "--vocab", "300", "--seq", "32", "--batch", "2",
            "--sft-batch", "2", "--sft-max-tokens", "256", "--eval-functions", "0", "--chat-tokens", "2",
            "--warmup", "2", "--override", json.dumps(TINY)]
    out = tmp_path / "run"
    assert train_main([*args, "--out", str(out), "--pretrain-steps", "4", "--sft-steps", "2"]) == 0
    model = out / "k3-demo-stdlib"
    results = json.loads((model / "results.json").read_text())
    assert results["pretrain_steps"] == 4 and results["sft_steps"] == 2
    assert results["heldout_perplexity"] > 1 and len(results["chat"]) == 3
    assert results["valid_files"] == 2 and results["heldout_files"] == 2
    assert "val" in results["pretrain_final"]
    assert (model / "README.md").read_text().startswith("# k3-demo-stdlib")
    cfg, w = load_model_weights(model, dtype=torch.float64)
    assert cfg.experts_mxfp4 and cfg.num_nextn_predict_layers == 1 and cfg.vocab_size == 556
    assert K3Tokenizer.from_dir(str(model)).vocab_size == cfg.vocab_size
    ref = ReferenceModel(cfg, w, torch.float64)
    ids = torch.tensor([[5, 70, 300, 12, 9, 44]])
    torch.testing.assert_close(F.lm_logits(ref.w, cfg, F.hidden_states(w, cfg, ids))[0], ref.logits(ids[0]),
                               rtol=1e-9, atol=1e-9)
    # resume: the checkpoint records the finished run; asking for more fine-tune steps continues from it
    meta = json.loads((out / "ckpt-meta.json").read_text())
    assert meta["phase"] == "done" and meta["step"] == 4
    meta["phase"] = "sft"
    (out / "ckpt-meta.json").write_text(json.dumps(meta))
    out2 = tmp_path / "run2"
    assert train_main([*args, "--out", str(out2), "--resume", str(out), "--pretrain-steps", "4",
                       "--sft-steps", "3"]) == 0
    r2 = json.loads((out2 / "k3-demo-stdlib" / "results.json").read_text())
    assert r2["pretrain_steps"] == 4 and r2["sft_steps"] == 3
    assert "resumed from" in (out2 / "train.log").read_text()


def test_default_serving_model_is_the_demo_model_when_the_checkout_has_it(tmp_path, monkeypatch, tiny_model_dir):
    from k3serve.workers.model import paths

    monkeypatch.setattr(paths, "DEMO_MODEL_DIR", tmp_path / "k3-demo-stdlib")
    assert paths.default_serving_model() == tiny_model_dir  # no demo model: the generated tiny one
    (tmp_path / "k3-demo-stdlib").mkdir()
    (tmp_path / "k3-demo-stdlib" / "config.json").write_text("{}")
    assert paths.default_serving_model() == tmp_path / "k3-demo-stdlib"
    assert paths.DEMO_MODEL_DIR.name == "k3-demo-stdlib"


def test_chat_acceptance_check_fails_the_random_tiny_model(tiny_model_dir):
    """The check the demo model must pass (workers/model/train/acceptance.py) does reject a model with random
    weights: its answers never leave the thinking channel, so `content` stays empty and nothing finishes."""
    from k3serve.workers.model.train.acceptance import chat_acceptance, chat_problems

    result = chat_acceptance(tiny_model_dir, max_tokens=24)
    assert result["write"]["tokens"] == 24 and result["write"]["finish_reason"] == "length"
    problems = chat_problems(result)
    assert any(p.startswith("write: empty content") for p in problems)
    assert any("finish_reason 'length'" in p for p in problems)
    assert any(p.startswith("lookup: no tool call") for p in problems)
    good = {"write": {"content": "```python\nx\n```", "reasoning": None, "finish_reason": "stop"},
            "lookup": {"content": None, "tool_calls": [{"name": "search_docs", "arguments": '{"query": "q"}'}]}}
    assert chat_problems(good) == []
