"""The MoE's routed pairs sorted by expert and cut into blocks, in ONE Triton program (decode-sized batches).

`route_blocks_triton(topk_ids, E, bm)` gives exactly what `moe.route_blocks` gives (its contract: sorted
expert ids int32 [P] with invalid ids as E, pair order int32 [P], block starts int32 [P] with -1 past the last
block, the block count int32 [1]), with the pair order STABLE (pairs of one expert in pair order). It replaces
PyTorch's sort + compare + cummax + cumsum + scatter (~10 kernels, ~43 µs per MoE layer at B=64 on the H200,
docs/kernels-notes.md) by one launch that needs no host sync (graph-safe):

* one key per pair, expert·BP + pair (unique, so sorting the keys is a stable sort by expert), sorted in
  registers (`tl.sort`, bitonic); padding lanes (pair >= P) get key (E+1)·BP + pair and sort last;
* the sorted expert ids are stored, then (after a block barrier, which makes the program's own global stores
  visible to all its threads) read back shifted by one to find where each expert's run starts;
* a run's start is carried forward with a max-scan; a pair opens a block when its offset in the run is a
  multiple of `bm`; the blocks are numbered by a cumsum and their starts scattered (every block start is
  written once; the rest of `starts` gets -1).

Pairs up to `MAX_PAIRS` (P·E keys must fit int32). Larger batches (prefill) take `route_blocks_sorted`: PyTorch's
stable sort of the ids (a few launches of CUB's radix sort), then two parallel kernels (`PARALLEL_RUNS`): one
program finds each expert's run start by binary search over the sorted ids and numbers the blocks per expert, and
one program per tile of pairs marks the pairs that open a block and writes the int32 sorted ids, pair order, block
starts and count: ~9 launches and no host sync where the PyTorch form took ~30 (each a host-side launch: a prefill
step is host-bound, docs/kernels-notes.md session 10). The earlier second stage, ONE program walking the sorted ids
tile after tile (`_route_runs_kernel`), stays behind PARALLEL_RUNS = False.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2

MAX_PAIRS = 4096
"""Largest routed-pair count (tokens x top-k) the one-program kernel takes."""


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _route_blocks_kernel(ids_ptr, sid_ptr, order_ptr, start_ptr, nblk_ptr, P, E, BM: tl.constexpr,
                         BP: tl.constexpr):
    i = tl.arange(0, BP)
    m = i < P
    e = tl.load(ids_ptr + i, mask=m, other=0).to(tl.int32)
    e = tl.where(m, tl.where((e >= 0) & (e < E), e, E), E + 1)
    key = tl.sort(e * BP + i)
    sid = key // BP
    tl.store(sid_ptr + i, sid, mask=m)
    tl.store(order_ptr + i, key % BP, mask=m)
    tl.debug_barrier()
    prev = tl.load(sid_ptr + i - 1, mask=m & (i > 0), other=-1)
    first = tl.associative_scan(tl.where(sid != prev, i, 0), 0, _max_combine)
    is_start = ((i - first) % BM == 0) & (sid < E) & m
    bidx = tl.cumsum(is_start.to(tl.int32), 0) - 1
    nblk = tl.sum(is_start.to(tl.int32), 0)
    tl.store(start_ptr + bidx, i, mask=is_start)
    tl.store(start_ptr + i, -1, mask=m & (i >= nblk))
    tl.store(nblk_ptr + i, nblk, mask=i == 0)


def route_blocks_triton(topk_ids: torch.Tensor, E: int, bm: int):
    """(sorted expert ids, pair order, block starts, block count): see the module docstring."""
    P = topk_ids.numel()
    if not 1 <= P <= MAX_PAIRS:
        raise ValueError(f"route_blocks_triton: {P} routed pairs (1..{MAX_PAIRS})")
    if (E + 2) * next_pow2(P) >= 2**31:
        raise ValueError(f"route_blocks_triton: E={E} x {P} pairs overflows the int32 sort keys")
    dev = topk_ids.device
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    sid = torch.empty(P, dtype=torch.int32, device=dev)
    order = torch.empty(P, dtype=torch.int32, device=dev)
    starts = torch.empty(P, dtype=torch.int32, device=dev)
    nblk = torch.empty(1, dtype=torch.int32, device=dev)
    BP = max(16, next_pow2(P))
    _route_blocks_kernel[(1,)](ids, sid, order, starts, nblk, P, E, BM=bm, BP=BP,
                               num_warps=4 if BP <= 1024 else 8)
    return sid, order, starts, nblk


@triton.jit
def _route_runs_kernel(sid_ptr, order_ptr, sid_out, order_out, start_ptr, nblk_ptr, P, E, BM: tl.constexpr,
                       BP: tl.constexpr):
    run0 = tl.zeros((), dtype=tl.int32)  # start of the run the previous tile ended in
    nblk = tl.zeros((), dtype=tl.int32)  # blocks found so far
    for t0 in range(0, P, BP):
        i = t0 + tl.arange(0, BP)
        m = i < P
        sid = tl.load(sid_ptr + i, mask=m, other=E + 1).to(tl.int32)
        prev = tl.load(sid_ptr + i - 1, mask=m & (i > 0), other=-1).to(tl.int32)
        tl.store(sid_out + i, sid, mask=m)
        tl.store(order_out + i, tl.load(order_ptr + i, mask=m, other=0).to(tl.int32), mask=m)
        first = tl.maximum(tl.associative_scan(tl.where(sid != prev, i, 0), 0, _max_combine), run0)
        is_start = ((i - first) % BM == 0) & (sid < E) & m
        s32 = is_start.to(tl.int32)
        tl.store(start_ptr + nblk + tl.cumsum(s32, 0) - 1, i, mask=is_start)
        nblk += tl.sum(s32, 0)
        run0 = tl.max(first, 0)
    for t0 in range(0, P, BP):
        i = t0 + tl.arange(0, BP)
        tl.store(start_ptr + i, -1, mask=(i < P) & (i >= nblk))
    tl.store(nblk_ptr, nblk)


@triton.jit
def _run_offsets_kernel(sid_ptr, offs_ptr, bbase_ptr, nblk_ptr, P, E, NIT, BM: tl.constexpr, BE: tl.constexpr):
    """One program, one lane per expert e: where e's run starts in the sorted ids (a binary search, NIT steps), its
    block count cdiv(run length, BM), and the index of its first block (exclusive cumsum over the experts)."""
    e = tl.arange(0, BE)
    me = e < E
    lo = tl.zeros([BE], dtype=tl.int32)  # first index with sid >= e
    hi = tl.zeros([BE], dtype=tl.int32) + P
    lo1 = tl.zeros([BE], dtype=tl.int32)  # first index with sid >= e + 1
    hi1 = tl.zeros([BE], dtype=tl.int32) + P
    for _ in range(NIT):
        mid = (lo + hi) // 2
        v = tl.load(sid_ptr + mid, mask=me & (lo < hi), other=0).to(tl.int32)
        go = (lo < hi) & (v < e)
        lo = tl.where(go, mid + 1, lo)
        hi = tl.where((lo < hi) & ~go, mid, hi)
        mid1 = (lo1 + hi1) // 2
        v1 = tl.load(sid_ptr + mid1, mask=me & (lo1 < hi1), other=0).to(tl.int32)
        go1 = (lo1 < hi1) & (v1 < e + 1)
        lo1 = tl.where(go1, mid1 + 1, lo1)
        hi1 = tl.where((lo1 < hi1) & ~go1, mid1, hi1)
    nb = tl.where(me, (lo1 - lo + BM - 1) // BM, 0)
    tl.store(offs_ptr + e, lo, mask=me)
    tl.store(bbase_ptr + e, tl.cumsum(nb, 0) - nb, mask=me)
    tl.store(nblk_ptr + e, tl.sum(nb, 0), mask=e == 0)


@triton.jit
def _run_blocks_kernel(sid_ptr, order_ptr, sid_out, order_out, start_ptr, nblk_ptr, offs_ptr, bbase_ptr, P, E,
                       BM: tl.constexpr, BT: tl.constexpr):
    """BT sorted pairs per program, all programs at once: a pair opens a block when its offset in its expert's run
    is a multiple of BM (the run's start and first block index from `_run_offsets_kernel`); the int32 sorted ids
    and pair order are written, and the block starts past the count get -1 (indices the block writes never reach)."""
    i = tl.program_id(0) * BT + tl.arange(0, BT)
    m = i < P
    s = tl.load(sid_ptr + i, mask=m, other=E).to(tl.int32)
    tl.store(sid_out + i, s, mask=m)
    tl.store(order_out + i, tl.load(order_ptr + i, mask=m, other=0).to(tl.int32), mask=m)
    valid = m & (s < E)
    r = i - tl.load(offs_ptr + s, mask=valid, other=0)
    opens = valid & (r % BM == 0)
    tl.store(start_ptr + tl.load(bbase_ptr + s, mask=valid, other=0) + r // BM, i, mask=opens)
    tl.store(start_ptr + i, -1, mask=m & (i >= tl.load(nblk_ptr)))


PARALLEL_RUNS = True
"""`route_blocks_sorted` finds the blocks with two parallel kernels (`_run_offsets_kernel`: each expert's run start
by binary search over the sorted ids; `_run_blocks_kernel`: every pair at once) instead of ONE program walking the
sorted ids tile after tile (`_route_runs_kernel`: 2.5 ms for 11 MoE layers of a 16384-token step of the
vs-transformers model on an H100, 131072 pairs a layer, run 21 in docs/kernels-notes.md). The same outputs bit for
bit; False: the one-program walk (the before/after of a GPU run)."""


def route_blocks_sorted(topk_ids: torch.Tensor, E: int, bm: int, tile: int = 1024):
    """`route_blocks_triton`'s result (stable pair order) for any number of pairs: PyTorch's stable sort, then each
    expert's run offsets and one program per `tile` pairs (PARALLEL_RUNS), or one `_route_runs_kernel` program over
    the sorted ids in tiles of `tile` pairs (see the module docstring)."""
    P = topk_ids.numel()
    if P < 1:
        raise ValueError("route_blocks_sorted: no routed pairs")
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"route_blocks_sorted: tile must be a power of two >= 16, got {tile}")
    dev = topk_ids.device
    ids = topk_ids.reshape(-1)
    ids = torch.where((ids >= 0) & (ids < E), ids, E)
    sorted_ids, order = torch.sort(ids, stable=True)
    sid = torch.empty(P, dtype=torch.int32, device=dev)
    order32 = torch.empty(P, dtype=torch.int32, device=dev)
    starts = torch.empty(P, dtype=torch.int32, device=dev)
    nblk = torch.empty(1, dtype=torch.int32, device=dev)
    if not PARALLEL_RUNS:
        _route_runs_kernel[(1,)](sorted_ids, order, sid, order32, starts, nblk, P, E, BM=bm, BP=tile,
                                 num_warps=4 if tile <= 1024 else 8)
        return sid, order32, starts, nblk
    runs = torch.empty(2, E, dtype=torch.int32, device=dev)  # each expert's run start and first block index
    _run_offsets_kernel[(1,)](sorted_ids, runs[0], runs[1], nblk, P, E, max(1, P.bit_length()), BM=bm,
                              BE=max(16, next_pow2(E)), num_warps=4)
    _run_blocks_kernel[(triton.cdiv(P, tile),)](sorted_ids, order, sid, order32, starts, nblk, runs[0], runs[1], P, E,
                                               BM=bm, BT=tile, num_warps=4 if tile <= 1024 else 8)
    return sid, order32, starts, nblk
