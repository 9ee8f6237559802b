"""Argument handling shared by the two KDA forms: validation, q/k normalisation, per-sequence plan."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._varlen import bool_list, checkpoints_by_seq, compute_dtype, int_list, seq_starts
from .norms import l2_normalize


@dataclass
class KdaBatch:
    """Inputs of a KDA call in compute dtype, heads-major per token: q, k, g [T, H, K]; v [T, H, V]; beta [T, H]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    cu: list[int]
    slots: list[int]
    init: list[bool]
    ckpts: dict[int, list[tuple[int, int]]]
    dtype: torch.dtype

    def initial_states(self, state_pool: torch.Tensor) -> list[torch.Tensor | None]:
        """Per sequence: its initial state [H, V, K] (a copy, compute dtype), zeros, or None if padded."""
        H, V, K = state_pool.shape[1:]
        out: list[torch.Tensor | None] = []
        for b, slot in enumerate(self.slots):
            if slot < 0:
                out.append(None)
            elif self.init[b]:
                out.append(state_pool[slot].to(self.dtype).clone())
            else:
                out.append(torch.zeros(H, V, K, dtype=self.dtype, device=state_pool.device))
        return out


def prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    scale: float | None,
    use_qk_l2norm: bool,
    checkpoint_seq: torch.Tensor | None,
    checkpoint_offsets: torch.Tensor | None,
    checkpoint_slots: torch.Tensor | None,
) -> KdaBatch:
    """Validate shapes, cast to the compute dtype and apply q̂ = l2norm(q)·scale, k̂ = l2norm(k)."""
    T, H, K = q.shape
    V = v.shape[-1]
    if (
        k.shape != q.shape
        or g.shape != q.shape
        or tuple(v.shape[:2]) != (T, H)
        or tuple(beta.shape) != (T, H)
    ):
        raise ValueError(
            f"KDA shapes: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} g {tuple(g.shape)} "
            f"beta {tuple(beta.shape)}"
        )
    if tuple(state_pool.shape[1:]) != (H, V, K):
        raise ValueError(f"state_pool {tuple(state_pool.shape)} must be [num_slots, {H}, {V}, {K}] ([v][k])")
    dt = compute_dtype(q, k, v, g, beta, state_pool)
    scale = K**-0.5 if scale is None else scale
    qf, kf = q.to(dt), k.to(dt)
    if use_qk_l2norm:
        qf, kf = l2_normalize(qf, 1e-6), l2_normalize(kf, 1e-6)
    cu = seq_starts(cu_seqlens)
    if cu[-1] > T:
        raise ValueError(f"cu_seqlens ends at {cu[-1]} but there are only {T} tokens")
    B = len(cu) - 1
    lens = [cu[b + 1] - cu[b] for b in range(B)]
    return KdaBatch(
        q=qf * scale,
        k=kf,
        v=v.to(dt),
        g=g.to(dt),
        beta=beta.to(dt),
        cu=cu,
        slots=int_list(state_indices, B, "state_indices"),
        init=bool_list(has_initial_state, B, "has_initial_state"),
        ckpts=checkpoints_by_seq(checkpoint_seq, checkpoint_offsets, checkpoint_slots, lens, min_offset=1),
        dtype=dt,
    )


def store(state_pool: torch.Tensor, writes: list[tuple[int, torch.Tensor]]) -> None:
    """Write (slot, state [H, V, K]) pairs into the pool, in order, casting to the pool's dtype."""
    for slot, s in writes:
        state_pool[slot].copy_(s.to(state_pool.dtype))


def run_sequences(kb: KdaBatch, state_pool: torch.Tensor, v: torch.Tensor, walk) -> torch.Tensor:
    """Drive `walk(b, S, marks, o, ckpt_writes) -> final S` over every non-padded sequence b, then
    store final states first and checkpoints after (so a checkpoint aimed at a state slot wins).
    Returns o [T, H, V] in v's dtype."""
    o = torch.zeros(v.shape, dtype=kb.dtype, device=v.device)
    finals: list[tuple[int, torch.Tensor]] = []
    ckpt_writes: list[tuple[int, torch.Tensor]] = []
    for b, S in enumerate(kb.initial_states(state_pool)):
        if S is None:
            continue
        finals.append((kb.slots[b], walk(b, S, kb.ckpts.get(b, []), o, ckpt_writes)))
    store(state_pool, finals + ckpt_writes)
    return o.to(v.dtype)
