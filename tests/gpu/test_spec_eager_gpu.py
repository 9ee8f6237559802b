"""--enforce-eager on CUDA reaches the MTP drafter (workers/engine/spec/proposers.py `proposer_form`): the engine
builds the eager MTPProposer with it and the graph drafter (spec/mtp_graphs.py) without it. The CPU twin of this
is tests/test_spec_proposer_form.py (the selection table and the engine's wiring)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from k3serve.sampling_params import SamplingParams  # noqa: E402
from k3serve.workers.engine.spec.mtp_graphs import GraphMTPProposer  # noqa: E402
from k3serve.workers.engine.spec.proposers import MTPProposer  # noqa: E402
from k3serve.workers.llm import LLM  # noqa: E402

DEMO_MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "k3-demo-stdlib"


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_enforce_eager_picks_the_eager_mtp_drafter(enforce_eager):
    if not (DEMO_MODEL_DIR / "config.json").exists():
        pytest.skip("demo model not in the tree")
    llm = LLM(str(DEMO_MODEL_DIR), device="cuda", dtype="float32", skip_tokenizer_init=True, max_num_seqs=2,
              enforce_eager=enforce_eager, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    prop = llm.engine.proposer
    assert type(prop) is (MTPProposer if enforce_eager else GraphMTPProposer)
    out = llm.generate([[5, 6, 7, 8] * 4], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6
    if not enforce_eager:
        assert prop.num_replays + prop.num_eager > 0  # the graph form drafted (replayed, or eager with a warning)
