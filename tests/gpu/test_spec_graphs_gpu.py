"""Speculative decoding on CUDA without host stalls (workers/engine/spec/): greedy speculation on CUDA emits the
reference's tokens with the decode, verify and drafter graphs engaged, and the MTP drafter's graph-replayed
fixed-shape steps (spec/mtp_graphs.py) draft what the eager drafter drafts.

float32 (tests/gpu/test_engine_gpu.py explains why not float64) on the demo model (models/k3-demo-stdlib, in the
tree: it has an MTP layer and a kernel for every op, so its decode and verify steps are capturable; the first
random config with an MTP layer has an op whose CUDA path synchronizes, and graphs switch off there: first device
run, see docs/speculative-decoding.md). The tokens are checked by teacher forcing against the float64 reference;
the drafts against the eager drafter run on the same engine states (same kernels, no graphs).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from k3serve.sampling_params import SamplingParams  # noqa: E402
from k3serve.workers.llm import LLM  # noqa: E402
from k3serve.workers.model.config import K3Config  # noqa: E402

# the checkout's copy (on the GPU host the package is installed elsewhere: paths.DEMO_MODEL_DIR is not there)
DEMO_MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "k3-demo-stdlib"


@pytest.fixture(scope="module")
def model_dir():
    if not (DEMO_MODEL_DIR / "config.json").exists():
        pytest.skip("demo model not in the tree")
    return DEMO_MODEL_DIR


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1)
    motif = [rng.randrange(vocab) for _ in range(5)]
    return [motif * 6, [rng.randrange(vocab) for _ in range(40)]]


MARGIN = 2e-3  # x max |logit| of the row: fp32 rounding (tests/gpu/test_engine_gpu.py)


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_greedy_speculation_on_cuda_keeps_the_tokens_and_replays_graphs(model_dir, method):
    """Every token the speculative engine emits is the float64 reference's argmax at that position, or within
    fp32 rounding of it (teacher forcing over the engine's own output, as tests/gpu/test_engine_gpu.py checks the
    engine without speculation); most are exactly the argmax."""
    from k3serve.workers.model.reference import load_reference_model

    prompts = _prompts(K3Config.from_pretrained(str(model_dir)).vocab_size)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        spec.update(prompt_lookup_min=2, prompt_lookup_max=4)
    llm = LLM(str(model_dir), device="cuda", dtype="float32", skip_tokenizer_init=True, max_num_seqs=4,
              speculative_config=spec)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    ref = load_reference_model(str(model_dir), dtype=torch.float64, device="cuda")
    exact = total = 0
    for p, out in zip(prompts, got):
        assert len(out) == 24
        with torch.no_grad():
            lg = ref.logits(list(p) + list(out[:-1]))[len(p) - 1:].double().cpu()
        for j, tok in enumerate(out):
            gap = float(lg[j].max() - lg[j][tok])
            assert gap <= MARGIN * float(lg[j].abs().max().clamp_min(1.0)), (j, tok, int(lg[j].argmax()), gap)
            exact += int(tok == int(lg[j].argmax()))
            total += 1
    assert exact >= 0.97 * total, f"{exact}/{total} tokens are the reference argmax"
    runner = llm.engine.runner
    stats = llm.engine.stats()
    print(f"{method}: decode graph steps {runner.num_static_decode_steps}, verify graph steps "
          f"{runner.static_verify.num_steps} of {stats['spec_decode_num_drafts']} verify steps, "
          f"accepted {stats['spec_decode_num_accepted_tokens']} of {stats['spec_decode_num_draft_tokens']}")
    assert runner.static_verify.enabled, "verify graphs switched off (see the warning)"
    assert runner.static_verify.num_steps > 0
    if method == "mtp":
        prop = llm.engine.proposer
        assert prop.use_graphs and prop.num_replays > 0, "drafter graphs switched off (see the warning)"
        # the decode graphs stay on with the MTP drafter: max_tokens=2 leaves no room for drafts after the first
        # token, so that step is a plain decode alone (the requests above may never have had a decode-only step)
        llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        assert runner.num_static_decode_steps > 0


def test_graph_drafts_equal_eager_drafts(model_dir):
    """The same engine drafts with its graph drafter and, on the same observed states, with the eager one."""
    from k3serve.workers.engine.spec.proposers import MTPProposer

    prompts = _prompts(K3Config.from_pretrained(str(model_dir)).vocab_size)
    k = 3
    llm = LLM(str(model_dir), device="cuda", dtype="float32", skip_tokenizer_init=True, max_num_seqs=4,
              speculative_config={"method": "mtp", "num_speculative_tokens": k})
    llm.engine.fused_spec_step = False  # observe + propose after each step (the one-wait step: test_spec_fused_gpu)
    graph = llm.engine.proposer
    eager = MTPProposer(graph.cfg, llm.engine.runner.model.w, graph.dtype, k)
    pairs = []
    obs, prop = graph.observe_batch, graph.propose_batch

    def observe_both(items):
        eager.observe_batch(items)
        return obs(items)

    def propose_both(reqs):
        d = prop(reqs)
        pairs.append((d, eager.propose_batch(reqs)))
        return d

    graph.observe_batch, graph.propose_batch = observe_both, propose_both
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert graph.num_replays > 0
    n = sum(len(a) for a, _b in pairs)
    same = sum(x == y for a, b in pairs for x, y in zip(a, b))
    assert n > 0 and same >= 0.9 * n, pairs
