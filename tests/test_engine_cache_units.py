"""Unit tests of the hybrid cache pieces that need no model: layout, block pool, cache manager."""

from types import SimpleNamespace

import pytest
import torch

from k3serve.common.block_hash import chain_hashes, root_hash, unit_hash
from k3serve.sampling_params import SamplingParams
from k3serve.workers.engine.cache_layout import KVCacheTensors, plan_cache_layout
from k3serve.workers.engine.kv_cache.block_pool import BlockPool, NoFreeBlocks
from k3serve.workers.engine.kv_cache.coordinator import KVCacheCoordinator
from k3serve.workers.engine.kv_cache.eviction import ComputePerByteScorer
from k3serve.workers.engine.request import Request


def fake_config(n_layers=8, kda_every=4):
    kda = [i for i in range(n_layers) if i % kda_every != kda_every - 1]
    mla = [i for i in range(n_layers) if i not in kda]
    return SimpleNamespace(kda_layer_ids=kda, mla_layer_ids=mla, kv_lora_rank=32, qk_rope_head_dim=16,
                           kda_num_heads=2, kda_head_dim=16, conv_kernel_size=4)


def test_layout_groups_and_block_size():
    cfg = fake_config()
    lay = plan_cache_layout(cfg, torch.float32)
    # 6 KDA layers, 2 MLA layers -> group size 2: 1 MLA group and 3 KDA groups (design doc §2)
    assert lay.group_size == 2
    assert [g.kind for g in lay.groups] == ["mla", "kda", "kda", "kda"]
    assert sorted(i for g in lay.kda_groups for i in g.layer_ids) == cfg.kda_layer_ids
    # derived block size: smallest multiple of 16 whose MLA page covers the KDA page
    kda_page = lay.kda_page_used
    assert lay.block_size * 48 * 4 >= kda_page
    assert (lay.block_size - 16) * 48 * 4 < kda_page
    assert lay.page_bytes >= max(lay.mla_page_used, kda_page)


def test_page_views_alias_the_same_bytes():
    lay = plan_cache_layout(fake_config(), torch.float64, block_size=16)
    kv = KVCacheTensors(lay, 4)
    kv.ssm_view(0)[2].fill_(3.0)
    kv.conv_view(0)[2].fill_(1.5)
    assert kv.ssm_view(0)[2].sum() > 0 and kv.mla_view(0)[1].abs().sum() == 0
    kv.copy_blocks([(2, 3)])
    assert torch.equal(kv.ssm_view(0)[3], kv.ssm_view(0)[2])
    assert torch.equal(kv.conv_view(1)[3], kv.conv_view(1)[2])


def test_block_pool_lru_and_unhashed_first():
    pool = BlockPool(6, block_size=4)
    a = pool.allocate(3)
    pool.register(a[0], (b"x", 0), 4, 1)
    pool.free_blocks([a[0], a[1]])
    # the unhashed block goes to the front: it is reused before the cached one
    nxt = pool.allocate(1)[0]
    assert nxt is a[1]
    assert pool.lookup((b"x", 0)) is a[0]
    rest = pool.allocate(pool.num_free)
    assert a[0] in rest and pool.lookup((b"x", 0)) is None  # evicted last, its key dropped
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)


def test_compute_per_byte_keeps_deep_snapshots():
    pool = BlockPool(5, block_size=4, eviction=ComputePerByteScorer(state_groups={1}))  # group 1: KDA
    bs = pool.allocate(4)
    for i, b in enumerate(bs):
        pool.register(b, (bytes([i]), 1), 4 * (i + 1) if i != 1 else 400, 1)
    pool.free_blocks(bs)  # same recency order: bs[0] oldest
    victim = pool.allocate(1)[0]
    assert victim is bs[0]  # old and shallow
    victim2 = pool.allocate(1)[0]
    assert victim2 is not bs[1]  # the 400-token snapshot outlives newer shallow ones


def test_hash_chain_is_canonical_and_salted():
    fp = bytes(32)
    r1, r2 = root_hash(fp, None), root_hash(fp, "tenant-a")
    assert r1 != r2
    toks = list(range(10))
    h = chain_hashes(r1, toks, 4)
    assert len(h) == 2
    assert h[1] == unit_hash(unit_hash(r1, toks[:4]), toks[4:8])
    assert chain_hashes(r2, toks, 4)[0] != h[0]


def _mk_req(rid, toks):
    return Request(rid, rid, 0, toks, SamplingParams(max_tokens=4), None)


def test_manager_hit_snapshot_and_same_step_rule():
    cfg = fake_config()
    lay = plan_cache_layout(cfg, torch.float32, block_size=8)
    pool = BlockPool(64, block_size=8)
    m = KVCacheCoordinator(lay, pool, enable_caching=True, hash_unit=4, retention=0)
    m.begin_step(1)
    a = _mk_req("a", list(range(21)))
    hit = m.find_hit(a)
    assert hit.tokens == 0
    m.set_retained_boundaries(a, hit)
    assert a.retained_boundaries == {20}  # replay boundary floor((21-1)/4)*4
    plan = m.admit(a, hit, 21)
    assert plan.new_block_ids and all(len(ids) == 3 for ids in plan.new_block_ids)  # ceil(21 / 8) pages
    assert [off for off, _ in plan.checkpoints] == [20]
    a.num_computed_tokens = 21
    b = _mk_req("b", list(range(21)) + [99, 98])
    hb = m.find_hit(b)
    assert hb.tokens == 20 and hb.defer  # snapshot cached this very step: not usable yet
    m.end_step()
    m.begin_step(2)
    hb = m.find_hit(b)
    assert hb.tokens == 20 and not hb.defer
    assert hb.cow_sources is not None  # 20 is mid-block (block 8): the tail page is copied
    plan_b = m.admit(b, hb, 3)
    assert len(plan_b.copies) == len(lay.mla_groups) + len(lay.kda_groups)
    m.end_step()
    m.free(a)
    m.free(b)
    assert pool.num_free == pool.num_usable
