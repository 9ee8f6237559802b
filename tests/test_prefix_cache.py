"""Prefix caching for the hybrid cache: equality with caching off, retention, Marconi, salts, events."""

from __future__ import annotations

import random

import pytest
from _engine_helpers import random_model_dir, tight_kv_budget

from k3serve.sampling_params import SamplingParams
from k3serve.workers.llm import LLM

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _gen(llm, prompts, n=4, salt=None):
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, **GREEDY), cache_salt=salt)
    return [o.outputs[0].token_ids for o in outs]


def _conversations(llm_on, llm_off, vocab, seed, sessions=6, turns=4):
    """Multi-turn sessions sharing a system prefix; each turn replays the previous prompt + output."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(rng.randint(20, 40))]
    convs = [system + [rng.randrange(vocab) for _ in range(rng.randint(1, 12))] for _ in range(sessions)]
    for _ in range(turns):
        on = _gen(llm_on, convs)
        off = _gen(llm_off, convs)
        assert on == off
        convs = [c + o + [rng.randrange(vocab) for _ in range(rng.randint(1, 10))] for c, o in zip(convs, on)]


@pytest.mark.parametrize("unit,retention,selective", [(16, 0, False), (4, 0, True), (4, 16, False),
                                                      (8, "dense", True)])
def test_caching_on_equals_off_tiny(tiny_model_dir, unit, retention, selective):
    budget = tight_kv_budget(tiny_model_dir, 256, extra_blocks=14, block_size=16, enable_prefix_caching=True)
    common = dict(dtype="float64", skip_tokenizer_init=True, max_model_len=256, max_num_batched_tokens=40,
                  max_num_seqs=8, block_size=16)
    on = LLM(str(tiny_model_dir), enable_prefix_caching=True, kv_cache_memory=budget, prefix_match_unit=unit,
             prefix_cache_retention_interval=retention, prefix_cache_selective_retention=selective,
             prefix_cache_eviction="compute-per-byte" if selective else "lru", **common)
    off = LLM(str(tiny_model_dir), **common)
    _conversations(on, off, 576, seed=unit + 7)
    st = on.engine.stats()
    assert st["prefix_cache_hits"] > 0, "the workload was meant to hit the cache"
    assert st["prefill_tokens_skipped"] > 0
    assert st["kda_snapshots_stored"] > 0
    assert on.engine.pool.num_evicted > 0, "the small KV budget was meant to force eviction"


def test_caching_on_equals_off_random_config(tmp_path_factory):
    d = random_model_dir(tmp_path_factory.getbasetemp(), 5)
    from k3serve.workers.model.config import K3Config

    vocab = K3Config.from_pretrained(str(d)).vocab_size
    budget = tight_kv_budget(d, 192, extra_blocks=12, block_size=8, enable_prefix_caching=True)
    common = dict(dtype="float64", skip_tokenizer_init=True, max_model_len=192, max_num_batched_tokens=24,
                  max_num_seqs=8, block_size=8)
    on = LLM(str(d), enable_prefix_caching=True, kv_cache_memory=budget, prefix_match_unit=4,
             prefix_cache_selective_retention=True, **common)
    off = LLM(str(d), **common)
    _conversations(on, off, vocab, seed=5)
    assert on.engine.stats()["prefix_cache_hits"] > 0


def _snapshot_lengths(llm) -> set[int]:
    per_group = llm.engine.kv_manager.cached_snapshot_lengths()
    sets = [set(v) for v in per_group.values()]
    assert all(s == sets[0] for s in sets), "every KDA group must hold the same snapshots"
    return sets[0]


def _marconi_run(model_dir, retention, selective):
    """Requests X+a, X+b, X+c with |X| = 48 (units of 8, blocks of 16)."""
    llm = LLM(str(model_dir), dtype="float64", skip_tokenizer_init=True, max_model_len=256, block_size=16,
              enable_prefix_caching=True, prefix_match_unit=8, prefix_cache_retention_interval=retention,
              prefix_cache_selective_retention=selective)
    rng = random.Random(0)
    X = [rng.randrange(576) for _ in range(48)]
    a, b, c = ([rng.randrange(576) for _ in range(n)] for n in (13, 21, 9))
    hits, snaps = [], []
    for suffix in (a, b, c):
        before = llm.engine.stats()["prefix_cache_hits"]
        _gen(llm, [X + suffix], n=2)
        hits.append(llm.engine.stats()["prefix_cache_hits"] - before)
        snaps.append(_snapshot_lengths(llm))
    return hits, snaps


def test_retention_prompt_end_only(tiny_model_dir):
    hits, snaps = _marconi_run(tiny_model_dir, 0, False)
    # prompt-end (replay) boundaries only: floor((|X+a| - 1) / 8) * 8 = 56, then 64 and 56 again
    assert snaps[0] == {56}
    assert snaps[1] == {56, 64}
    assert hits == [0, 0, 0]  # no snapshot lies on X's boundary, so nothing is reusable


def test_retention_marconi_second_hit(tiny_model_dir):
    hits, snaps = _marconi_run(tiny_model_dir, 0, True)
    assert snaps[0] == {56}
    assert 48 in snaps[1]  # B saw X a second time: the junction gets a snapshot
    assert hits[1] == 0 and hits[2] == 48  # ... so C hits the whole shared prefix


def test_retention_interval(tiny_model_dir):
    hits, snaps = _marconi_run(tiny_model_dir, 32, False)
    assert {32, 56} <= snaps[0]
    assert hits[1] == 32 and hits[2] == 32  # the interval snapshot at 32 serves B and C


def test_retention_dense(tiny_model_dir):
    hits, snaps = _marconi_run(tiny_model_dir, "dense", False)
    assert {16, 32, 48} <= snaps[0]  # every block boundary
    assert hits[1] == 48 and hits[2] == 48


def test_cache_salt_isolation(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float64", skip_tokenizer_init=True, max_model_len=256, block_size=16,
              enable_prefix_caching=True, prefix_cache_retention_interval="dense")
    p = list(range(1, 70))
    _gen(llm, [p], salt="tenant-a")
    h0 = llm.engine.stats()["prefix_cache_hits"]
    _gen(llm, [p], salt="tenant-b")
    assert llm.engine.stats()["prefix_cache_hits"] == h0  # different salt: nothing shared
    _gen(llm, [p], salt="tenant-a")
    assert llm.engine.stats()["prefix_cache_hits"] - h0 >= 64  # same salt: hit


def test_event_stream_reconstructs_cache(tiny_model_dir):
    """A subscriber's index (snapshot on subscribe + events) equals the cache after evictions."""
    budget = tight_kv_budget(tiny_model_dir, 128, extra_blocks=10, block_size=16, enable_prefix_caching=True)
    llm = LLM(str(tiny_model_dir), dtype="float64", skip_tokenizer_init=True, max_model_len=128, block_size=16,
              enable_prefix_caching=True, prefix_match_unit=8, kv_cache_memory=budget,
              prefix_cache_retention_interval=16, max_num_batched_tokens=32)
    eng = llm.engine
    rng = random.Random(4)
    base = [rng.randrange(576) for _ in range(30)]
    _gen(llm, [base + [1, 2, 3]])
    index = {(e.block_hash, e.group_id): e for e in eng.kv_cache_snapshot()}
    removed = 0

    def on_event(ev):
        nonlocal removed
        key = (ev.block_hash, ev.group_id)
        if ev.kind == "stored":
            index[key] = ev
        else:
            removed += 1
            index.pop(key, None)

    eng.subscribe_kv_events(on_event)
    for _ in range(6):
        prompts = [base[: rng.randint(5, 30)] + [rng.randrange(576) for _ in range(rng.randint(5, 60))]
                   for _ in range(4)]
        _gen(llm, prompts, n=3)
    assert removed > 0, "the small budget was meant to evict"
    actual = {(h, gid): b.key_tokens[(h, gid)] for (h, gid), b in eng.pool.cached.items()}
    assert {k: e.num_tokens for k, e in index.items()} == actual
    kinds = {e.group_kind for e in index.values()}
    assert kinds == {"mla", "kda"}


def test_in_pass_export_does_not_split_prefill(tiny_model_dir):
    """Dense retention snapshots every block boundary of a 100-token prompt inside ONE prefill step."""
    common = dict(dtype="float64", skip_tokenizer_init=True, max_model_len=256, block_size=16,
                  max_num_batched_tokens=256)
    on = LLM(str(tiny_model_dir), enable_prefix_caching=True, prefix_cache_retention_interval="dense", **common)
    off = LLM(str(tiny_model_dir), **common)
    prompt = list(range(3, 103))
    assert _gen(on, [prompt], n=3) == _gen(off, [prompt], n=3)
    assert on.engine.num_steps == off.engine.num_steps == 3  # one prefill step + two decode steps
    assert {16, 32, 48, 64, 80, 96} <= _snapshot_lengths(on)


def test_marconi_junction_shorter_than_a_block(tiny_model_dir):
    """Fine-grained MLA keys let a junction (and a hit) end mid-block: |X| = 12 < block 16."""
    llm = LLM(str(tiny_model_dir), dtype="float64", skip_tokenizer_init=True, max_model_len=128, block_size=16,
              enable_prefix_caching=True, prefix_match_unit=4, prefix_cache_selective_retention=True)
    rng = random.Random(1)
    X = [rng.randrange(576) for _ in range(12)]
    hits = []
    for n in (9, 7, 5):
        before = llm.engine.stats()["prefix_cache_hits"]
        _gen(llm, [X + [rng.randrange(576) for _ in range(n)]], n=2)
        hits.append(llm.engine.stats()["prefix_cache_hits"] - before)
    assert hits == [0, 0, 12]
    assert 12 in _snapshot_lengths(llm)
