"""The KDA short convolution on the CPU: K shifted multiply-adds over the whole batch, decode rows included.

Same contract as `k3serve.kernels.reference.causal_conv1d_varlen` (see it). The reference multiplies
every unfolded window out per sequence. Here (`SHIFTED`) the token rows of all sequences, concatenated
as they come, are convolved as if they were one sequence: y[t] = Σ_j w[:, j] · x[t-K+1+j] is K
multiply-adds of shifted row ranges of x, one pass for the whole batch. Only the first K-1 rows of each
sequence have windows that reach past its start (into its history, or into the previous sequence's rows
in x); those rows, the final states and the checkpoints are read from a small gather of each sequence's
"extended input" [history (K-1 rows) | chunk]. Histories are read before anything is written; final
states first, checkpoints after.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..reference import causal_conv1d_varlen as _reference
from ..reference._varlen import bool_list, checkpoints_by_seq, compute_dtype, int_list, seq_starts

SHIFTED = True
"""True: the shifted multiply-adds over the whole batch; False: one grouped `conv1d` per sequence over
[history | chunk] (the earlier form; benchmarks and tests compare the two)."""


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    *,
    activation: str | None = "silu",
    checkpoint_seq: torch.Tensor | None = None,
    checkpoint_offsets: torch.Tensor | None = None,
    checkpoint_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    kw = dict(activation=activation, checkpoint_seq=checkpoint_seq, checkpoint_offsets=checkpoint_offsets,
              checkpoint_slots=checkpoint_slots)
    w = weight.squeeze(1) if weight.dim() == 3 else weight
    dt = compute_dtype(x)
    if (activation not in ("silu", None, "none", "identity") or x.dim() != 2 or x.dtype != dt
            or conv_states.dtype != dt or w.dim() != 2 or x.shape[1] != w.shape[0]
            or tuple(conv_states.shape[1:]) != (w.shape[0], w.shape[1] - 1)):
        return _reference(x, weight, conv_states, state_indices, cu_seqlens, has_initial_state, **kw)
    cu = seq_starts(cu_seqlens)
    B = len(cu) - 1
    slots = int_list(state_indices, B, "state_indices")
    init = bool_list(has_initial_state, B, "has_initial_state")
    lens = [cu[b + 1] - cu[b] for b in range(B)]
    ckpts = checkpoints_by_seq(checkpoint_seq, checkpoint_offsets, checkpoint_slots, lens, min_offset=0)
    live = [b for b in range(B) if slots[b] >= 0]
    if len({slots[b] for b in live}) != len(live):
        return _reference(x, weight, conv_states, state_indices, cu_seqlens, has_initial_state, **kw)
    if not live:
        return torch.zeros(x.shape, dtype=dt)
    idx = torch.tensor([slots[b] for b in live])
    hist = conv_states.index_select(0, idx)  # [n, C, K-1]: every history read before any write
    if not all(init[b] for b in live):
        hist = torch.where(torch.tensor([init[b] for b in live])[:, None, None], hist, 0)
    form = _shifted if SHIFTED else _per_sequence
    y, new_state, ckpt_writes = form(x, w.to(dt), hist, live, cu, lens, ckpts)
    conv_states.index_copy_(0, idx, new_state)
    for slot, val in ckpt_writes:
        conv_states[slot].copy_(val)
    return F.silu(y, inplace=True) if activation == "silu" else y


def _ext_rows(x: torch.Tensor, hist: torch.Tensor, live: list[int], cu: list[int],
              picks: list[tuple[int, int]]) -> torch.Tensor:
    """Rows of the live sequences' extended inputs ext_i = [hist[i] as K-1 rows | x rows of sequence live[i]]:
    for each (i, j) of `picks` row j of ext_i; returns [len(picks), C] (one small gather)."""
    n, C, K1 = hist.shape
    xrows, pick = [], []
    for i, j in picks:
        if j < K1:
            pick.append(i * K1 + j)
        else:
            pick.append(n * K1 + len(xrows))
            xrows.append(cu[live[i]] + j - K1)
    src = torch.cat([hist.transpose(1, 2).reshape(n * K1, C), x.index_select(0, torch.tensor(xrows, dtype=torch.long))])
    return src.index_select(0, torch.tensor(pick, dtype=torch.long))


def _shifted(x, w, hist, live, cu, lens, ckpts):
    """(y [T, C] before the activation, the live sequences' new states [n, C, K-1], [(slot, checkpoint value)]).

    Every row as if the batch were one sequence, K shifted multiply-adds of x; then the rows within K-1 of a
    live sequence's start (whose windows reach into its history) recomputed from `_ext_rows`, which also give
    the states (ext_i rows len..len+K-2) and checkpoints (rows off..off+K-2); padded sequences' rows zeroed."""
    T, C = x.shape
    K = w.shape[1]
    wt = w.t().contiguous()  # [K, C]: row j weighs the input K-1-j rows back
    y = torch.empty(T, C, dtype=x.dtype)
    if T >= K:
        body = torch.mul(x[: T - K + 1], wt[0], out=y[K - 1:])
        for j in range(1, K):
            body.addcmul_(x[j: T - K + 1 + j], wt[j])
    head_tok = [(i, t) for i, b in enumerate(live) for t in range(min(lens[b], K - 1))]
    ck = [(i, off, slot) for i, b in enumerate(live) for off, slot in ckpts.get(b, [])]
    picks = ([(i, t + j) for i, t in head_tok for j in range(K)]
             + [(i, lens[b] + j) for i, b in enumerate(live) for j in range(K - 1)]
             + [(i, off + j) for i, off, _ in ck for j in range(K - 1)])
    rows = _ext_rows(x, hist, live, cu, picks)
    nh, n = len(head_tok), len(live)
    win = rows[: nh * K].view(nh, K, C)
    head = win[:, 0] * wt[0]
    for j in range(1, K):
        head.addcmul_(win[:, j], wt[j])
    y.index_copy_(0, torch.tensor([cu[live[i]] + t for i, t in head_tok], dtype=torch.long), head)
    live_set = set(live)
    for b in range(len(cu) - 1):
        if b not in live_set:
            y[cu[b]: cu[b + 1]] = 0
    y[cu[-1]:] = 0
    state = rows[nh * K: nh * K + n * (K - 1)].view(n, K - 1, C).transpose(1, 2)
    tail = rows[nh * K + n * (K - 1):].view(len(ck), K - 1, C).transpose(1, 2)
    return y, state, [(slot, tail[m]) for m, (_, _, slot) in enumerate(ck)]


def _per_sequence(x, w, hist, live, cu, lens, ckpts):
    """`_shifted`'s results with one grouped `conv1d` per sequence over [history | chunk] (the earlier form)."""
    C, K = w.shape
    y = torch.zeros(x.shape, dtype=x.dtype)
    new_state = torch.empty_like(hist)
    ckpt_writes = []
    for i, b in enumerate(live):
        full = torch.cat([hist[i], x[cu[b]:cu[b + 1]].t()], dim=1)  # [C, K-1+L]
        if lens[b]:
            y[cu[b]:cu[b + 1]] = F.conv1d(full[None], w[:, None, :], groups=C)[0].t()
        new_state[i] = full[:, lens[b]:lens[b] + K - 1]
        ckpt_writes += [(slot, full[:, off:off + K - 1]) for off, slot in ckpts.get(b, [])]
    return y, new_state, ckpt_writes
