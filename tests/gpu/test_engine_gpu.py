"""The engine end to end on a CUDA GPU: Triton kernels, CUDA-graph decode, chunked prefill, prefix caching
and preemption, checked against the float64 reference forward (no caches).

float64 is CPU-only (the kernels are fp32/bf16), so exact token equality is not the criterion here. Instead
every generated token is checked by teacher forcing: the reference runs the engine's own output, and at
each position the token the engine picked must be the reference's argmax or within a small margin of it
(a near tie that rounding may flip). Most tokens must be exactly the reference's argmax.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from k3serve.sampling_params import SamplingParams  # noqa: E402
from k3serve.workers.llm import LLM  # noqa: E402
from k3serve.workers.model.reference import load_reference_model  # noqa: E402
from k3serve.workers.model.testing import write_random_model  # noqa: E402

MARGIN = 2e-3  # x max |logit| of the row: fp32 rounding
EXACT = {"float32": 0.97, "bfloat16": 0.75}


def prompts_for(seed: int, n: int, vocab: int, shared: int = 0, hi: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(shared)]
    return [prefix + [rng.randrange(vocab) for _ in range(rng.randint(1, hi))] for _ in range(n)]


def teacher_forced_check(ref, prompts, outs, noise_ref=None) -> tuple[int, int]:
    """Asserts every engine token is (near) the float64 reference's argmax; returns (exact, total).

    fp32 engines: within MARGIN x the row's largest |logit|. bf16 engines: the allowed gap at a position is
    3x the error the plain reference forward itself makes there when run in bf16 (`noise_ref`: max over the
    vocabulary of |bf16 reference logits - float64 reference logits|), plus the fp32 margin: tokens whose
    logits are closer than bf16's own rounding noise may legitimately come out either way."""
    exact = total = 0
    for p, out in zip(prompts, outs, strict=True):
        assert len(out) > 0
        seq = list(p) + list(out[:-1])
        with torch.no_grad():
            lg = ref.logits(seq)[len(p) - 1:].double().cpu()
            noise = None
            if noise_ref is not None:
                noise = (noise_ref.logits(seq)[len(p) - 1:].double().cpu() - lg).abs().amax(-1)
        for j, tok in enumerate(out):
            row = lg[j]
            gap = float(row.max() - row[tok])
            scale = float(row.abs().max().clamp_min(1.0))
            allowed = MARGIN * scale + (3 * float(noise[j]) if noise is not None else 0.0)
            assert gap <= allowed, (
                f"position {j} of a {len(p)}-token prompt: engine token {tok} is {gap:.4g} below the reference "
                f"argmax {int(row.argmax())} (allowed {allowed:.3g}, scale {scale:.3g})")
            exact += int(tok == int(row.argmax()))
            total += 1
    return exact, total


def run_engine(model_dir, prompts, max_new, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model_dir), device="cuda", skip_tokenizer_init=True, **kw)
    sp = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    return outs, llm


@pytest.fixture(scope="module")
def tiny_ref(tiny_model_dir):
    return load_reference_model(str(tiny_model_dir), dtype=torch.float64, device="cuda")


@pytest.mark.parametrize("dtype,graphs", [("float32", True), ("float32", False), ("bfloat16", True)])
def test_tiny_engine_on_cuda(tiny_model_dir, tiny_ref, dtype, graphs):
    prompts = prompts_for(1 + graphs, 12, tiny_ref.cfg.vocab_size)
    outs, llm = run_engine(tiny_model_dir, prompts, 24, dtype=dtype, max_num_seqs=8,
                           max_num_batched_tokens=160, enforce_eager=not graphs)
    runner = llm.engine.runner
    if graphs:  # every decode-only step replayed a captured graph (the tiny model has kernels for every op)
        assert runner.static_decode and runner.graphs and runner.num_static_decode_steps > 0
    else:
        assert not runner.graphs and runner.num_static_decode_steps == 0
    noise_ref = None
    if dtype == "bfloat16":
        noise_ref = load_reference_model(str(tiny_model_dir), dtype=torch.bfloat16, device="cuda")
    exact, total = teacher_forced_check(tiny_ref, prompts, outs, noise_ref)
    assert exact >= EXACT[dtype] * total, f"{exact}/{total} tokens are the reference argmax"


def test_tiny_engine_bf16_prefill_kernels(tiny_model_dir, tiny_ref, monkeypatch):
    """bf16 prompts long enough for the prefill-shaped kernels: the MoE "dense" variant (experts decoded once) and
    the MLA prefill kernel (tokens x heads per program) both run, and every token passes the teacher-forced check
    against the float64 reference."""
    from k3serve.kernels.triton import mla_decode, moe

    calls = {"dense": 0, "mla_prefill": 0}
    real_dense, real_mla = moe.mxfp4_to_dense, mla_decode._mla_prefill_kernel

    def dense(*a, **k):
        calls["dense"] += 1
        return real_dense(*a, **k)

    class MLA:
        def __getitem__(self, grid):
            calls["mla_prefill"] += 1
            return real_mla[grid]

    monkeypatch.setattr(moe, "mxfp4_to_dense", dense)
    monkeypatch.setattr(mla_decode, "_mla_prefill_kernel", MLA())
    prompts = [p + [7] * 300 for p in prompts_for(5, 4, tiny_ref.cfg.vocab_size, hi=200)]
    outs, _ = run_engine(tiny_model_dir, prompts, 12, dtype="bfloat16", max_num_seqs=8)
    assert calls["dense"] > 0 and calls["mla_prefill"] > 0, calls
    noise_ref = load_reference_model(str(tiny_model_dir), dtype=torch.bfloat16, device="cuda")
    exact, total = teacher_forced_check(tiny_ref, prompts, outs, noise_ref)
    assert exact >= EXACT["bfloat16"] * total, f"{exact}/{total} tokens are the reference argmax"


def test_tiny_engine_cuda_prefix_cache_and_preemption(tiny_model_dir, tiny_ref):
    """Multi-turn sessions sharing a long prefix, prefix caching on (dense retention), a pool barely above
    one request's minimum with 32-token pages (preemption by recompute), chunked prefill of 96 tokens."""
    vocab = tiny_ref.cfg.vocab_size
    first = prompts_for(3, 6, vocab, shared=300, hi=120)
    llm = LLM(str(tiny_model_dir), device="cuda", dtype="float32", skip_tokenizer_init=True, max_num_seqs=6,
              max_num_batched_tokens=96, max_model_len=1024, block_size=32,
              enable_prefix_caching=True, prefix_cache_retention_interval="dense")
    eng = llm.engine
    per_block = eng.layout.bytes_per_block
    del llm
    torch.cuda.empty_cache()
    budget = (eng.layout.min_blocks_for(1024, True) + 1) * per_block
    llm = LLM(str(tiny_model_dir), device="cuda", dtype="float32", skip_tokenizer_init=True, max_num_seqs=6,
              max_num_batched_tokens=96, max_model_len=1024, block_size=32,
              enable_prefix_caching=True, prefix_cache_retention_interval="dense", kv_cache_memory=budget)
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    rng = random.Random(5)
    prompts, outs = first, []
    for _turn in range(3):
        res = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        exact, total = teacher_forced_check(tiny_ref, prompts, res)
        assert exact >= EXACT["float32"] * total
        outs.append(res)
        prompts = [p + r + [rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for p, r in zip(prompts, res)]
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] > 0, stats
    assert stats.get("num_preemptions", 0) > 0, stats


@pytest.mark.parametrize("seed", [11, 12])
def test_random_config_engine_on_cuda(tmp_path, seed):
    """Random architectures: kernels where the shapes allow, reference ops elsewhere; CUDA graphs are used
    only when the decode step never waits for the host (else the runner falls back to eager decode)."""
    d = tmp_path / f"m{seed}"
    write_random_model(d, seed=seed, dtype=torch.float32)
    ref = load_reference_model(str(d), dtype=torch.float64, device="cuda")
    prompts = prompts_for(seed, 8, ref.cfg.vocab_size, hi=120)
    outs, llm = run_engine(d, prompts, 16, dtype="float32", max_num_seqs=8, max_num_batched_tokens=64)
    exact, total = teacher_forced_check(ref, prompts, outs)
    assert exact >= EXACT["float32"] * total
    print(f"seed {seed}: graphs {sorted(llm.engine.runner.graphs)} static={llm.engine.runner.static_decode}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_greedy_ids_are_the_samplers(tiny_model_dir, tiny_ref, dtype):
    """The argmax captured in the decode graph (model_runner.GRAPH_GREEDY) is, on every replayed step, the token
    the sampler picks from the same step's logits; the engine took those ids on every graph-replayed step."""
    from k3serve.workers.sampler import Sampler, SamplingState

    prompts = prompts_for(7, 6, tiny_ref.cfg.vocab_size, hi=120)
    llm = LLM(str(tiny_model_dir), device="cuda", skip_tokenizer_init=True, dtype=dtype, max_num_seqs=8,
              max_num_batched_tokens=1024)
    runner = llm.engine.runner
    sampler, checked = Sampler(0), []
    real = runner.take_greedy_ids

    def take(n):
        got = real(n)
        if got is not None:  # a graph-replayed step (the prefill step has no ids: the engine samples it)
            logits = runner.graphs[next(c for c in runner.capture_sizes if c >= n)].logits[:n]
            states = [SamplingState.new(SamplingParams(temperature=0.0), [1]) for _ in range(n)]
            checked.append(got == sampler(logits, states).token_ids)
        return got

    runner.take_greedy_ids = take
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert checked and all(checked), f"{checked.count(False)} of {len(checked)} steps differ"
    assert runner.num_greedy_steps == runner.num_static_decode_steps == len(checked) >= 11
    if dtype == "float32":
        exact, total = teacher_forced_check(tiny_ref, prompts, outs)
        assert exact >= EXACT[dtype] * total


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gate_sigmoid_16bit_on_cuda(dtype):
    """k3_forward.GATE_SIGMOID_16BIT on CUDA: torch.sigmoid on 16-bit values == sigmoid(fp32).to(16-bit), every
    value (the MLA output gate takes the one-kernel form on that)."""
    from types import SimpleNamespace

    from k3serve.workers.engine.k3_forward import K3ForwardModel

    g = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype).cuda()
    got = K3ForwardModel._gate_sigmoid(SimpleNamespace(acc=torch.float32), g, dtype)
    want = torch.sigmoid(g.float()).to(dtype)
    same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
    assert bool(same.all()), f"{int((~same).sum())} values differ"


def test_decodes_beside_a_short_prefill_tail(tiny_model_dir, tiny_ref, monkeypatch):
    """11 requests decode while a 12th prefills its last 10 tokens (budget 64: 55 + 9, then 11 + 53, then 11 + 10):
    that step holds 21 tokens for 12 sequences, at most 2 a sequence on average, and one longer than kda_verify's
    walk, so the chunked-KDA dispatcher takes its token-serial form with the engine's host lists beside (it once
    failed there with an unexpected keyword). Every token passes the teacher-forced check."""
    from k3serve.kernels import triton_ops

    serial = []
    real = triton_ops._kr.kda_recurrent_triton
    monkeypatch.setattr(triton_ops._kr, "kda_recurrent_triton",
                        lambda *a, **k: serial.append(a[0].shape[0]) or real(*a, **k))
    rng = random.Random(13)
    vocab = tiny_ref.cfg.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(5)] for _ in range(11)] + [[rng.randrange(vocab) for _ in range(72)]]
    outs, _ = run_engine(tiny_model_dir, prompts, 8, dtype="float32", max_num_seqs=12, max_num_batched_tokens=64)
    assert 21 in serial, serial  # (the same schedule on the CPU calls kernels/cpu's kda_chunked with 21 tokens)
    exact, total = teacher_forced_check(tiny_ref, prompts, outs)
    assert exact >= EXACT["float32"] * total


@pytest.mark.parametrize("seed", [21, 22])
def test_fused_add_norm_same_tokens(tmp_path, monkeypatch, seed):
    """A plain residual stack (no Block AttnRes) in bf16 with CUDA graphs: the fused add + norm
    (k3_forward.FUSED_ADD_NORM) gives the same greedy tokens as the add and the norm apart (bit-identical sums and
    norms), and it is the one the forward calls."""
    from k3serve.kernels.triton import pointwise as P
    from k3serve.workers.engine import k3_forward
    from k3serve.workers.model.config import K3Config
    from k3serve.workers.model.testing import random_text_config

    d = tmp_path / f"m{seed}"
    text = random_text_config(seed)
    text["attn_res_block_size"] = None
    write_random_model(d, seed=seed, cfg=K3Config.from_dict(text), dtype=torch.float32)
    ref = load_reference_model(str(d), dtype=torch.float64, device="cuda")
    assert ref.cfg.attn_res_block_size is None
    prompts = prompts_for(seed, 6, ref.cfg.vocab_size, hi=100)
    calls = []
    real = P.add_rms_norm_triton
    monkeypatch.setattr(P, "add_rms_norm_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    fused, _ = run_engine(d, prompts, 12, dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=256)
    assert calls
    monkeypatch.setattr(k3_forward, "FUSED_ADD_NORM", False)
    apart, _ = run_engine(d, prompts, 12, dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=256)
    assert fused == apart


@pytest.mark.parametrize("seed", [3, 12])  # unpacked experts, no latent: 3 has two shared experts, 12 one
def test_shared_expert_fusion_on_cuda(tmp_path, monkeypatch, seed):
    """k3_forward.SHARED_EXPERT_FUSION on CUDA (the route kernel's appended columns, the expert kernels with the
    shared experts as experts E..), float32 with CUDA graphs: the fused model is the one built, its decode steps
    replay graphs, and its greedy tokens are the float64 reference's (teacher-forced)."""
    from k3serve.workers.engine import k3_forward

    d = tmp_path / f"m{seed}"
    write_random_model(d, seed=seed, dtype=torch.float32)
    ref = load_reference_model(str(d), dtype=torch.float64, device="cuda")
    assert ref.cfg.num_shared_experts and not ref.cfg.routed_expert_hidden_size and not ref.cfg.experts_mxfp4
    prompts = prompts_for(seed, 8, ref.cfg.vocab_size, hi=120)
    monkeypatch.setattr(k3_forward, "SHARED_EXPERT_FUSION", True)
    outs, llm = run_engine(d, prompts, 16, dtype="float32", max_num_seqs=8, max_num_batched_tokens=64)
    assert llm.engine.runner.model.shared_fused
    exact, total = teacher_forced_check(ref, prompts, outs)
    assert exact >= EXACT["float32"] * total


def test_shared_expert_fusion_needs_free_memory(tmp_path, monkeypatch):
    """A layer is fused only when its routed + shared copy leaves SHARED_EXPERT_FUSION_HEADROOM free (the loader's
    tensors are alive while the engine is built): with a headroom larger than the card, no layer fuses, and the
    engine still serves the reference's tokens (the shared experts apart)."""
    from k3serve.workers.engine import k3_forward

    d = tmp_path / "m3"
    write_random_model(d, seed=3, dtype=torch.float32)
    ref = load_reference_model(str(d), dtype=torch.float64, device="cuda")
    prompts = prompts_for(3, 4, ref.cfg.vocab_size, hi=60)
    monkeypatch.setattr(k3_forward, "SHARED_EXPERT_FUSION_HEADROOM", 1 << 50)
    outs, llm = run_engine(d, prompts, 8, dtype="float32", max_num_seqs=4, max_num_batched_tokens=64)
    assert llm.engine.runner.model.shared_fused == {}
    exact, total = teacher_forced_check(ref, prompts, outs)
    assert exact >= EXACT["float32"] * total
