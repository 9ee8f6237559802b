"""The router's prefix index (router/prefix_index.py) against the real engine's prefix cache.

The oracle is the engine itself: its KV events (converted to the wire messages exactly as the gRPC worker
sends them) feed a PrefixIndex; before each request the index predicts the usable hit, and the engine's
reported `num_cached_tokens` must equal it; after each request the index must hold exactly the engine's
cache keys. Randomized model configs, block sizes, hash units, retention modes, Marconi selective
retention and tight KV budgets (evictions). Plus the numbering rules (gaps, instance changes, resync).
"""

import random

import pytest
from _engine_helpers import random_model_dir, tight_kv_budget

from k3serve.common.block_hash import chain_hashes, root_hash
from k3serve.proto import worker_pb2 as pb
from k3serve.proto.convert import kv_batch_to_proto
from k3serve.router.policy import Weights, make_policy
from k3serve.router.prefix_index import Hit, KvEventGap, PrefixIndex
from k3serve.sampling_params import SamplingParams


class _Feed:
    """Engine events -> KvEventBatch messages (one live batch per engine step) -> PrefixIndex."""

    def __init__(self, engine, index, slot, max_events=5):
        self.engine, self.index, self.slot, self.max_events = engine, index, slot, max_events
        self.pending, self.seq = [], 0
        engine.subscribe_kv_events(self.pending.append)
        snap = engine.kv_cache_snapshot()
        for m in kv_batch_to_proto(0, True, snap, "inst-1", max_events):
            index.apply(slot, m)

    def flush(self):
        if self.pending:
            evs, self.pending[:] = list(self.pending), []
            self.seq += len(evs)
            for m in kv_batch_to_proto(self.seq, False, evs, "inst-1", self.max_events):
                self.index.apply(self.slot, m)


def _run_one(engine, feed, rid, prompt, max_tokens=2):
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    cached = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            cached = out.num_cached_tokens
        feed.flush()
    return cached


def _prompts(rng, vocab, n, max_len):
    """Requests that share prefixes like an agent's turns: extend, branch, repeat."""
    pool = [[rng.randrange(vocab) for _ in range(rng.randint(4, max_len // 2))]]
    out = []
    for _ in range(n):
        base = rng.choice(pool)
        r = rng.random()
        if r < 0.45:
            p = base + [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        elif r < 0.7:
            p = base[:rng.randint(1, len(base))] + [rng.randrange(vocab) for _ in range(rng.randint(0, 20))]
        elif r < 0.85:
            p = list(base)
        else:
            p = [rng.randrange(vocab) for _ in range(rng.randint(2, max_len // 2))]
        p = p[:max_len - 4] or [1]
        pool.append(p)
        out.append(p)
    return out


CASES = [  # (model seed, block size, unit, retention, selective, extra pages for a tight budget or None)
    (1, 16, 16, 0, False, None),
    (2, 16, 4, "dense", False, 10),
    (3, 8, 4, 8, True, 8),
    (4, 16, 8, 0, True, 12),
    (5, 8, 8, "dense", False, 6),
]


@pytest.mark.parametrize("seed,block,unit,retention,selective,extra", CASES)
def test_predicted_hit_equals_engine_cached_tokens(tmp_path_factory, seed, block, unit, retention, selective, extra):
    from k3serve.workers.llm import LLM

    d = random_model_dir(tmp_path_factory.mktemp("m"), seed)
    max_len = 160
    kw = dict(block_size=block, enable_prefix_caching=True)
    if extra is not None:
        kw["kv_cache_memory"] = tight_kv_budget(d, max_len, extra_blocks=extra, **kw)
    llm = LLM(str(d), dtype="float32", skip_tokenizer_init=True, max_model_len=max_len, prefix_match_unit=unit,
              prefix_cache_retention_interval=retention, prefix_cache_selective_retention=selective, **kw)
    eng = llm.engine
    index = PrefixIndex()
    slot = index.add_worker("w")
    feed = _Feed(eng, index, slot)
    from k3serve.common.block_hash import model_fingerprint

    fp = model_fingerprint(str(d))
    rng = random.Random(seed)
    vocab = eng.vocab_size if hasattr(eng, "vocab_size") else 64
    hits = 0
    for i, p in enumerate(_prompts(rng, min(vocab, 50), 40, max_len)):
        hashes = chain_hashes(root_hash(fp, None), p, unit)
        pred = index.predict(hashes, len(p), unit, [slot])[slot]
        got = _run_one(eng, feed, f"r{i}", p)
        assert got == pred.usable, (i, len(p), pred, got)
        assert pred.mla >= pred.usable
        hits += got > 0
        assert index.keys(slot) == set(eng.pool.cached), i
    assert hits >= 5  # the workload really exercises hits


def _ev(kind, h, gid, gkind, n, bs=4):
    return pb.KvEvent(kind=kind, block_hash=h, group_id=gid, group_kind=gkind, num_tokens=n, block_size=bs)


def _hashes(tokens, unit=4):
    return chain_hashes(root_hash(b"\1" * 32), tokens, unit)


def test_usable_hit_is_min_of_mla_and_deepest_kda_snapshot():
    toks = list(range(1, 30))
    H = _hashes(toks)  # H[i]: prefix of 4*(i+1) tokens
    idx = PrefixIndex()
    a, b, c = idx.add_worker("a"), idx.add_worker("b"), idx.add_worker("c")
    S = pb.KvEvent.STORED
    # a: MLA blocks to 24 tokens, KDA snapshot only at 8 -> usable 8 (an attention-only router says 24)
    ev_a = [_ev(S, H[i], 0, "mla", 4 * (i + 1)) for i in range(6)] + [_ev(S, H[1], 1, "kda", 8)]
    # b: MLA to 12, KDA at 12 -> usable 12
    ev_b = [_ev(S, H[i], 0, "mla", 4 * (i + 1)) for i in range(3)] + [_ev(S, H[2], 1, "kda", 12)]
    # c: KDA at 20 but MLA broken at block 2 -> usable 4 (snapshot must be at or below the MLA hit)
    ev_c = [_ev(S, H[0], 0, "mla", 4), _ev(S, H[2], 0, "mla", 12), _ev(S, H[4], 1, "kda", 20),
            _ev(S, H[0], 1, "kda", 4)]
    for s, evs in ((a, ev_a), (b, ev_b), (c, ev_c)):
        idx.apply(s, pb.KvEventBatch(sequence=0, snapshot=True, snapshot_complete=True, events=evs, instance_id="i"))
    got = idx.predict(H, len(toks), 4, [a, b, c])
    assert got == {a: Hit(8, 24), b: Hit(12, 12), c: Hit(4, 4)}
    # the hybrid policy picks b; the attention-only baseline picks a (which can reuse only 8 tokens)
    from types import SimpleNamespace

    ws = [SimpleNamespace(slot=s, address=str(s), inflight=0, inflight_tokens=0, load={}) for s in (a, b, c)]
    assert make_policy("hybrid-prefix", Weights()).choose(ws, got, len(toks)).worker.slot == b
    assert make_policy("prefix", Weights()).choose(ws, got, len(toks)).worker.slot == a
    # never the prompt's last token: a 24-token prompt can hit at most 20 (MLA) on a
    short = idx.predict(H[:6], 24, 4, [a])[a]
    assert short == Hit(8, 20)


def test_gaps_instance_changes_and_resync():
    H = _hashes(list(range(1, 20)))
    S, R = pb.KvEvent.STORED, pb.KvEvent.REMOVED
    idx = PrefixIndex()
    s = idx.add_worker("w")
    with pytest.raises(KvEventGap):
        idx.apply(s, pb.KvEventBatch(sequence=1, events=[_ev(S, H[0], 0, "mla", 4)], instance_id="x"))
    idx.apply(s, pb.KvEventBatch(sequence=3, snapshot=True, events=[_ev(S, H[0], 0, "mla", 4)], instance_id="x"))
    idx.apply(s, pb.KvEventBatch(sequence=3, snapshot=True, snapshot_complete=True,
                                 events=[_ev(S, H[1], 0, "mla", 8)], instance_id="x"))
    assert idx.ready(s) and idx.keys(s) == {(H[0], 0), (H[1], 0)}
    idx.apply(s, pb.KvEventBatch(sequence=5, events=[_ev(R, H[1], 0, "mla", 8), _ev(S, H[2], 0, "mla", 12)],
                                 instance_id="x"))
    assert idx.keys(s) == {(H[0], 0), (H[2], 0)} and idx.last_sequence(s) == 5
    with pytest.raises(KvEventGap):  # events 6..6 lost
        idx.apply(s, pb.KvEventBatch(sequence=8, events=[_ev(S, H[3], 0, "mla", 16)] * 2, instance_id="x"))
    with pytest.raises(KvEventGap):  # the worker restarted
        idx.apply(s, pb.KvEventBatch(sequence=6, events=[_ev(S, H[3], 0, "mla", 16)], instance_id="y"))
    # a fresh snapshot (new instance) replaces everything, in the global masks too
    idx.apply(s, pb.KvEventBatch(sequence=0, snapshot=True, snapshot_complete=True,
                                 events=[_ev(S, H[3], 0, "mla", 16)], instance_id="y"))
    assert idx.keys(s) == {(H[3], 0)}
    assert idx.predict(H, 19, 4, [s])[s] == Hit(0, 0)
    idx.reset(s)
    assert not idx.ready(s) and idx.num_keys(s) == 0
    idx.remove_worker(s)
    assert idx._masks == {"mla": {}, "kda": {}}


def test_policies_trade_reuse_against_load():
    from types import SimpleNamespace

    def w(slot, inflight=0, queued=0, running=0):
        return SimpleNamespace(slot=slot, address=f"w{slot}", inflight=inflight, inflight_tokens=queued,
                               load={"running": running, "waiting": 0})

    hits = {0: Hit(800, 800), 1: Hit(0, 0), 2: Hit(0, 0)}
    hybrid = make_policy("hybrid-prefix", Weights())
    # the reuse wins while the worker that has it is not too busy...
    assert hybrid.choose([w(0, 1, 100, 1), w(1), w(2)], hits, 1000).worker.slot == 0
    # ...and loses when the prefill work already queued there costs more than it saves
    assert hybrid.choose([w(0, 3, 2000, 3), w(1), w(2)], hits, 1000).worker.slot in (1, 2)
    ll = make_policy("least-loaded", Weights())
    assert ll.choose([w(0, 1, 0, 1), w(1, 2, 0, 2), w(2)], hits, 1000).worker.slot == 2
    rr = make_policy("round-robin", Weights())
    assert [rr.choose([w(0), w(1), w(2)], hits, 10).worker.slot for _ in range(4)] == [0, 1, 2, 0]
    rnd = make_policy("random", Weights(), seed=1)
    assert {rnd.choose([w(0), w(1), w(2)], hits, 10).worker.slot for _ in range(50)} == {0, 1, 2}
    with pytest.raises(ValueError):
        make_policy("nope")
