"""The KDA short convolution on the CPU: one depthwise `conv1d` per prefill chunk, decode rows together.

Same contract as `k3serve.kernels.reference.causal_conv1d_varlen` (see it). The reference multiplies
every unfolded window out per sequence; here each sequence of several tokens is one grouped `conv1d`
over [history | chunk], and all one-token sequences (decode rows of a mixed step) are one batched
window product. Histories are read before anything is written; final states first, checkpoints after.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..reference import causal_conv1d_varlen as _reference
from ..reference._varlen import bool_list, checkpoints_by_seq, compute_dtype, int_list, seq_starts


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
    C, K = w.shape
    cu = seq_starts(cu_seqlens)
    B = len(cu) - 1
    slots = int_list(state_indices, B, "state_indices")
    init = bool_list(has_initial_state, B, "has_initial_state")
    lens = [cu[b + 1] - cu[b] for b in range(B)]
    ckpts = checkpoints_by_seq(checkpoint_seq, checkpoint_offsets, checkpoint_slots, lens, min_offset=0)
    live = [b for b in range(B) if slots[b] >= 0]
    if len({slots[b] for b in live}) != len(live):
        return _reference(x, weight, conv_states, state_indices, cu_seqlens, has_initial_state, **kw)
    wd = w.to(dt)
    silu = activation == "silu"
    y = torch.zeros(x.shape, dtype=dt)
    if not live:
        return y
    idx = torch.tensor([slots[b] for b in live])
    hist = conv_states.index_select(0, idx)  # [n, C, K-1]: every history read before any write
    if not all(init[b] for b in live):
        hist = torch.where(torch.tensor([init[b] for b in live])[:, None, None], hist, 0)
    ones = [i for i, b in enumerate(live) if lens[b] == 1 and b not in ckpts]
    new_state = torch.empty_like(hist)
    ckpt_writes = []
    if ones:
        r = torch.tensor(ones)
        tok = torch.tensor([cu[live[i]] for i in ones])
        full = torch.cat([hist[r], x[tok][:, :, None]], dim=2)  # [m, C, K]
        out = (full * wd).sum(-1)
        y[tok] = F.silu(out) if silu else out
        new_state[r] = full[:, :, 1:]
    one_set = set(ones)
    for i, b in enumerate(live):
        if i in one_set:
            continue
        full = torch.cat([hist[i], x[cu[b]:cu[b + 1]].t()], dim=1)  # [C, K-1+L]
        if lens[b]:
            out = F.conv1d(full[None], wd[:, None, :], groups=C)[0]  # [C, L]
            y[cu[b]:cu[b + 1]] = (F.silu(out) if silu else out).t()
        new_state[i] = full[:, lens[b]:lens[b] + K - 1]
        ckpt_writes += [(slot, full[:, off:off + K - 1]) for off, slot in ckpts.get(b, [])]
    conv_states.index_copy_(0, idx, new_state)
    for slot, val in ckpt_writes:
        conv_states[slot].copy_(val)
    return y
