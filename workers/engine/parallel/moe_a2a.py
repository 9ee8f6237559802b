"""Expert-parallel MoE by all-to-all: each rank's own tokens go to the ranks holding their experts and back.

    d = dispatch(group, z, topk_weights, topk_ids, expert_map)   # z [T_local, D]: this rank's tokens
    out = ops.moe_experts(d.tokens, d.weights, d.slots, w13=..., w2=...)  # this rank's experts only
    r = combine(group, d, out)                                   # [T_local, D']: every expert's share

Tokens are sharded (sequence-parallel TEP: workers/engine/parallel/seq_parallel.py; data-parallel
attention: each rank its own requests), so the counts are ragged: T_local may differ per rank, be 0,
and each rank receives a different number of rows. `topk_ids` are LOGICAL expert ids (-1: no expert,
e.g. a pad row: that row is sent nowhere and combines to zeros); `expert_map` (shard.py ExpertMap) says
which rank holds each and in which physical slot, so a load balancer can move experts by changing it.

A token is sent at most once to each rank (with all of its top-k that live there: the routing weights
of the other ranks' experts are 0 and their slots -1 in the row a rank receives); the receiver applies
the routing weights while summing its experts, so the combine returns one row per (token, rank) and the
token's rank adds them. Collectives, in order and the same on every rank (gloo has a ragged
`alltoall_base`, so this is torch's all_to_all_single with split sizes; workers/engine/parallel/group.py):
dispatch = the row counts (int64 [N]), then ONE all-to-all of bytes [rows, D·itemsize + 16k]: each row is
the token's bytes followed by its routing metadata as float64 (k slots and k weights, both exact in
float64); combine = the results [rows, D'] back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from k3serve.workers.engine.parallel.group import RankGroup
from k3serve.workers.engine.parallel.shard import ExpertMap


@dataclass(frozen=True)
class Dispatched:
    """What a rank received in `dispatch`, and how `combine` sends the results back (plain tensors)."""

    tokens: torch.Tensor  # [R, D] rows received: a token of some rank with >= 1 of its experts here
    weights: torch.Tensor  # [R, k] its routing weights; 0 where the expert lives on another rank
    slots: torch.Tensor  # [R, k] int64 physical slot of the expert on this rank, -1 where another rank has it
    send_counts: tuple[int, ...]  # rows this rank sent to each rank
    recv_counts: tuple[int, ...]  # rows this rank received from each rank (sum = R)
    src_rows: torch.Tensor  # [sum(send_counts)] int64: the local token each sent row is
    num_tokens: int  # T_local


@functools.lru_cache(maxsize=16)
def placement(expert_map: ExpertMap) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner [E] int64 rank, slot [E] int64 physical slot on that rank) of every logical expert."""
    owner = torch.empty(expert_map.num_experts, dtype=torch.long)
    slot = torch.empty(expert_map.num_experts, dtype=torch.long)
    for r, experts in enumerate(expert_map.physical):
        for s, e in enumerate(experts):
            owner[e], slot[e] = r, s
    return owner, slot


def dispatch(group: RankGroup, tokens: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
             expert_map: ExpertMap) -> Dispatched:
    """Send each local token (row of `tokens` [T_local, D]) to every rank holding one of its top-k experts."""
    n = group.size
    if len(expert_map.physical) != n:
        raise ValueError(f"dispatch: the expert map places experts on {len(expert_map.physical)} ranks, "
                         f"the group has {n}")
    T, k = topk_ids.shape
    owner, slot = placement(expert_map)
    valid = topk_ids >= 0
    ids = topk_ids.clamp(min=0).long()
    dest = torch.where(valid, owner[ids], -1)  # [T, k] rank of each choice
    to_rank = torch.zeros(T, n, dtype=torch.bool)  # token t goes to rank d
    if T:
        to_rank[torch.arange(T)[:, None].expand(T, k)[valid], dest[valid]] = True
    pairs = to_rank.t().nonzero()  # (rank, token), by rank then token: the send order
    dst, src_rows = pairs[:, 0], pairs[:, 1]
    send_counts = torch.bincount(dst, minlength=n)
    mine = dest[src_rows] == dst[:, None]  # [S, k]: this choice's expert lives on the row's destination
    meta = torch.cat([torch.where(mine, slot[ids[src_rows]], -1).to(torch.float64),
                      torch.where(mine, topk_weights[src_rows].to(torch.float64), 0.0)], dim=1)
    send = tuple(send_counts.tolist())
    recv = tuple(group.all_to_all(send_counts, [1] * n, [1] * n).tolist())
    rows = tokens[src_rows].contiguous()
    got = group.all_to_all(torch.cat([rows.view(torch.uint8), meta.view(torch.uint8)], dim=1), send, recv)
    nb = tokens.shape[1] * tokens.element_size()
    rows = got[:, :nb].contiguous().view(tokens.dtype)
    meta = got[:, nb:].contiguous().view(torch.float64)
    return Dispatched(rows, meta[:, k:].to(topk_weights.dtype), meta[:, :k].long(), send, recv, src_rows, T)


def combine(group: RankGroup, d: Dispatched, expert_out: torch.Tensor) -> torch.Tensor:
    """The expert results [R, D'] (one row per received row, routing weights applied) sent back and summed
    per token: [T_local, D'] (zeros for a token that routed to no expert)."""
    back = group.all_to_all(expert_out, d.recv_counts, d.send_counts)
    out = expert_out.new_zeros((d.num_tokens, *expert_out.shape[1:]))
    return out.index_add_(0, d.src_rows, back)
