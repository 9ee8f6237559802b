"""The store tier between two engines in two processes, through a real `mooncake_master`.

Worker A (another process, tests/_kvstore_helpers.py) serves prompts; worker B (this process, empty
local cache, no store segment of its own, so every object lives in A's segment) serves a shared
prefix plus a new suffix. Counts are read from B's catalog metrics; B's greedy tokens are compared
with the reference forward (float64, no caches). Runs in a private network namespace (root).
"""

from __future__ import annotations

import random
import time

import pytest

from k3serve.kvstore.netns import enter_private_netns

enter_private_netns()  # Mooncake clients listen on every interface: loopback-only namespace (root)

import _kvstore_helpers as kh  # noqa: E402

from k3serve.kvstore.connector import find_store  # noqa: E402
from k3serve.kvstore.master import MooncakeMaster  # noqa: E402
from k3serve.sampling_params import SamplingParams  # noqa: E402

MAX_NEW = 4
# correctness here, not timing: a generous deadline so a loaded CI box cannot turn hits into misses
# (the 50 ms default and outages are tested in tests/test_kvstore_worker.py)
DEADLINE_MS = 2000
X_LEN = 48  # the shared prefix: 3 blocks of 16, 6 hash units of 8


@pytest.fixture(scope="module")
def master():
    m = MooncakeMaster().start()
    yield m
    m.stop()


@pytest.fixture(scope="module")
def worker_a(master):
    p = kh.EngineProcess()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    import torch

    from k3serve.workers.model.reference import greedy_generate, load_reference_model

    models = {}

    def ref(prompt, model_dir=tiny_model_dir):
        key = str(model_dir)
        if key not in models:
            models[key] = load_reference_model(key, dtype=torch.float64)
        return greedy_generate(models[key], prompt, MAX_NEW)

    return ref


def _kwargs(model_dir, master, retention, selective=False, **kw):
    return dict(model=str(model_dir), dtype="float64", skip_tokenizer_init=True, max_model_len=256, block_size=16,
                enable_prefix_caching=True, prefix_match_unit=8, prefix_cache_retention_interval=retention,
                prefix_cache_selective_retention=selective, kv_store=master.address,
                kv_store_deadline_ms=DEADLINE_MS, **kw)


def _engine_b(kw):
    from k3serve.workers.llm import LLM

    kw = dict(kw)
    llm = LLM(kw.pop("model"), kv_store_segment_bytes=0, **kw)  # B holds no objects itself
    assert find_store(llm.engine).service.wait_available(10)
    return llm


def _gen(llm, prompt, salt=None):
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return llm.generate([prompt], sp, cache_salt=salt)[0].outputs[0].token_ids


def _settle(llm_or_proc=None):
    time.sleep(0.3)  # puts run on the save lane, after the step that computed the pages


def _tokens(rng, n):
    return [rng.randrange(576) for _ in range(n)]


# retention -> (selective, A's prompts beyond X+a, the deepest boundary <= |X| it must retain)
POLICIES = {
    "dense": ("dense", False, 0, 48),
    "interval-32": (32, False, 0, 32),
    "prompt-end": (0, False, 0, 0),
    "marconi": (0, True, 1, 48),  # X+b is X's second hit: the junction at |X| gets a snapshot
}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_cross_worker_reuse_counts_and_reference(policy, master, worker_a, tiny_model_dir, reference):
    retention, selective, extra, want = POLICIES[policy]
    rng = random.Random(list(POLICIES).index(policy))
    X = _tokens(rng, X_LEN)
    kw = _kwargs(tiny_model_dir, master, retention, selective)
    worker_a.call("engine", kwargs=kw)
    for _ in range(1 + extra):
        worker_a.call("generate", prompts=[X + _tokens(rng, 13)], max_tokens=MAX_NEW)
    snaps = worker_a.call("snapshots")
    deepest = max((s for s in snaps if s <= X_LEN), default=0)
    assert deepest == want, (policy, snaps)
    _settle()
    b = _engine_b(kw)
    try:
        prompt = X + _tokens(rng, 9)
        out = _gen(b, prompt)
        m = kh.metrics_of(b.engine)
        assert m["k3serve_prefill_tokens_computed_total"] == len(prompt) - deepest
        assert m["k3serve_kv_store_hits_tokens_total"] == deepest
        assert m['k3serve_kv_store_lookups_total{result="hit"}'] == (1 if deepest else 0)
        if deepest:
            assert m['k3serve_kv_store_bytes_total{direction="get"}'] > 0
            assert m['k3serve_kv_store_group_hits_tokens_total{group="kda"}'] == deepest
        assert out == reference(prompt)
    finally:
        kh.shutdown_engine(b.engine)
        worker_a.call("close")


def test_random_configs_equal_reference(master, worker_a, tmp_path_factory, reference):
    from _engine_helpers import random_model_dir

    tmp = tmp_path_factory.mktemp("kvstore-random")
    for seed, x_len in ((3, 40), (11, 56)):  # the shared prefix ends mid-block: a tail page is loaded
        d = random_model_dir(tmp, seed)
        rng = random.Random(seed)
        # a randomized config decides its own block size; the unit stays 8 tokens
        kw = dict(model=str(d), dtype="float64", skip_tokenizer_init=True, max_model_len=256, block_size=16,
                  enable_prefix_caching=True, prefix_match_unit=8, prefix_cache_retention_interval="dense",
                  kv_store=master.address, kv_store_deadline_ms=DEADLINE_MS)
        vocab = _vocab(d)
        X = [rng.randrange(vocab) for _ in range(x_len)]
        worker_a.call("engine", kwargs=kw)
        worker_a.call("generate", prompts=[X + [rng.randrange(vocab) for _ in range(7)]], max_tokens=MAX_NEW)
        deepest = max((s for s in worker_a.call("snapshots") if s <= len(X)), default=0)
        _settle()
        b = _engine_b(kw)
        try:
            prompt = X + [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
            out = _gen(b, prompt)
            if b.engine.layout.kda_groups and b.engine.layout.mla_groups:
                assert deepest == x_len, seed  # A's replay boundary floor((|X| + 6) / 8) * 8
                assert b.engine.stats()["kv_store_hit_tokens"] == deepest, seed
            assert out == reference(prompt, d), seed
        finally:
            kh.shutdown_engine(b.engine)
            worker_a.call("close")


def _vocab(model_dir) -> int:
    from k3serve.workers.model.config import K3Config

    return K3Config.from_pretrained(str(model_dir)).vocab_size


def test_partial_local_hit_against_store(master, worker_a, tiny_model_dir, reference):
    rng = random.Random(7)
    X = _tokens(rng, X_LEN)
    kw = _kwargs(tiny_model_dir, master, "dense")
    worker_a.call("engine", kwargs=kw)
    worker_a.call("generate", prompts=[X + _tokens(rng, 13)], max_tokens=MAX_NEW)  # store: X up to 48
    _settle()
    b = _engine_b(kw)
    try:
        # B's own cache reaches 40 (mid-block: replay boundary of a 45-token prompt): the store's 48 wins
        _gen(b, X[:40] + _tokens(rng, 5))
        s0 = b.engine.stats()
        prompt = X + _tokens(rng, 9)
        assert _gen(b, prompt) == reference(prompt)
        s1 = b.engine.stats()
        assert s1["prefill_tokens_computed"] - s0["prefill_tokens_computed"] == len(prompt) - 48
        assert s1["kv_store_hit_tokens"] - s0["kv_store_hit_tokens"] == 48 - 32  # loaded from the block boundary
        # B's cache reaches 56 on another chain extending X (mid-block); the store has no deeper joint hit
        # than 56 for it: the local partial hit is kept and nothing is loaded
        Y = prompt[:56]
        _gen(b, Y + _tokens(rng, 4))
        s2 = b.engine.stats()
        prompt2 = Y + _tokens(rng, 6)
        assert _gen(b, prompt2) == reference(prompt2)
        s3 = b.engine.stats()
        assert s3["prefill_tokens_computed"] - s2["prefill_tokens_computed"] == len(prompt2) - 56
        assert s3["kv_store_hit_tokens"] == s2["kv_store_hit_tokens"]
    finally:
        kh.shutdown_engine(b.engine)
        worker_a.call("close")


def test_two_salts_never_share(master, worker_a, tiny_model_dir):
    rng = random.Random(8)
    P = _tokens(rng, 60)
    kw = _kwargs(tiny_model_dir, master, "dense")
    worker_a.call("engine", kwargs=kw)
    worker_a.call("generate", prompts=[P], max_tokens=MAX_NEW, salt="tenant-a")
    _settle()
    b = _engine_b(kw)
    try:
        store = find_store(b.engine)
        assert store.lookup(P, "tenant-b").tokens == 0 and store.lookup(P, None).tokens == 0
        assert store.lookup(P, "tenant-a").tokens == 56  # A's replay boundary floor(59 / 8) * 8
        _gen(b, P, salt="tenant-b")
        assert b.engine.stats()["kv_store_hit_tokens"] == 0
        _gen(b, P, salt="tenant-a")  # B's own cache has tenant-b only: the hit comes from the store
        assert b.engine.stats()["kv_store_hit_tokens"] == 56
    finally:
        kh.shutdown_engine(b.engine)
        worker_a.call("close")


def test_segment_holder_dies_others_recompute(master, tiny_model_dir, reference):
    rng = random.Random(9)
    X = _tokens(rng, X_LEN)
    kw = _kwargs(tiny_model_dir, master, "dense")
    holder = kh.EngineProcess()
    try:
        holder.call("engine", kwargs=kw)
        holder.call("generate", prompts=[X + _tokens(rng, 13)], max_tokens=MAX_NEW)
        _settle()
        b = _engine_b(kw)
        try:
            assert find_store(b.engine).lookup(X + [1], None).tokens == 48  # present, in the holder's segment
            holder.kill()  # its segment goes with it; the master still lists the keys for a while
            prompt = X + _tokens(rng, 9)
            t0 = time.monotonic()
            assert _gen(b, prompt) == reference(prompt)
            # bounded: at most a lookup and a load deadline on the store, plus the recompute itself
            assert time.monotonic() - t0 < 2 * DEADLINE_MS / 1000 + 5.0
            st = b.engine.stats()
            assert st["kv_store_hit_tokens"] == 0  # nothing was loaded: the request recomputed
            assert st["kv_store_loads_failed"] + st["kv_store_lookups_skipped"] >= 1
        finally:
            kh.shutdown_engine(b.engine)
    finally:
        holder.kill()
