"""Which drafter the engine builds (workers/engine/spec/proposers.py `proposer_form`): the CUDA-graph MTP drafter
(workers/engine/spec/mtp_graphs.py) only on CUDA and only without --enforce-eager; the engine passes its
enforce_eager to the selection."""

from __future__ import annotations

import pytest
from _engine_helpers import random_model_dir

from k3serve.workers.engine.spec import proposers
from k3serve.workers.llm import LLM
from k3serve.workers.model.testing import random_config

MTP_SEED = next(s for s in range(40) if random_config(s).num_nextn_predict_layers > 0)


@pytest.mark.parametrize("method, device, enforce_eager, form", [
    ("mtp", "cuda", False, "graph"),
    ("mtp", "cuda", True, "eager"),
    ("mtp", "cpu", False, "eager"),
    ("mtp", "cpu", True, "eager"),
    ("ngram", "cuda", False, "ngram"),
    ("ngram", "cuda", True, "ngram"),
    ("ngram", "cpu", False, "ngram"),
])
def test_proposer_form(method, device, enforce_eager, form):
    assert proposers.proposer_form(method, device, enforce_eager) == form


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_engine_passes_enforce_eager_to_the_drafter(tmp_path_factory, monkeypatch, enforce_eager):
    seen = []
    real = proposers.proposer_form

    def spy(method, device_type, eager):
        seen.append((method, device_type, eager))
        return real(method, device_type, eager)

    monkeypatch.setattr(proposers, "proposer_form", spy)
    d = random_model_dir(tmp_path_factory.mktemp("form"), MTP_SEED)
    llm = LLM(str(d), dtype="float64", skip_tokenizer_init=True, enforce_eager=enforce_eager,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert seen == [("mtp", "cpu", enforce_eager)]
    assert type(llm.engine.proposer) is proposers.MTPProposer  # the CPU drafter: eager either way
