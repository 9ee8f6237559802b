"""Partial-block reconciliation (design doc k3-model-and-cache.md §4.2) in the scheduler, with a
scripted connector and no model: a local hit ending mid-block vs a longer or shorter tier hit, an
aligned local hit with a tier hit ending mid-block, an over-long tier hit, "ask again later", and the composition of tiers with a transfer connector."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from k3serve.sampling_params import SamplingParams
from k3serve.workers.engine.cache_layout import plan_cache_layout
from k3serve.workers.engine.kv_cache.block_pool import BlockPool
from k3serve.workers.engine.kv_cache.coordinator import KVCacheCoordinator
from k3serve.workers.engine.kv_connector.base import (
    ConnectorContext,
    ConnectorKind,
    KVConnector,
    KVConnectorScheduler,
    KVConnectorWorker,
    LoadSpec,
    MatchResult,
)
from k3serve.workers.engine.kv_connector.composite import compose
from k3serve.workers.engine.request import Request, RequestStatus
from k3serve.workers.engine.scheduler import Scheduler

B, U = 8, 4


class Scripted(KVConnectorScheduler):
    """Offers `offer[request_id]` tokens past the aligned local hit (None: ask again later)."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.offer: dict[str, int | None] = {}
        self.asked: list[tuple[str, int]] = []
        self.specs = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.asked.append((request.request_id, num_computed_tokens))
        return MatchResult(self.offer.get(request.request_id, 0), False)

    def update_state_after_alloc(self, request, spec):
        self.specs[request.request_id] = spec


def _setup():
    cfg = SimpleNamespace(kda_layer_ids=[0, 1, 2], mla_layer_ids=[3], kv_lora_rank=16, qk_rope_head_dim=8,
                          kda_num_heads=1, kda_head_dim=8, conv_kernel_size=4)
    lay = plan_cache_layout(cfg, torch.float32, block_size=B)
    pool = BlockPool(64, block_size=B)
    kv = KVCacheCoordinator(lay, pool, enable_caching=True, hash_unit=U)
    conn = Scripted(ConnectorContext(lay, U, b"\0" * 32, "cpu", "t", True))
    kv.attach_connector(conn)
    s = Scheduler(kv, max_num_batched_tokens=256, max_num_seqs=8, max_model_len=128, connector=conn)
    return s, kv, pool, conn


def _req(rid, toks):
    return Request(rid, rid, 0, toks, SamplingParams(max_tokens=1, ignore_eos=True), None)


def _serve(s, req):
    """Admit `req`, compute it in one step, sample one token (it finishes by length)."""
    s.add(req)
    out = s.schedule()
    s.end_step()
    s.update_from_output(out, {c.request_id: 1 for c in out.chunks if c.sample})
    return out


def _cached_prefix(s, n):
    """A request of n + 1 tokens computed and finished: KDA snapshot at its replay boundary n."""
    a = _req("a", list(range(100, 101 + n)))
    _serve(s, a)
    assert a.status == RequestStatus.FINISHED_LENGTH
    s.connector.asked.clear()
    return list(range(100, 101 + n))


def _all_free(pool):
    return pool.num_free == pool.num_usable and all(b.ref_cnt == 0 for b in pool.blocks)


def test_tier_longer_than_a_mid_block_local_hit_wins_and_the_tail_is_not_adopted():
    s, kv, pool, conn = _setup()
    prefix = _cached_prefix(s, 20)  # local hit 20 = mid-block (B=8): aligned 16
    tail_page = pool.cached[(_hash(kv, prefix, 20), kv.mla_groups[0].group_id)]  # holds tokens 16..19
    b = _req("b", prefix[:20] + list(range(1, 11)))
    conn.offer["b"] = 8  # 16 + 8 = 24 > 20
    s.add(b)
    out = s.schedule()
    assert conn.asked == [("b", 16)]  # the connector sees only the block-aligned local hit
    spec = conn.specs["b"]
    assert (spec.num_local_tokens, spec.num_external_tokens) == (16, 8)
    assert out.copies == []  # no copy-on-write of the local tail, no KDA snapshot copy
    assert out.chunks[0].start == 24 and b.num_cached_tokens == 24
    s.end_step()
    assert tail_page.ref_cnt == 0 and tail_page.block_id not in out.new_requests[0].block_ids[0]
    s.update_from_output(out, {"b": 1})
    assert _all_free(pool)


def test_local_hit_kept_when_the_tier_is_not_longer():
    s, kv, pool, conn = _setup()
    prefix = _cached_prefix(s, 20)
    b = _req("b", prefix[:20] + list(range(1, 11)))
    conn.offer["b"] = 4  # 16 + 4 = 20 = the local hit
    s.add(b)
    out = s.schedule()
    spec = conn.specs["b"]
    assert spec.num_external_tokens == 0 and spec.num_local_tokens == 20
    assert len(out.copies) == 1 + 3  # CoW of the tail page + the snapshot into each KDA group's state
    assert out.chunks[0].start == 20
    s.end_step()
    s.update_from_output(out, {"b": 1})
    assert _all_free(pool)


def test_aligned_local_hit_and_a_tier_hit_ending_mid_block():
    s, kv, pool, conn = _setup()
    prefix = _cached_prefix(s, 16)  # local hit 16, block-aligned
    b = _req("b", prefix[:16] + list(range(1, 15)))
    conn.offer["b"] = 6  # ends at 22, inside block 2
    s.add(b)
    out = s.schedule()
    spec = conn.specs["b"]
    assert (spec.num_local_tokens, spec.num_external_tokens) == (16, 6)
    assert spec.load_block_ids(kv.layout, kv.mla_groups[0].group_id) == spec.block_ids[0][2:3]
    assert out.copies == [] and out.chunks[0].start == 22
    s.end_step()
    s.update_from_output(out, {"b": 1})
    assert _all_free(pool)


def test_tier_hit_leaving_no_token_to_compute_is_ignored():
    s, kv, pool, conn = _setup()
    conn.offer["b"] = 10
    b = _req("b", list(range(1, 11)))  # 10 tokens: at most 9 may be loaded
    s.add(b)
    out = s.schedule()
    assert conn.specs["b"].num_external_tokens == 0 and out.chunks[0].start == 0
    s.end_step()
    s.update_from_output(out, {"b": 1})
    assert _all_free(pool)


def test_ask_again_later_keeps_the_request_waiting_and_admits_the_next():
    s, kv, pool, conn = _setup()
    conn.offer["b"] = None
    b, c = _req("b", list(range(1, 11))), _req("c", list(range(30, 40)))
    s.add(b)
    s.add(c)
    out = s.schedule()
    assert [ch.request_id for ch in out.chunks] == ["c"] and list(s.waiting) == [b]
    s.end_step()
    s.update_from_output(out, {"c": 1})
    conn.offer["b"] = 0
    out = s.schedule()
    assert [ch.request_id for ch in out.chunks] == ["b"]
    s.end_step()
    s.update_from_output(out, {"b": 1})
    assert _all_free(pool)


def _hash(kv, toks, p):
    r = _req("h", toks + [0])
    kv.update_hashes(r)
    return kv._hash_at(r, p)


def test_composition_longest_tier_wins_ties_to_the_cheaper_transfer_decides_alone():
    s, kv, pool, _ = _setup()
    ctx = ConnectorContext(kv.layout, U, b"\0" * 32, "cpu", "t", True)

    def tier(name, kind=ConnectorKind.TIER):
        c = Scripted(ctx)
        c.name, c.kind = name, kind
        return KVConnector(c, KVConnectorWorker(ctx))

    host, store, pd = tier("host"), tier("store"), tier("pd", ConnectorKind.TRANSFER)
    comp = compose(ctx, [host, store, pd])
    assert [c.name for c in comp.scheduler.children] == ["pd", "host", "store"]
    b = _req("b", list(range(1, 31)))
    kv.update_hashes(b)

    def choose(offers):
        for conn, n in zip((host, store, pd), offers):
            conn.scheduler.offer["b"] = n
        m = comp.scheduler.get_num_new_matched_tokens(b, 0)
        comp.scheduler.update_state_after_alloc(b, LoadSpec("b", kv.block_ids(b), 0, m.num_tokens or 0, False))
        return m.num_tokens, [c.scheduler.specs["b"].num_external_tokens for c in (host, store, pd)]

    assert choose([8, 12, 0]) == (12, [0, 12, 0])  # the longest tier hit wins
    assert choose([12, 12, 0]) == (12, [12, 0, 0])  # a tie goes to the earlier (cheaper) tier
    assert choose([12, 16, 4]) == (4, [0, 0, 4])  # the transfer connector supplies the prompt alone
    assert choose([12, 16, None]) == (None, [0, 0, 0])  # ... or asks to be asked later
    with pytest.raises(ValueError, match="at most one transfer"):
        compose(ctx, [pd, tier("pd2", ConnectorKind.TRANSFER)])
