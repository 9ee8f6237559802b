"""Engine == reference, token for token (float64), under chunked prefill and preemption.

≥ 50 random prompts of mixed lengths are submitted together with a small token budget (every
long prompt is prefilled in chunks, decodes ride along in the same steps) and a KV budget barely
above one request's worth (requests are preempted and recomputed). Runs on the tiny preset and on
random configs (different layer patterns, head counts, block sizes, gates, routers, residuals).
"""

from __future__ import annotations

import pytest
from _engine_helpers import (
    engine_outputs,
    random_model_dir,
    random_prompts,
    reference_outputs,
    tight_kv_budget,
)

from k3serve.workers.llm import LLM

MAX_NEW = 5


def _check(model_dir, prompts, **engine_kw):
    refs = reference_outputs(model_dir, prompts, MAX_NEW)
    llm = LLM(str(model_dir), dtype="float64", skip_tokenizer_init=True, **engine_kw)
    outs = engine_outputs(llm, prompts, MAX_NEW)
    mismatches = [(i, r, o) for i, (r, o) in enumerate(zip(refs, outs)) if r != o]
    assert not mismatches, f"{len(mismatches)} of {len(prompts)} differ, first: {mismatches[0]}"
    return llm


def test_tiny_batched_chunked_preempted(tiny_model_dir):
    prompts = random_prompts(1, 50, 576, 1, 60)
    budget = tight_kv_budget(tiny_model_dir, 128, extra_blocks=2, block_size=16)
    llm = _check(tiny_model_dir, prompts, max_model_len=128, max_num_batched_tokens=24, max_num_seqs=16,
                 block_size=16, kv_cache_memory=budget)
    assert llm.engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"


@pytest.mark.parametrize("seed", [3, 11])
def test_random_configs(tmp_path_factory, seed):
    d = random_model_dir(tmp_path_factory.getbasetemp(), seed)
    from k3serve.workers.model.config import K3Config

    cfg = K3Config.from_pretrained(str(d))
    prompts = random_prompts(seed, 50, cfg.vocab_size, 1, 40)
    budget = tight_kv_budget(d, 96, extra_blocks=3, block_size=8)
    llm = _check(d, prompts, max_model_len=96, max_num_batched_tokens=20, max_num_seqs=12, block_size=8,
                 kv_cache_memory=budget)
    assert llm.engine.scheduler.num_preemptions > 0


def test_derived_block_size_and_budget_error(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float64", max_model_len=256)
    lay = llm.engine.layout
    assert lay.block_size % 16 == 0 and lay.block_size * lay.mla_token_elems * 8 >= lay.kda_page_used
    with pytest.raises(ValueError, match="minimum is"):
        LLM(str(tiny_model_dir), dtype="float64", max_model_len=256, kv_cache_memory=lay.bytes_per_block * 2)


def test_static_padded_decode_path(tiny_model_dir):
    """The fixed-shape decode batch (what CUDA graphs capture) equals the reference: padding rows
    (state slot -1, cache slot -1) never disturb the real sequences."""
    prompts = random_prompts(7, 11, 576, 1, 30)  # 11 sequences -> padded to the capture size 16
    refs = reference_outputs(tiny_model_dir, prompts, MAX_NEW)
    llm = LLM(str(tiny_model_dir), dtype="float64", skip_tokenizer_init=True, max_model_len=64, block_size=16,
              max_num_seqs=16, static_decode=True)
    assert engine_outputs(llm, prompts, MAX_NEW) == refs
    assert llm.engine.runner.num_static_decode_steps >= MAX_NEW - 1


def test_forward_pins_the_kernel_choice(tiny_model_dir, monkeypatch):
    """The engine's forward runs inside `ops.pinned_kernels()` (K3SERVE_KERNELS read once per pass): every op call
    of a pass sees the pin; with K3SERVE_KERNELS=reference the pass takes the reference ops and the greedy tokens
    still equal the reference forward's."""
    from k3serve.kernels import ops, reference

    seen = []
    real = reference.rms_norm

    def spy(*a, **k):
        seen.append(ops.pinned_mode())
        return real(*a, **k)

    monkeypatch.setattr(reference, "rms_norm", spy)  # rms_norm has no CPU form: every call comes here
    monkeypatch.setenv("K3SERVE_KERNELS", "reference")
    _check(tiny_model_dir, random_prompts(2, 4, 576, 3, 20), max_model_len=64)
    assert seen and set(seen) == {"reference"}
    assert ops.pinned_mode() is None


def test_kda_host_lists_match_the_device_tensors(tiny_model_dir, monkeypatch):
    """Every chunked KDA call of the engine gets the group's host lists (`host=`, kernels/reference/_varlen.py
    HostVarlen: what lets the Triton form skip reading the indices back on CUDA), equal to the tensors passed beside
    them, in-pass snapshot checkpoints included; one HostVarlen per group and step, shared by the group's layers.
    Greedy tokens still equal the reference."""
    from k3serve.kernels import ops

    real = ops.kda_chunked
    calls = []

    def spy(q, k, v, g, beta, pool, si, cu, init, *, host=None, **kw):
        assert host is not None
        assert host.cu_seqlens == cu.tolist() and host.state_indices == si.tolist()
        assert host.has_initial_state == init.tolist()
        for name in ("checkpoint_seq", "checkpoint_offsets", "checkpoint_slots"):
            t = kw.get(name)
            assert getattr(host, name) == (None if t is None else t.tolist()), name
        calls.append((host, kw.get("checkpoint_seq") is not None))  # kept alive: ids below stay unique
        return real(q, k, v, g, beta, pool, si, cu, init, host=host, **kw)

    monkeypatch.setattr(ops, "kda_chunked", spy)
    shared = random_prompts(5, 1, 576, 40, 40)[0]
    prompts = [shared + p for p in random_prompts(6, 6, 576, 5, 30)]
    _check(tiny_model_dir, prompts, max_model_len=128, max_num_batched_tokens=48, max_num_seqs=6, block_size=16,
           enable_prefix_caching=True)
    assert any(ck for _, ck in calls), "prefix caching was meant to export snapshots mid-prefill"
    from k3serve.workers.model.config import K3Config

    cfg = K3Config.from_pretrained(str(tiny_model_dir))
    per_host = {}
    for h, _ in calls:
        per_host[id(h)] = per_host.get(id(h), 0) + 1
    n_kda = sum(cfg.is_kda_layer(i) for i in range(cfg.num_hidden_layers))
    assert max(per_host.values()) > 1 and sum(per_host.values()) == len(calls)
    assert all(n <= n_kda for n in per_host.values())


@pytest.mark.parametrize("seed", [3, 12])  # (3: a plain residual stack, 12: Block AttnRes)
def test_step_logits_equal_the_reference(tmp_path_factory, seed, monkeypatch):
    """The logits of a step, not only its argmax: a chunked prefill then decodes, float64, against the reference's
    logits of the same prefix (token equality alone let a wrong norm weight through: norm weights differ by ~5 %
    between layers, and the random models' argmax survives that). Plain residual stacks: the fused add + norm
    (k3_forward.FUSED_ADD_NORM) and the two ops apart give the same logits bit for bit, and so do the KDA prefill's
    glue forms (k3_forward.KDA_PREFILL_GLUE: in-place slices and fused ops, or copies and PyTorch's ops)."""
    import torch

    from k3serve.sampling_params import SamplingParams
    from k3serve.workers.engine import k3_forward
    from k3serve.workers.model.reference import load_reference_model

    d = random_model_dir(tmp_path_factory.getbasetemp(), seed)
    ref = load_reference_model(str(d), dtype=torch.float64)
    prompt = random_prompts(seed + 100, 1, ref.cfg.vocab_size, 30, 30)[0]
    runs = []
    for fused in (True, False):
        monkeypatch.setattr(k3_forward, "FUSED_ADD_NORM", fused)
        monkeypatch.setattr(k3_forward, "KDA_PREFILL_GLUE", fused)
        llm = LLM(str(d), dtype="float64", skip_tokenizer_init=True, max_num_batched_tokens=16, max_model_len=64)
        got = []
        real = llm.engine.runner.execute
        llm.engine.runner.execute = lambda s, _r=real, _g=got: _g.append(_r(s)) or _g[-1]
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
        runs.append(torch.cat([g[-1:] for g in got[1:]]))  # the logits of the last prefill chunk, then each decode
        seq = prompt + list(out.outputs[0].token_ids)
        want = ref.logits(seq)[len(prompt) - 1:len(seq) - 1]
        assert len(got) == 2 + 3 and runs[-1].shape == want.shape  # 2 prefill chunks (30 tokens / 16), 3 decodes
        torch.testing.assert_close(runs[-1], want, rtol=1e-9, atol=1e-9)
        if ref.cfg.attn_res_block_size is not None:
            break
    if ref.cfg.attn_res_block_size is None:
        assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("seed", [3, 12])  # (3: two shared experts, SiTU; 12: one shared expert, SiLU, Block AttnRes)
def test_shared_expert_fusion_logits(tmp_path_factory, seed, monkeypatch):
    """k3_forward.SHARED_EXPERT_FUSION: in decode-sized steps the shared experts are experts E.. of the routed pass
    (every token routed to them with weight 1); prefill chunks above SHARED_EXPERT_FUSION_MAX_TOKENS run them apart.
    The logits of both kinds of step equal the reference's (float64), with the fusion on and off; on, the fused
    pass is the one taken (moe_route asked for the shared columns) and the routed weights are a view of the
    routed + shared tensor; the parallel forms (sharded experts) never fuse."""
    import torch

    from k3serve.kernels import ops
    from k3serve.sampling_params import SamplingParams
    from k3serve.workers.engine import k3_forward
    from k3serve.workers.engine.parallel.dp_model import DEPForwardModel
    from k3serve.workers.engine.parallel.layers import ParallelK3ForwardModel
    from k3serve.workers.model.reference import load_reference_model

    assert not ParallelK3ForwardModel.fuses_shared_experts and not DEPForwardModel.fuses_shared_experts
    d = random_model_dir(tmp_path_factory.getbasetemp(), seed)
    ref = load_reference_model(str(d), dtype=torch.float64)
    cfg = ref.cfg
    assert cfg.num_shared_experts and not cfg.routed_expert_hidden_size
    prompt = random_prompts(seed + 200, 1, cfg.vocab_size, 30, 30)[0]
    monkeypatch.setattr(k3_forward, "SHARED_EXPERT_FUSION_MAX_TOKENS", 8)  # the 16-token chunks run apart
    real_route = ops.moe_route
    for fusion in (True, False):
        monkeypatch.setattr(k3_forward, "SHARED_EXPERT_FUSION", fusion)
        shared_cols = []
        monkeypatch.setattr(ops, "moe_route", lambda *a, _r=real_route, _c=shared_cols, **k: _c.append(
            k.get("shared_experts", 0)) or _r(*a, **k))
        llm = LLM(str(d), dtype="float64", skip_tokenizer_init=True, max_num_batched_tokens=16, max_model_len=64)
        model = llm.engine.runner.model
        moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
        assert sorted(model.shared_fused) == (moe_layers if fusion else [])
        for i in model.shared_fused:
            full, routed = model.shared_fused[i]["experts.w13"], model.w[f"model.layers.{i}.block_sparse_moe.experts.w13"]
            assert full.shape[0] == cfg.num_experts + cfg.num_shared_experts
            assert routed.shape[0] == cfg.num_experts and routed.data_ptr() == full.data_ptr()
        got = []
        real = llm.engine.runner.execute
        llm.engine.runner.execute = lambda s, _r=real, _g=got: _g.append(_r(s)) or _g[-1]
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
        seq = prompt + list(out.outputs[0].token_ids)
        want = ref.logits(seq)[len(prompt) - 1:len(seq) - 1]
        torch.testing.assert_close(torch.cat([g[-1:] for g in got[1:]]), want, rtol=1e-9, atol=1e-9)
        per_layer = len(moe_layers)
        # 2 prefill chunks of 15-16 tokens (apart), then 3 decode steps (fused when on)
        assert shared_cols == [0] * 2 * per_layer + [cfg.num_shared_experts if fusion else 0] * 3 * per_layer
