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
stable sort of the ids (a few launches of CUB's radix sort), then ONE program (`_route_runs_kernel`) walks the sorted
ids in tiles, carrying the current run's start and the block count across tiles, and writes the int32 sorted ids,
pair order, block starts and count: ~8 launches and no host sync where the PyTorch form took ~30 (each a host-side
launch: a prefill step is host-bound, docs/kernels-notes.md session 10).
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


def route_blocks_sorted(topk_ids: torch.Tensor, E: int, bm: int, tile: int = 1024):
    """`route_blocks_triton`'s result (stable pair order) for any number of pairs: PyTorch's stable sort, then one
    `_route_runs_kernel` program over the sorted ids in tiles of `tile` pairs (see the module docstring)."""
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
    _route_runs_kernel[(1,)](sorted_ids, order, sid, order32, starts, nblk, P, E, BM=bm, BP=tile,
                             num_warps=4 if tile <= 1024 else 8)
    return sid, order32, starts, nblk
