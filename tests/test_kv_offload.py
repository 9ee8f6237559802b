"""The host-memory offload tier (workers/engine/kv_connector/host_offload.py): offload on == off ==
reference (float64, random configs, multi-turn sessions, chunked prefill, a device budget that forces
evictions), hits proven through the stats/metrics, bad budgets, a failing tier, no leaked page."""

from __future__ import annotations

import random

import pytest
from _engine_helpers import random_model_dir, reference_outputs, tight_kv_budget

from k3serve.sampling_params import SamplingParams
from k3serve.workers.llm import LLM
from k3serve.workers.model.config import K3Config

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def _pair(model_dir, max_len, block, unit, extra, offload=64 << 20, **kw):
    budget = tight_kv_budget(model_dir, max_len, extra_blocks=extra, block_size=block, enable_prefix_caching=True)
    common = dict(dtype="float64", skip_tokenizer_init=True, max_model_len=max_len, max_num_batched_tokens=24,
                  max_num_seqs=6, block_size=block, enable_prefix_caching=True, kv_cache_memory=budget,
                  prefix_match_unit=unit, **kw)
    return LLM(str(model_dir), kv_offload_memory=offload, **common), LLM(str(model_dir), **common)


def _sessions(on, off, vocab, seed, sessions=6, turns=4):
    """Multi-turn sessions sharing a system prefix; each turn replays the previous prompt + output."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(rng.randint(20, 36))]
    convs = [system + [rng.randrange(vocab) for _ in range(rng.randint(1, 10))] for _ in range(sessions)]
    for _ in range(turns):
        a = [o.outputs[0].token_ids for o in on.generate(convs, GREEDY)]
        b = [o.outputs[0].token_ids for o in off.generate(convs, GREEDY)]
        assert a == b
        last = convs
        convs = [c + o + [rng.randrange(vocab) for _ in range(rng.randint(1, 8))] for c, o in zip(convs, a)]
    return last, a


def _assert_all_pages_back(eng):
    assert eng.pool.num_free == eng.pool.num_usable
    assert all(b.ref_cnt == 0 for b in eng.pool.blocks)
    assert eng.kv_manager.reqs == {}
    host = eng.connector.scheduler.children[0].host
    assert all(b.ref_cnt == 0 for b in host.blocks), "a host slot stayed pinned"


@pytest.mark.parametrize("seed,block,unit,eviction", [(5, 8, 4, "lru"), (9, 16, 8, "compute-per-byte")])
def test_offload_on_equals_off_equals_reference(tmp_path_factory, seed, block, unit, eviction):
    d = random_model_dir(tmp_path_factory.getbasetemp(), seed)
    vocab = K3Config.from_pretrained(str(d)).vocab_size
    on, off = _pair(d, 160, block, unit, extra=10, prefix_cache_eviction=eviction)
    prompts, outs = _sessions(on, off, vocab, seed)
    assert outs == reference_outputs(d, prompts, GREEDY.max_tokens)
    so, sf = on.engine.stats(), off.engine.stats()
    assert on.engine.pool.num_evicted > 0, "the device budget was meant to force evictions"
    assert so["kv_offload_stored_blocks"] > 0 and so["kv_offload_stored_bytes"] > 0
    assert so["kv_offload_hit_tokens"] > 0, "the tier was meant to serve hits"
    assert so["kv_offload_loaded_bytes"] > 0
    assert so["prefill_tokens_computed"] < sf["prefill_tokens_computed"]
    _assert_all_pages_back(on.engine)


def test_offload_with_a_tiny_host_budget_evicts_there_too(tiny_model_dir):
    layout_bytes = LLM(str(tiny_model_dir), dtype="float64", skip_tokenizer_init=True, max_model_len=128,
                       block_size=16).engine.layout.bytes_per_block
    on, off = _pair(tiny_model_dir, 128, 16, 8, extra=8, offload=6 * layout_bytes)
    _sessions(on, off, 576, seed=3, sessions=5, turns=3)
    st = on.engine.stats()
    assert st["kv_offload_evictions"] > 0 and 0 < st["kv_offload_usage"] <= 1
    _assert_all_pages_back(on.engine)


def test_failing_tier_loads_recompute_and_lose_nothing(tiny_model_dir):
    on, off = _pair(tiny_model_dir, 128, 16, 8, extra=8)
    rng = random.Random(1)
    system = [rng.randrange(576) for _ in range(30)]
    convs = [system + [rng.randrange(576) for _ in range(rng.randint(1, 8))] for _ in range(5)]
    worker = on.engine.connector.worker.children[0]
    for turn in range(3):
        worker.fail_next_loads = 10**6 if turn == 2 else 0  # the last turn: every tier load fails
        a = [o.outputs[0].token_ids for o in on.generate(convs, GREEDY)]
        b = [o.outputs[0].token_ids for o in off.generate(convs, GREEDY)]
        assert a == b
        convs = [c + o + [rng.randrange(576) for _ in range(5)] for c, o in zip(convs, a)]
    st = on.engine.stats()
    assert st["kv_offload_failed_loads"] > 0 and st["kv_load_failures"] == st["kv_offload_failed_loads"]
    _assert_all_pages_back(on.engine)


def test_offload_budget_errors(tiny_model_dir):
    common = dict(dtype="float64", skip_tokenizer_init=True, max_model_len=64, block_size=16)
    per = LLM(str(tiny_model_dir), **common).engine.layout.bytes_per_block
    with pytest.raises(ValueError, match=rf"kv_offload_memory: .*smaller than one page; the minimum is {per} bytes"):
        LLM(str(tiny_model_dir), enable_prefix_caching=True, kv_offload_memory=per - 1, **common)
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        LLM(str(tiny_model_dir), kv_offload_memory=8 << 20, **common)


def test_offload_metrics_reach_the_catalog(tiny_model_dir):
    from prometheus_client import CollectorRegistry, generate_latest

    from k3serve.workers.metrics import EngineMetrics

    on, off = _pair(tiny_model_dir, 128, 16, 8, extra=8)
    _sessions(on, off, 576, seed=4, sessions=5, turns=3)
    st = on.engine.stats()
    reg = CollectorRegistry()
    m = EngineMetrics(reg, "k3")
    m.on_stats(st)
    text = generate_latest(reg).decode()
    scraped = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
               if line.startswith("k3serve_kv_offload_")}
    for metric, key in (("hit_tokens_total", "kv_offload_hit_tokens"), ("stored_bytes_total", "kv_offload_stored_bytes"),
                        ("loaded_bytes_total", "kv_offload_loaded_bytes"), ("stored_pages_total", "kv_offload_stored_blocks"),
                        ("usage_perc", "kv_offload_usage")):
        assert scraped[f'k3serve_kv_offload_{metric}{{model_name="k3"}}'] == pytest.approx(float(st[key])), metric
    assert st["kv_offload_hit_tokens"] > 0
