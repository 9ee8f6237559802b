"""Randomized engine workload: mixed sampling, aborts, preemption, prefix caching — no leaks, no hangs."""

from __future__ import annotations

import random

import pytest
from _engine_helpers import tight_kv_budget

from k3serve.sampling_params import SamplingParams
from k3serve.workers.llm import LLM


@pytest.mark.parametrize("offload", [None, 32 << 20], ids=["device-only", "host-tier"])
def test_random_workload_frees_every_page(tiny_model_dir, offload):
    budget = tight_kv_budget(tiny_model_dir, 160, extra_blocks=3, block_size=16, enable_prefix_caching=True)
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=160, block_size=16, max_num_batched_tokens=48,
              max_num_seqs=8, enable_prefix_caching=True, prefix_match_unit=8, kv_cache_memory=budget,
              prefix_cache_retention_interval=32, prefix_cache_selective_retention=True,
              prefix_cache_eviction="compute-per-byte", kv_offload_memory=offload)
    eng = llm.engine
    rng = random.Random(11)
    shared = [rng.randrange(576) for _ in range(40)]
    live: set[str] = set()
    finished = 0
    for i in range(60):
        if rng.random() < 0.7:
            rid = f"s{i}"
            prompt = shared[: rng.randint(0, 40)] + [rng.randrange(576) for _ in range(rng.randint(1, 50))]
            params = SamplingParams(
                n=rng.choice([1, 1, 2]), temperature=rng.choice([0.0, 0.8]), top_k=rng.choice([0, 20]),
                seed=rng.choice([None, i]), max_tokens=rng.randint(1, 40), min_tokens=rng.choice([0, 1]),
                logprobs=rng.choice([None, 2]), presence_penalty=rng.choice([0.0, 0.5]))
            eng.add_request(rid, prompt, params, cache_salt=rng.choice([None, "t1"]))
            live.add(rid)
        if live and rng.random() < 0.15:
            rid = rng.choice(sorted(live))
            for out in eng.abort_request(rid):
                assert out.finished and all(o.finish_reason is not None for o in out.outputs)
            live.discard(rid)
            finished += 1
        for out in eng.step():
            if out.finished:
                assert out.request_id in live
                live.discard(out.request_id)
                finished += 1
                for o in out.outputs:
                    assert o.finish_reason in ("stop", "length")
                    assert len(o.token_ids) <= 40
    steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                live.discard(out.request_id)
                finished += 1
        steps += 1
        assert steps < 2000, "the engine must drain"
    assert not live and finished > 30
    assert eng.scheduler.num_preemptions > 0
    # every page is back: referenced by nobody (cached pages sit in the free queue)
    assert eng.pool.num_free == eng.pool.num_usable
    assert all(b.ref_cnt == 0 for b in eng.pool.blocks)
    assert eng.kv_manager.reqs == {}
    if offload:
        st = eng.stats()
        assert st["kv_offload_stored_blocks"] > 0 and st["kv_offload_hit_tokens"] > 0
        host = eng.connector.scheduler.children[0].host
        assert all(b.ref_cnt == 0 for b in host.blocks), "a host slot stayed pinned"
