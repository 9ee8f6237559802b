"""MTP self-distillation (workers/model/train/distill_mtp.py): the unrolled drafter forward equals the
reference drafter (workers/model/mtp.py, float64, random configs with RoPE/NoPE and 1-2 MTP layers), the
acceptance replay counts what the engine counts (the committed demo model, float64), and a tiny CPU run
trains only the MTP layer (every other tensor bit-identical), lowers its KL to the target, exports a
loadable checkpoint, rebuilds it from mtp.safetensors and resumes."""

import json
from pathlib import Path

import pytest
import torch

from k3serve.workers.model.config import K3Config
from k3serve.workers.model.mtp import mtp_layer_forward
from k3serve.workers.model.reference import ReferenceModel
from k3serve.workers.model.testing import random_text_config, write_random_model
from k3serve.workers.model.train import forward as F
from k3serve.workers.model.train.distill_mtp import is_mtp_name, main, mtp_unrolled, simulate_acceptance

torch.set_num_threads(1)
DEMO = Path(__file__).resolve().parents[1] / "models" / "k3-demo-stdlib"


@pytest.mark.parametrize("seed,n_mtp", [(0, 1), (1, 2), (5, 1)])
def test_unrolled_drafts_equal_the_reference_drafter(seed, n_mtp, tmp_path):
    t = random_text_config(seed)
    t["num_nextn_predict_layers"] = n_mtp
    cfg, w = write_random_model(tmp_path, cfg=K3Config.from_dict({"model_type": "kimi_k3", "text_config": t}),
                                dtype=torch.float64)
    ref = ReferenceModel(cfg, w, torch.float64)
    T, S = 10, 3
    ids = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(seed))
    logits, states = mtp_unrolled(ref.w, cfg, F.hidden_states(ref.w, cfg, ids), ids, S)
    assert [x.shape[:2] for x in logits] == [(2, T - S)] * S
    for b in range(2):
        hid = ref.hidden_states(ids[b])
        for p in range(T - S):  # mtp_propose's loop with the sequence's tokens as the accepted drafts
            hs, toks = list(hid[: p + 1].unbind(0)), ids[b, 1: p + 2].tolist()
            for s in range(S):
                lg, hn = mtp_layer_forward(ref, s % n_mtp, torch.stack(hs), toks)
                torch.testing.assert_close(logits[s][b, p], lg[-1], rtol=1e-9, atol=1e-9)
                torch.testing.assert_close(states[s][b, p], hn[-1], rtol=1e-9, atol=1e-9)
                if s + 1 < S:
                    hs.append(hn[-1])
                    toks.append(int(ids[b, p + 2 + s]))


@pytest.mark.skipif(not (DEMO / "config.json").is_file(), reason="the demo model is not in this checkout")
def test_acceptance_replay_counts_what_the_engine_counts():
    from k3serve.sampling_params import SamplingParams
    from k3serve.workers.llm import LLM
    from k3serve.workers.model.loader import load_model_weights

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 3000, (40,), generator=g).tolist() for _ in range(2)]
    k, new = 3, 24
    llm = LLM(str(DEMO), dtype="float64", max_num_seqs=1, max_model_len=80,
              speculative_config={"method": "mtp", "num_speculative_tokens": k})
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    outs = [llm.generate([p], sp)[0].outputs[0].token_ids for p in prompts]
    st = llm.engine.stats()
    cfg, w = load_model_weights(DEMO, dtype=torch.float64)
    seqs = torch.tensor([p + list(o) for p, o in zip(prompts, outs)])
    sim = simulate_acceptance(w, cfg, seqs, 40, [k], F.Options(), max_tokens=new)[k]
    assert sim["steps"] == st["spec_decode_num_drafts"]
    assert [round(x * sim["steps"]) for x in sim["per_position"]] == list(st["spec_decode_num_accepted_tokens_per_pos"])
    assert sum(st["spec_decode_num_accepted_tokens_per_pos"]) > 0  # the trained drafter is right sometimes


TEXT = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\nclass Box:\n"
        "    def __init__(self, size):\n        self.size = size\n\n    def grow(self, n):\n"
        "        self.size = self.size + n\n        return self.size\n") * 12


def _tiny_model(tmp_path: Path) -> Path:
    """A corpus of a few files (training and held-out by corpus.py's path hash), a BPE tokenizer on it and
    a random K3 model with MXFP4 experts and one MTP layer over that vocabulary."""
    from k3serve.workers.model.train.bpe import train_bpe, write_k3_tokenizer
    from k3serve.workers.model.train.corpus import is_heldout, is_validation
    from k3serve.workers.model.train.run import configs

    lib = tmp_path / "lib" / "pkg"
    lib.mkdir(parents=True)
    held = [n for n in range(2000) if is_heldout(f"pkg/m{n}.py")][:2]
    valid = [n for n in range(2000) if is_validation(f"pkg/m{n}.py")][:1]
    for n in [*range(6), *held, *valid]:
        (lib / f"m{n}.py").write_text(TEXT.replace("add", f"add{n}"))
    model = tmp_path / "init"
    vocab = write_k3_tokenizer(str(model), train_bpe([TEXT], 300))
    tiny = {"hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 32,
            "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "num_heads": 1, "head_dim": 16,
                                   "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": True},
            "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 16,
            "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "num_experts": 4,
            "num_experts_per_token": 2, "moe_intermediate_size": 32, "routed_expert_hidden_size": 32}
    _train_cfg, cfg = configs(vocab, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, tiny)
    write_random_model(model, seed=3, cfg=cfg)
    return model


def test_tiny_distillation_trains_only_the_mtp_layer_and_resumes(tmp_path):
    from safetensors.torch import load_file

    from k3serve.workers.model.loader import load_model_weights

    init = _tiny_model(tmp_path)
    common = ["--distill-mtp", "--init", str(init), "--stdlib", str(tmp_path / "lib"), "--device", "cpu",
              "--seq", "40", "--batch", "4", "--unroll", "2", "--data", "mix", "--greedy-seqs", "4",
              "--greedy-prompt", "16", "--eval-prompts", "2", "--eval-prompt-len", "16", "--eval-max-tokens", "12",
              "--eval-ks", "1,2,3", "--eval-windows", "2", "--lr", "3e-3", "--warmup", "2"]
    out = tmp_path / "run"
    assert main([*common, "--out", str(out), "--steps", "30"]) == 0
    rec = json.loads((out / "distill.json").read_text())
    assert json.loads((out / "init" / "results.json").read_text())["mtp_distill"]["steps"] == rec["steps"] == 30
    first = next(line for line in (out / "distill.log").read_text().splitlines() if '"step": 0,' in line)
    kl0 = json.loads(first[first.index("{"):])["kl"]
    assert rec["final"]["kl"][0] < 0.7 * kl0[0], (kl0, rec["final"])  # it learns the target's distribution
    for when in ("before", "after"):
        assert set(rec[when]["replay"]) == {"1", "2", "3"} and rec[when]["replay"]["3"]["steps"] > 0
    old, new = load_file(str(init / "model.safetensors")), load_file(str(out / "init" / "model.safetensors"))
    assert set(old) == set(new)
    cfg = K3Config.from_pretrained(init)
    changed = set()
    for k in old:
        assert old[k].dtype == new[k].dtype and old[k].shape == new[k].shape, k
        if is_mtp_name(k, cfg):
            changed |= {k} if not torch.equal(old[k], new[k]) else set()
        else:
            assert torch.equal(old[k], new[k]), f"{k}: a target tensor changed"
    assert any("experts.0.w1.weight_packed" in k for k in changed) and any("eh_proj" in k for k in changed)
    cfg2, w2 = load_model_weights(out / "init", dtype=torch.float64)
    assert cfg2.experts_mxfp4 and cfg2.num_nextn_predict_layers == 1
    # rebuild from the MTP tensors alone: the same file content
    assert main([*common, "--out", str(tmp_path / "applied"), "--apply-mtp", str(out / "mtp.safetensors")]) == 0
    again = load_file(str(tmp_path / "applied" / "init" / "model.safetensors"))
    assert all(torch.equal(again[k], new[k]) for k in new)
    # resume: the checkpoint after 30 steps, asked for 32
    ck = torch.load(out / "ckpt-distill.pt")
    ck["meta"]["total"] = 32
    torch.save(ck, out / "ckpt-distill.pt")
    assert main([*common, "--out", str(tmp_path / "run2"), "--resume", str(out)]) == 0
    assert json.loads((tmp_path / "run2" / "distill.json").read_text())["steps"] == 32
    assert "resumed from" in (tmp_path / "run2" / "distill.log").read_text()
    # --variants: each from the init MTP layer, into its own directory; the best one's record with the comparison
    assert main([*common, "--out", str(tmp_path / "cmp"), "--steps", "2", "--variants", "data:1,greedy:2"]) == 0
    best = json.loads((tmp_path / "cmp" / "distill.json").read_text())
    assert [(v["data"], v["unroll"]) for v in best["compare"]] == [("data", 1), ("greedy", 2)]
    for v in ("v-data-u1", "v-greedy-u2"):
        assert (tmp_path / "cmp" / v / "mtp.safetensors").is_file()
