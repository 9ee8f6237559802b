"""The one-wait greedy MTP step on CUDA (workers/engine/llm_engine.py `_fused_spec`, workers/engine/spec/mtp_graphs.py
`verify_and_draft`: acceptance, observe and the next drafts in ONE graph replay after the verify graph, one
device->host copy) against the two-wait step (host acceptance, then the observe and draft replays), same engine
settings, float32, the demo model: the same tokens and the same drafts at every step, the fused graph replayed."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from k3serve.sampling_params import SamplingParams  # noqa: E402
from k3serve.workers.llm import LLM  # noqa: E402
from k3serve.workers.model.config import K3Config  # noqa: E402

DEMO_MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "k3-demo-stdlib"


@pytest.mark.parametrize("batch", [1, 3])
def test_one_wait_step_equals_two_wait_step_on_cuda(batch):
    if not (DEMO_MODEL_DIR / "config.json").exists():
        pytest.skip("demo model not in the tree")
    vocab = K3Config.from_pretrained(str(DEMO_MODEL_DIR)).vocab_size
    rng = random.Random(3)
    motif = [rng.randrange(vocab) for _ in range(6)]
    prompts = [motif * 5, [rng.randrange(vocab) for _ in range(40)], motif * 2 + [rng.randrange(vocab)] * 8][
        :batch
    ]
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    got = []
    for fused in (False, True):
        llm = LLM(
            str(DEMO_MODEL_DIR),
            device="cuda",
            dtype="float32",
            skip_tokenizer_init=True,
            max_num_seqs=4,
            speculative_config={"method": "mtp", "num_speculative_tokens": 3},
        )
        eng = llm.engine
        eng.fused_spec_step = fused
        steps: list[dict] = []
        execute = eng.runner.execute

        def record(sched, execute=execute, steps=steps):
            steps.append({rid: list(d) for rid, d in sched.spec_token_ids.items()})
            return execute(sched)

        eng.runner.execute = record
        calls = [0]
        vd = eng.proposer.verify_and_draft

        def counted(*a, vd=vd, calls=calls):
            calls[0] += 1
            return vd(*a)

        eng.proposer.verify_and_draft = counted
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        prop = eng.proposer
        assert prop.use_graphs and eng.runner.static_verify.enabled
        if fused:
            assert calls[0] > 0 and ("fused", 1 if batch == 1 else 4) in prop.graphs
        else:
            assert calls[0] == 0
        st = eng.stats()
        print(
            f"fused={fused}: {calls[0]} one-wait steps, accepted {st['spec_decode_num_accepted_tokens']} of "
            f"{st['spec_decode_num_draft_tokens']}, {prop.num_replays} drafter replays"
        )
        got.append((out, steps))
    assert got[1][0] == got[0][0]
    assert got[1][1] == got[0][1]  # the same drafts at every step
