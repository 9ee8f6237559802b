"""The expert-parallel all-to-all (workers/engine/parallel/moe_a2a.py) over real gloo groups.

Each rank (a thread with its own ProcessGroupGloo over a loopback TCPStore) holds a ragged number of
tokens (one rank none), routes them to random top-k experts under a PERMUTED logical -> physical map,
dispatches, runs only its own experts, combines; every rank's result must equal the single-rank
`ops.moe_experts` over all experts for its tokens (float64), and pad rows (ids -1) combine to zeros.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from k3serve.kernels import ops
from k3serve.workers.engine.parallel.group import RankGroup, host_store, join_store
from k3serve.workers.engine.parallel.moe_a2a import combine, dispatch
from k3serve.workers.engine.parallel.shard import ExpertMap


def run_ranks(n: int, fn):
    """fn(group) on n ranks at once (threads), results in rank order; the first error is raised."""
    store = host_store(n, 30)
    out, errors = [None] * n, []

    def rank(r):
        try:
            g = RankGroup(store if r == 0 else join_store(store.port, n, 30), r, n, 30)
            out[r] = fn(g)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("n,seed", [(2, 0), (4, 1)])
def test_dispatch_combine_equals_single_rank_experts(n, seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    E, k, D, inter, dout = 4 * n, 3, 8, 6, 5
    w13 = torch.randn(E, 2 * inter, D, generator=g, dtype=torch.float64)
    w2 = torch.randn(E, dout, inter, generator=g, dtype=torch.float64)
    perm = list(range(E))
    rng.shuffle(perm)
    emap = ExpertMap(E, tuple(tuple(perm[r * 4:(r + 1) * 4]) for r in range(n)))  # a rebalanced placement
    counts = [rng.randint(1, 9) for _ in range(n)]
    counts[n - 1] = 0  # an idle rank still meets the others in every collective
    z = [torch.randn(c, D, generator=g, dtype=torch.float64) for c in counts]
    ids = [torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(c)]) if c else torch.empty(0, k).long()
           for c in counts]
    wts = [torch.rand(c, k, generator=g, dtype=torch.float64) for c in counts]
    if counts[0] > 1:
        ids[0][-1] = -1  # a pad row: routed nowhere
    seen = []

    def fn(group):
        r = group.rank
        local = torch.tensor(emap.physical[r])
        d = dispatch(group, z[r], wts[r], ids[r], emap)
        seen.append((r, sum(d.recv_counts), d.send_counts))
        y = ops.moe_experts(d.tokens, d.weights, d.slots, w13=w13[local], w2=w2[local], activation="silu")
        return combine(group, d, y)

    got = run_ranks(n, fn)
    for r in range(n):
        want = ops.moe_experts(z[r], wts[r], ids[r], w13=w13, w2=w2, activation="silu")
        assert got[r].shape == (counts[r], dout)
        torch.testing.assert_close(got[r], want, rtol=1e-12, atol=1e-12)
    if counts[0] > 1:
        assert torch.equal(got[0][-1], torch.zeros(dout, dtype=torch.float64))
    sent = {r: s for r, _, s in seen}
    assert sum(R for _, R, _ in seen) == sum(sum(s) for s in sent.values())  # every sent row was received
    assert sent[n - 1] == (0,) * n  # the idle rank sent nothing


def test_group_collectives_are_logged_with_what_leaves_the_rank():
    def fn(group):
        group.log = []
        x = torch.arange(6, dtype=torch.float64).view(3, 2) + 10 * group.rank
        s = group.reduce_scatter(torch.ones(4, 2, dtype=torch.float64) * (group.rank + 1))
        a = group.all_to_all(x, [1, 2] if group.rank == 0 else [2, 1], [1, 2] if group.rank == 0 else [2, 1])
        return s, a, group.log

    (s0, a0, log0), (s1, a1, _) = run_ranks(2, fn)
    assert s0.tolist() == [[3.0, 3.0]] * 2 and s1.tolist() == [[3.0, 3.0]] * 2
    assert a0.tolist() == [[0.0, 1.0], [10.0, 11.0], [12.0, 13.0]] and a1.tolist() == [[2.0, 3.0], [4.0, 5.0], [14.0, 15.0]]
    assert log0 == [("reduce_scatter", (4, 2), 8), ("all_to_all", (2, 2), 8)]


def test_dispatch_refuses_a_map_for_another_group_size():
    def fn(group):
        with pytest.raises(ValueError, match="places experts on 4 ranks, the group has 2"):
            dispatch(group, torch.zeros(1, 2), torch.ones(1, 1), torch.zeros(1, 1).long(), ExpertMap.contiguous(8, 4))
        return True

    assert run_ranks(2, fn) == [True, True]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dispatch_delivers_each_token_once_per_rank_bit_exact(dtype):
    """Rank d receives, from each rank in order, the tokens (ascending) with >= 1 expert on d, bit-exact in
    the token dtype (packed with the float64 routing metadata), with the weights and slots of d's experts."""
    n, E, k, D = 2, 6, 2, 7
    g = torch.Generator().manual_seed(5)
    emap = ExpertMap(E, ((4, 1, 2), (0, 5, 3)))
    z = [torch.randn(c, D, generator=g).to(dtype) for c in (5, 3)]
    ids = [torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(c)]) for c in (5, 3)]
    wts = [torch.rand(c, k, generator=g) for c in (5, 3)]
    got = run_ranks(n, lambda group: dispatch(group, z[group.rank], wts[group.rank], ids[group.rank], emap))
    for d in range(n):
        mine = torch.tensor([e in emap.physical[d] for e in range(E)])
        rows, w, slots = [], [], []
        for r in range(n):
            for t in range(z[r].shape[0]):
                here = mine[ids[r][t]]
                if here.any():
                    rows.append(z[r][t])
                    w.append(torch.where(here, wts[r][t], 0.0))
                    slots.append(torch.tensor([emap.physical[d].index(e) if h else -1
                                               for e, h in zip(ids[r][t].tolist(), here.tolist())]))
        assert got[d].tokens.dtype == dtype
        assert torch.equal(got[d].tokens.view(torch.uint8), torch.stack(rows).view(torch.uint8))
        assert torch.equal(got[d].weights, torch.stack(w)) and torch.equal(got[d].slots, torch.stack(slots))
