"""k3serve/common/pd_geometry.py: the TP / block-size mapping of P/D transfers, checked by simulation.

A random model state (per head: conv rows of Q, K, V and a recurrent state) is sharded for the prefill
TP size into pages laid out as workers/engine/cache_layout.py lays them out (padding included); the
plan's reads then build every decode rank's page, which must equal the state sharded directly for the
decode TP size, byte for byte, with nothing left unwritten but padding."""

import random

import numpy as np
import pytest

from k3serve.common.pd_geometry import PDGeometryError, SideGeometry, pd_geometry_problem, plan_pd_mapping


def _round_up(x, m=64):
    return (x + m - 1) // m * m


def _side(tp, heads, d, width, citem, sitem, block=16):
    part = heads // tp * d * width * citem
    return SideGeometry(tp, block, heads, d, width, citem, sitem, _round_up(3 * part), 576 * citem)


def _pages(state_conv, state_ssm, g: SideGeometry):
    """Per rank: the page bytes (conv Q|K|V blocks of its heads, then the recurrent state at ssm_offset)."""
    h = g.local_heads
    out = []
    for rank in range(g.tp_size):
        heads = slice(rank * h, (rank + 1) * h)
        page = np.full(g.ssm_offset + g.ssm_bytes + 64, 0xEE, dtype=np.uint8)
        for j in range(3):
            blk = state_conv[j][heads].reshape(-1)
            page[j * g.conv_part_bytes:(j + 1) * g.conv_part_bytes] = blk
        page[g.ssm_offset:g.ssm_offset + g.ssm_bytes] = state_ssm[heads].reshape(-1)
        out.append(page)
    return out


def _divisors(n):
    return [k for k in range(1, n + 1) if n % k == 0]


@pytest.mark.parametrize("seed", range(12))
def test_kda_reads_rebuild_every_decode_rank_page(seed):
    rng = random.Random(seed)
    heads = rng.choice([4, 6, 8, 12, 16, 24])
    d, width = rng.choice([2, 4, 8]), rng.choice([1, 2, 3])
    citem, sitem = rng.choice([(2, 4), (4, 4), (8, 8)])
    ptp, dtp = rng.choice(_divisors(heads)), rng.choice(_divisors(heads))
    if max(ptp, dtp) % min(ptp, dtp):
        ptp = dtp  # unmappable pairs are tested below
    nprng = np.random.default_rng(seed)
    conv = [nprng.integers(0, 256, size=(heads, d * width * citem), dtype=np.uint8) for _ in range(3)]
    ssm = nprng.integers(0, 256, size=(heads, d * d * sitem), dtype=np.uint8)
    P, D = _side(ptp, heads, d, width, citem, sitem), _side(dtp, heads, d, width, citem, sitem)
    src_pages, want = _pages(conv, ssm, P), _pages(conv, ssm, D)
    for rank in range(dtp):
        m = plan_pd_mapping(P, D, rank)
        got = np.full_like(want[rank], 0xEE)
        written = np.zeros(len(got), dtype=bool)
        for rd in m.kda_reads:
            assert rd.src_rank in m.kda_src_ranks
            got[rd.dst_offset:rd.dst_offset + rd.nbytes] = src_pages[rd.src_rank][rd.src_offset:rd.src_offset + rd.nbytes]
            assert not written[rd.dst_offset:rd.dst_offset + rd.nbytes].any(), "two reads overlap"
            written[rd.dst_offset:rd.dst_offset + rd.nbytes] = True
        assert np.array_equal(got, want[rank]), (ptp, dtp, rank)
        used = np.zeros(len(got), dtype=bool)
        used[:3 * D.conv_part_bytes] = True
        used[D.ssm_offset:D.ssm_offset + D.ssm_bytes] = True
        assert np.array_equal(written, used), "every used byte is read exactly once, padding never"
        # MLA latent is replicated: the source is one of the KDA sources, and ranks spread over P's ranks
        assert m.mla_src_rank in m.kda_src_ranks
    if dtp >= ptp:
        assert sorted({plan_pd_mapping(P, D, r).mla_src_rank for r in range(dtp)}) == list(range(ptp))


def test_mla_block_pairs_with_decode_block_twice_prefill():
    P = _side(1, 4, 2, 3, 8, 8, block=16)
    D = _side(1, 4, 2, 3, 8, 8, block=32)
    m = plan_pd_mapping(P, D, 0)
    assert m.block_ratio == 2
    assert m.mla_block_pairs([7, 3, 9], [40, 41]) == [(7, 40, 0), (3, 40, 1), (9, 41, 0)]
    with pytest.raises(PDGeometryError, match="cannot hold"):
        m.mla_block_pairs([7, 3, 9], [40])


@pytest.mark.parametrize("ptp,dtp,pblock,dblock,match", [
    (4, 6, 16, 16, "do not divide one another"),
    (1, 1, 32, 16, "not a whole multiple"),
    (1, 1, 16, 40, "not a whole multiple"),
    (5, 1, 16, 16, "does not divide the 24 KDA heads"),
])
def test_unmappable_layouts_are_refused_with_the_reason(ptp, dtp, pblock, dblock, match):
    heads = 24
    with pytest.raises(PDGeometryError, match=match):
        plan_pd_mapping(SideGeometry(ptp, pblock, heads, 2, 3, 2, 4, 256, 1152),
                        SideGeometry(dtp, dblock, heads, 2, 3, 2, 4, 256, 1152), 0)
    assert match in pd_geometry_problem(ptp, dtp, heads, pblock, dblock)


def test_cr_time_check():
    assert pd_geometry_problem(8, 16, 96) is None and pd_geometry_problem(16, 8, 96) is None
    assert pd_geometry_problem(8, 8, 96, 768, 1536) is None
    assert "do not divide one another" in pd_geometry_problem(4, 6, 96)
    assert "not a whole multiple" in pd_geometry_problem(8, 8, 96, 768, 1024)
    assert pd_geometry_problem(8, 8, 96, 768, None) is None  # derived sizes: checked at run time


def test_different_dtypes_are_refused():
    a, b = _side(1, 4, 2, 3, 2, 4), _side(1, 4, 2, 3, 4, 4)
    with pytest.raises(PDGeometryError, match="conv_item differs"):
        plan_pd_mapping(a, b, 0)


def test_operator_pd_geometry_check_uses_the_same_mapping():
    from k3serve.operator.validation import pd_geometry_problems

    def spec(p, d, replicas=1, heads=96):
        return {"prefill": {"replicas": replicas, "tensorParallelSize": p}, "decode": {"tensorParallelSize": d},
                "model": {"architecture": {"kdaHeads": heads}}, "cache": {}}

    assert pd_geometry_problems(spec(8, 16)) == [] and pd_geometry_problems(spec(4, 6, replicas=0)) == []
    (msg,) = pd_geometry_problems(spec(4, 6))
    assert "do not divide one another" in msg
    (msg,) = pd_geometry_problems(spec(7, 7))
    assert "does not divide the 96 KDA heads" in msg
