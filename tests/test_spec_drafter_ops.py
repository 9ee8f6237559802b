"""The fixed-shape MTP drafter's layer (workers/engine/spec/mtp_graphs.py `_kv` / `_query`: one query per row, the
drafted pairs' latents written into the pool, the additive mask, the merged projections) on the configs the other
drafter tests do not reach: an MTP layer with RoPE (q without a low-rank input) and two MTP layers cycled by draft
step (a pair's latent for layer j made at the first draft step of layer j after it). float64: every draft == the
reference drafter's (workers/model/mtp.py `mtp_propose`), the tokens == the reference's. And the op counter
(benchmarks/mtp_drafter_ops.py) runs on the demo model."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch
from _engine_helpers import reference_outputs

from k3serve.sampling_params import SamplingParams
from k3serve.workers.llm import LLM
from k3serve.workers.model.config import K3Config
from k3serve.workers.model.testing import random_config, random_text_config, write_random_model

ROOT = Path(__file__).resolve().parents[1]


def _cfg(kind: str) -> K3Config:
    if kind == "rope":  # seed 7: RoPE on, q_proj (no q_lora), a MoE MTP layer
        cfg = random_config(7)
        assert not cfg.mla_use_nope and cfg.qk_rope_head_dim > 0 and cfg.q_lora_rank is None
        return cfg
    text = random_text_config(4)  # a LatentMoE MTP layer with q_lora; two of them
    text["num_nextn_predict_layers"] = 2
    return K3Config.from_dict(text)


@pytest.mark.parametrize("kind", ["rope", "two-layers"])
def test_graph_drafter_equals_the_reference_drafter(tmp_path, kind):
    from k3serve.workers.engine.spec.mtp_graphs import GraphMTPProposer
    from k3serve.workers.model.mtp import mtp_propose
    from k3serve.workers.model.reference import load_reference_model

    cfg = _cfg(kind)
    d = tmp_path / kind
    write_random_model(d, seed=5, cfg=cfg, dtype=torch.float64)
    rng = random.Random(2)
    V = cfg.vocab_size
    motif = [rng.randrange(V) for _ in range(4)]
    prompts = [
        motif * 4,
        [rng.randrange(V) for _ in range(rng.randint(3, 20))],
        (motif + [rng.randrange(V)]) * 3,
    ]
    k, new = 3, 10
    ref = reference_outputs(d, prompts, new)
    llm = LLM(
        str(d),
        dtype="float64",
        skip_tokenizer_init=True,
        max_num_batched_tokens=32,
        speculative_config={"method": "mtp", "num_speculative_tokens": k},
    )
    prop = llm.engine.proposer = GraphMTPProposer(
        llm.engine.proposer.cfg,
        llm.engine.runner.model.w,
        llm.engine.proposer.dtype,
        k,
        graphs=False,
        slots=1,
        positions=8,
    )
    assert prop.n == cfg.num_nextn_predict_layers
    seen = []
    pb, vd, drafts_for = prop.propose_batch, prop.verify_and_draft, prop.drafts_for
    calls = {"fused": 0, "propose": 0}

    def record_pb(reqs):
        calls["propose"] += 1
        out = pb(reqs)
        seen.extend((list(r.all_token_ids), x) for r, x in zip(reqs, out))
        return out

    def record_vd(*a):
        calls["fused"] += 1
        return vd(*a)

    def record_for(req, x):
        out = drafts_for(req, x)
        if out:
            seen.append((list(req.all_token_ids), out))
        return out

    prop.propose_batch, prop.verify_and_draft, prop.drafts_for = record_pb, record_vd, record_for
    got = [
        o.outputs[0].token_ids
        for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    ]
    assert got == ref
    assert calls["fused"] > 0 and calls["propose"] > 0 and len(seen) >= 6
    assert prop._pool["S"] >= 2 and prop._pool["L"] > 8  # grew (requests and positions)
    model = load_reference_model(str(d), dtype=torch.float64)
    for toks, drafts in seen:
        target_next, want = mtp_propose(model, toks[:-1], k)
        assert target_next == toks[-1]
        assert drafts == want


def test_op_counter_runs_on_the_demo_model(capsys):
    demo = ROOT / "models" / "k3-demo-stdlib"
    if not (demo / "config.json").exists():
        pytest.skip("demo model not in the tree")
    spec = importlib.util.spec_from_file_location(
        "mtp_drafter_ops", ROOT / "benchmarks" / "mtp_drafter_ops.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--model", str(demo), "--prompt-tokens", "24", "--max-tokens", "8", "--dtype", "float32"])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("_fused_step("))
    total, aten, eng = (int(w) for w in line.replace("=", " ").replace("+", " ").split() if w.isdigit())
    assert total == aten + eng and aten > 0 and eng > 0
    assert "k3op::rms_norm" in out and "aten::bmm" in out  # the engine ops and the attention counted
