"""P/D into a DEP decode worker: a real `k3serve worker --role prefill` (one rank) and a real `k3serve worker
--role decode --data-parallel-size 2 --enable-expert-parallel`, NIXL (UCX over shared memory) between them,
driven over gRPC the way the router does (tests/test_pd_workers.py's hops). Each decode rank pulls its own
requests' pages with its own agent; greedy float64 tokens equal the reference forward for requests on both
ranks (the second arrives while the first decodes, so the spreading rule puts it on rank 1), and every
request's KvTransferResult says "pulled" (rank 1's outcome reaches the gRPC layer through rank 0's ledger)."""

from __future__ import annotations

import random

import pytest

from k3serve.workers.model.testing import random_config
from tests._engine_helpers import random_model_dir, reference_outputs
from tests._pd_hops import decode_while_first_runs, prefill_hop
from tests._workers import _start, worker_group

SEED = 0  # random_config(0): LatentMoE (16 experts, norm, shared experts), AttnRes


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = random_model_dir(tmp_path_factory.mktemp("dp-pd"), SEED)
    cache = ["--enable-prefix-caching", "--prefix-cache-retention-interval", "dense", "--block-size", "16"]
    procs = {"P": _start(d, "prefill", *cache),
             "D": _start(d, "decode", *cache, "--data-parallel-size", "2", "--enable-expert-parallel")}
    with worker_group(procs, stop_timeout=15, expect_clean_exit=True) as out:
        yield d, out


def test_pd_into_dep_decode_pulls_on_both_ranks(pair):
    d, w = pair
    rng = random.Random(SEED)
    vocab = random_config(SEED).vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (37, 21, 50)]
    news = [24, 4, 4]
    want = [reference_outputs(d, [p], n)[0] for p, n in zip(prompts, news)]
    kvps = [prefill_hop(w["P"], f"p{i}", p, n) for i, (p, n) in enumerate(zip(prompts, news))]
    # the later ones arrive while the first one decodes: rank 0 is busier, they go to rank 1 (then by load)
    for i, (toks, res) in enumerate(decode_while_first_runs(w["D"], prompts, news, kvps)):
        assert toks == want[i], (i, res)
        assert res["outcome"] == "pulled", (i, res)
        assert res["pulled_tokens"] + res["local_cached_tokens"] == len(prompts[i]) - 1 and res["bytes"] > 0
