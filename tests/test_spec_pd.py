"""Speculative decoding under P/D: a prefill worker WITHOUT speculation and a decode worker WITH it (MTP,
either rollback scheme) stay compatible — speculation-only state (the spec KDA blocks, the MTP layer's latent
cache) is outside the page layout NIXL exchanges. Real `k3serve worker --role prefill|decode` processes,
NIXL (UCX over shared memory) between them, float64 random model with an (untrained) MTP layer: the
decode side pulls the prompt's pages, recomputes the last prompt token, drafts and verifies; greedy tokens
must equal the plain reference forward. The decode worker's /metrics shows the vllm:spec_decode_* counters.
"""

from __future__ import annotations

import json
import random

import httpx
import pytest

from tests._engine_helpers import random_model_dir, reference_outputs
from tests._pd_hops import pd
from tests._workers import _metric, _start, worker_group

SEED = 0  # a random config with one MTP layer (workers/model/testing.py)


@pytest.fixture(scope="module", params=["multi_slot", "recover_ssm"])
def pair(tmp_path_factory, request):
    d = random_model_dir(tmp_path_factory.mktemp("spec-pd"), SEED)
    cache = ["--enable-prefix-caching", "--prefix-cache-retention-interval", "dense"]
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 3, "rollback": request.param})
    procs = {"P": _start(d, "prefill", "--block-size", "16", *cache),
             "D": _start(d, "decode", "--block-size", "32", "--speculative-config", spec, *cache,
                         env_extra={"K3SERVE_KV_POISON_FREE_PAGES": "1"})}
    with worker_group(procs, stop_timeout=10) as out:
        yield d, out


def test_prefill_without_and_decode_with_speculation(pair):
    d, w = pair
    from k3serve.workers.model.testing import random_config

    vocab = random_config(SEED).vocab_size
    rng = random.Random(3)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 17, 40, 70)]
    max_new = 10
    want = reference_outputs(d, prompts, max_new)
    for i, prompt in enumerate(prompts):
        toks, res = pd(w["P"], w["D"], f"s{i}", prompt, max_new)
        assert toks == want[i], res
        assert res["outcome"] == "pulled", res
    text = httpx.get(w["D"].murl + "/metrics", timeout=10).text
    assert _metric(text, "vllm:spec_decode_num_draft_tokens_total") > 0
    assert _metric(text, "vllm:spec_decode_num_drafts_total") > 0
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in text
    prefill_metrics = httpx.get(w["P"].murl + "/metrics", timeout=10).text
    assert _metric(prefill_metrics, "vllm:spec_decode_num_draft_tokens_total") == 0
