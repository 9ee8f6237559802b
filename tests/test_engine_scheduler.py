"""Scheduler policy without a model: budgets, chunking, FCFS, preemption order, speculative reserve."""

from types import SimpleNamespace

import torch

from k3serve.sampling_params import SamplingParams
from k3serve.workers.engine.cache_layout import plan_cache_layout
from k3serve.workers.engine.kv_cache.block_pool import BlockPool
from k3serve.workers.engine.kv_cache.coordinator import KVCacheCoordinator
from k3serve.workers.engine.request import Request, RequestStatus
from k3serve.workers.engine.scheduler import Scheduler, token_budget


def _setup(num_blocks=64, budget=16, max_seqs=4):
    cfg = SimpleNamespace(kda_layer_ids=[0, 1, 2], mla_layer_ids=[3], kv_lora_rank=16, qk_rope_head_dim=8,
                          kda_num_heads=1, kda_head_dim=8, conv_kernel_size=4)
    lay = plan_cache_layout(cfg, torch.float32, block_size=4)
    kv = KVCacheCoordinator(lay, BlockPool(num_blocks, block_size=4))
    return Scheduler(kv, max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=64)


def _req(rid, n):
    return Request(rid, rid, 0, list(range(1, n + 1)), SamplingParams(max_tokens=100), None)


def _sample_all(s, out):
    s.end_step()
    s.update_from_output(out, {c.request_id: 7 for c in out.chunks if c.sample})


def test_chunked_prefill_respects_budget_and_mixes_decodes():
    s = _setup(budget=10)
    a, b = _req("a", 6), _req("b", 23)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [(c.request_id, c.start, len(c.token_ids)) for c in out.chunks] == [("a", 0, 6), ("b", 0, 4)]
    assert out.chunks[0].sample and not out.chunks[1].sample
    _sample_all(s, out)
    out = s.schedule()  # a decodes (1 token) while b continues its prefill (9 tokens)
    assert [(c.request_id, c.start, len(c.token_ids)) for c in out.chunks] == [("a", 6, 1), ("b", 4, 9)]
    assert out.num_tokens <= 10


def test_max_num_seqs_and_fcfs():
    s = _setup(budget=64, max_seqs=2)
    reqs = [_req(f"r{i}", 3) for i in range(4)]
    for r in reqs:
        s.add(r)
    out = s.schedule()
    assert [c.request_id for c in out.chunks] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2", "r3"]


def test_preemption_takes_the_newest_and_recomputes():
    # pool: 1 null + 12 usable; each request holds 3 KDA pages + ceil(len/4) MLA pages
    s = _setup(num_blocks=13, budget=64, max_seqs=4)
    a, b = _req("a", 8), _req("b", 8)
    s.add(a)
    s.add(b)
    out = s.schedule()  # a: 2+3 pages, b: 2+3 pages -> 10 used, 2 free
    assert len(out.chunks) == 2
    for _ in range(6):
        _sample_all(s, out)
        out = s.schedule()
        if out.preempted:
            break
    assert out.preempted == ["b"]  # the most recent arrival goes back to waiting
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and s.waiting[0] is b
    assert b.prefill_end == b.num_tokens  # its outputs are recomputed as part of the prompt


def test_token_budget_reserves_spec_slots_for_running_decodes_only():
    dec, pre = _req("d", 5), _req("p", 50)
    dec.num_computed_tokens = 5
    dec.append_output(1)  # decoding: computed == prefill_end
    pre.num_computed_tokens = 10  # still prefilling
    assert token_budget(100, [dec, pre], num_spec_tokens=3) == 97
    assert token_budget(100, [pre], num_spec_tokens=3) == 100
    assert token_budget(100, [], num_spec_tokens=3) == 100
