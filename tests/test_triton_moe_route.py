"""The one-program `route_blocks` kernel (kernels/triton/moe_route.py) and the "gemv" path's combines, under the
CPU interpreter: the same block layout as the PyTorch form on random routings, and the combines equal to the
reference op."""

import _triton_cpu  # (sets TRITON_INTERPRET=1 first)
import pytest
import test_triton_moe_variants as V
import torch

from k3serve.kernels.triton import moe, moe_route

pytestmark = _triton_cpu.skip_on_cuda


def _torch_form(ids, E):
    old = moe.ROUTE_KERNEL
    moe.ROUTE_KERNEL = False
    try:
        return moe.route_blocks(ids, E, count=True)
    finally:
        moe.ROUTE_KERNEL = old


def _random_ids(g, T, E, k, invalid):
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if E <= 6:  # few experts: long runs of one expert (blocks of 16 and a partial one)
        ids = torch.randint(0, E, (T, k), generator=g)
    drop = torch.rand(T, k, generator=g) < invalid
    return torch.where(drop, torch.full_like(ids, -1), ids)


@pytest.mark.parametrize("seed", range(6))
def test_same_layout_as_torch_form(seed):
    """Random (T, E, k, share of invalid pairs): sorted ids, block starts and count equal the PyTorch form's; the
    pair order is the stable sort's (pairs of one expert in pair order) and the same pairs per expert as the
    PyTorch form's."""
    g = torch.Generator().manual_seed(seed)
    T = int(torch.randint(1, 80, (1,), generator=g))
    E = [3, 6, 16, 64, 130, 896][seed]
    k = int(torch.randint(1, min(E, 9) + 1, (1,), generator=g))
    ids = _random_ids(g, T, E, k, invalid=[0.0, 0.1, 0.5, 0.0, 0.2, 0.05][seed])
    dtype = torch.int64 if seed % 2 else torch.int32
    ids = ids.to(dtype)
    want = _torch_form(ids, E)
    got = moe.route_blocks(ids, E, count=True)
    assert all(t.dtype == torch.int32 for t in got)
    sid, order, starts, n = got
    assert torch.equal(sid, want[0]) and torch.equal(starts, want[2]) and torch.equal(n, want[3])
    flat = torch.where(ids.reshape(-1) >= 0, ids.reshape(-1).long(), torch.full((ids.numel(),), E))
    assert torch.equal(order.long(), torch.sort(flat, stable=True).indices)
    P = ids.numel()
    assert torch.equal(torch.sort(want[0].long() * P + want[1].long()).values, sid.long() * P + order.long())
    assert int(n) == int((starts >= 0).sum()) and (starts[: int(n)] >= 0).all()


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("seed,tile", [(0, 16), (1, 32), (2, 16), (3, 64), (4, 1024), (5, 16)])
def test_sorted_form_same_layout_across_tiles(seed, tile, parallel, monkeypatch):
    """`route_blocks_sorted` (stable sort, then the parallel run kernels or one program over tiles): sorted ids,
    block starts and count equal the PyTorch form's, the pair order is the stable sort's, on random routings whose
    runs and blocks straddle tile edges (tiles of 16-64 pairs), with experts nobody routes to, ids >= E counted
    invalid as by the one-program kernel."""
    monkeypatch.setattr(moe_route, "PARALLEL_RUNS", parallel)
    g = torch.Generator().manual_seed(100 + seed)
    T = int(torch.randint(1, 90, (1,), generator=g))
    E = [3, 6, 16, 64, 130, 5][seed]
    k = int(torch.randint(1, min(E, 9) + 1, (1,), generator=g))
    ids = _random_ids(g, T, E, k, invalid=[0.0, 0.1, 0.5, 0.0, 0.2, 0.3][seed]).to(
        torch.int64 if seed % 2 else torch.int32)
    bm = [16, 4, 16, 64, 16, 3][seed]
    old = moe.ROUTE_KERNEL
    moe.ROUTE_KERNEL = False
    try:
        want = moe.route_blocks(ids, E, count=True, bm=bm)
    finally:
        moe.ROUTE_KERNEL = old
    got = moe_route.route_blocks_sorted(ids, E, bm, tile=tile)
    assert all(t.dtype == torch.int32 for t in got)
    sid, order, starts, n = got
    assert torch.equal(sid, want[0]) and torch.equal(starts, want[2]) and torch.equal(n, want[3])
    flat = torch.where(ids.reshape(-1) >= 0, ids.reshape(-1).long(), torch.full((ids.numel(),), E))
    assert torch.equal(order.long(), torch.sort(flat, stable=True).indices)
    if seed == 5:  # ids past the last expert are invalid too (sorted last as E, in no block)
        big = ids.clone()
        big[0, 0] = E + 7
        s2, o2, st2, n2 = moe_route.route_blocks_sorted(big, E, bm, tile=tile)
        assert int(s2.max()) == E and int(n2) == int((st2 >= 0).sum())


def test_large_batches_take_the_sorted_form(monkeypatch):
    """Above MAX_PAIRS `route_blocks` takes the sorted form (ROUTE_SORTED), which gives the one-program kernel's
    layout; ROUTE_SORTED=False: the PyTorch form, same sorted ids, starts and count."""
    seen = []
    orig = moe.route_blocks_sorted
    monkeypatch.setattr(moe, "route_blocks_sorted", lambda *a: (seen.append(a[0].numel()), orig(*a))[1])
    monkeypatch.setattr(moe, "route_blocks_triton_max_pairs", 12)
    g = torch.Generator().manual_seed(7)
    ids = _random_ids(g, 40, 6, 3, invalid=0.1)
    a = moe.route_blocks(ids, 6, count=True)
    small = moe.route_blocks(ids[:4], 6, count=True)
    monkeypatch.setattr(moe, "ROUTE_SORTED", False)
    b = moe.route_blocks(ids, 6, count=True)
    assert seen == [120]
    assert all(torch.equal(x, y) for x, y in zip(moe_route.route_blocks_triton(ids[:4], 6, 16), small))
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])


def test_dispatch_by_pair_count(monkeypatch):
    """Up to MAX_PAIRS the kernel runs, above it the PyTorch form; ROUTE_KERNEL=False always PyTorch."""
    seen = []
    orig = moe.route_blocks_triton
    monkeypatch.setattr(moe, "route_blocks_triton", lambda *a: (seen.append(a[0].numel()), orig(*a))[1])
    monkeypatch.setattr(moe, "route_blocks_triton_max_pairs", 12)
    ids = torch.tensor([[3, 1, 0], [3, -1, 2], [1, 3, 0], [2, 2, 1]])
    a = moe.route_blocks(ids, 4, count=True)
    b = moe.route_blocks(torch.cat([ids, ids]), 4, count=True)  # 24 pairs: PyTorch
    monkeypatch.setattr(moe, "ROUTE_KERNEL", False)
    c = moe.route_blocks(ids, 4)
    assert seen == [12]
    assert a[0].tolist() == [0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4]
    assert a[1].tolist() == [2, 8, 1, 6, 11, 5, 9, 10, 0, 3, 7, 4]
    assert a[2].tolist() == [0, 2, 5, 8] + [-1] * 8 and a[3].tolist() == [4]
    assert torch.equal(c[0], a[0]) and torch.equal(c[2], a[2]) and int(b[3]) == 4


def test_errors():
    with pytest.raises(ValueError, match="no routed pairs"):
        moe_route.route_blocks_sorted(torch.zeros(0, dtype=torch.int64), 4, 16)
    with pytest.raises(ValueError, match="power of two"):
        moe_route.route_blocks_sorted(torch.zeros(4, dtype=torch.int64), 4, 16, tile=24)
    with pytest.raises(ValueError, match="routed pairs"):
        moe_route.route_blocks_triton(torch.zeros(moe_route.MAX_PAIRS + 1, dtype=torch.int64), 4, 16)
    with pytest.raises(ValueError, match="overflows"):
        moe_route.route_blocks_triton(torch.zeros(4096, dtype=torch.int64), 2**20, 16)
    with pytest.raises(ValueError, match="unknown combine"):
        z, tw, ids, kw = V._case(1, 4, 2, 64, 32, 48, (True, True), seed=1)
        moe.moe_experts_triton(z, tw, ids, **kw, variant="gemv", combine="sum")


@pytest.mark.parametrize("combine,T,fp4,dt,knobs", [
    *[(c, 1, (True, True), torch.float32, {}) for c in moe.COMBINES],
    ("unroll", 3, (True, True), torch.bfloat16, dict(bn2=8, bk2=256)),
    ("loop", 3, (True, True), torch.float32, {}),
    ("atomic", 4, (False, True), torch.float32, dict(bn1=8, bk1=256)),
    ("unroll", 2, (False, False), torch.float32, {}),
])
def test_gemv_combines(combine, T, fp4, dt, knobs):
    """Every combine of the "gemv" path (and the tiles the sweep tries) equals the reference, with invalid pairs
    (their h rows are never written: "unroll" must select their terms away, not multiply them by zero)."""
    z, tw, ids, kw = V._case(T, 12, 4, 160, 96, 72, fp4, seed=T * 31 + len(knobs))
    if T > 1:
        ids[0, 1:] = -1
    V._check(z, tw, ids, kw, dt, "situ", 25.0, dict(variant="gemv", combine=combine, **knobs))


def test_default_combine_is_used(monkeypatch):
    seen = []
    orig = moe._gemv_path
    monkeypatch.setattr(moe, "_gemv_path", lambda *a: (seen.append(a[-1]), orig(*a))[1])
    z, tw, ids, kw = V._case(2, 6, 2, 64, 32, 48, (True, True), seed=7)
    V._check(z, tw, ids, kw, torch.float32, "silu", None, dict(variant="gemv"))
    assert seen == [moe.GEMV_COMBINE] and moe.GEMV_COMBINE in moe.COMBINES


def test_gemv_tiles_wide_k_for_few_pairs():
    """Up to GEMV_WIDE_K_MAX_PAIRS pairs with both K's <= GEMV_WIDE_K (the small preset at batch 1): one K tile;
    more pairs, dense weights or the K3 shape (DIN 3584): the default tiles; a given knob always wins."""
    def tiles(DIN, I, pairs, fp4=True, **kn):
        t, _ = moe._tiles("gemv", fp4, fp4, DIN, I, kn.get("bn1"), kn.get("bk1"), None, kn.get("bk2"), None,
                          fill=(pairs, 1024, 132, 16, pairs))
        return t
    assert tiles(1024, 768, 8) == (16, 1024, 32, 1024)
    assert tiles(1024, 768, 16)[1::2] == (1024, 1024)
    assert tiles(1024, 768, 64)[1::2] == (512, 128)
    assert tiles(3584, 384, 16)[1::2] == (512, 128)
    assert tiles(1024, 768, 8, fp4=False)[1::2] == (64, 64)
    assert tiles(1024, 768, 8, bk1=256)[1::2] == (256, 1024)
