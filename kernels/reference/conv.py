"""Depthwise causal short convolution over a flattened variable-length batch with a slot-addressed state pool."""

from __future__ import annotations

import torch

from ._varlen import bool_list, checkpoints_by_seq, compute_dtype, int_list, seq_starts

_ACTIVATIONS = ("silu", None, "none", "identity")


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
    """Causal depthwise conv1d (no bias) of all sequences of a batch; updates `conv_states` in place.

    Shapes: x [T, C] raw pre-conv inputs, sequences concatenated per `cu_seqlens` [B+1];
    weight [C, K] (a [C, 1, K] conv weight is accepted too); conv_states [num_slots, C, K-1] ("DS"
    layout: per channel the last K-1 raw inputs, oldest first), any float dtype.

    Sequence b reads slot `state_indices[b]` as its history (zeros when `has_initial_state[b]` is False;
    None means all False) and afterwards that slot holds the last K-1 raw inputs of history + chunk.
    y_t[c] = act(sum_j weight[c, j] * x_{t-K+1+j}[c]) with act = SiLU ("silu") or identity
    (None / "none" / "identity"). A negative state index marks a padded sequence: its output rows are
    zero and no slot is read or written.

    Checkpoints (LongTensor [N] each, or all None): conv_states[checkpoint_slots[n]] receives the K-1 raw
    inputs ending after `checkpoint_offsets[n]` (in [0, len]) tokens of sequence `checkpoint_seq[n]`'s
    chunk, history rows included when the offset is < K-1. All slots are read before any is written;
    checkpoint writes happen after the final-state writes.

    Returns y [T, C] in x's dtype (fp32 math, fp64 when x is fp64).
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {activation!r}")
    if weight.dim() == 3:
        weight = weight.squeeze(1)
    C, K = weight.shape
    if x.dim() != 2 or x.shape[1] != C or tuple(conv_states.shape[1:]) != (C, K - 1):
        raise ValueError(
            f"shape mismatch: x {tuple(x.shape)}, weight {tuple(weight.shape)}, conv_states {tuple(conv_states.shape)}"
        )
    cu = seq_starts(cu_seqlens)
    B = len(cu) - 1
    slots = int_list(state_indices, B, "state_indices")
    init = bool_list(has_initial_state, B, "has_initial_state")
    lens = [cu[b + 1] - cu[b] for b in range(B)]
    ckpts = checkpoints_by_seq(checkpoint_seq, checkpoint_offsets, checkpoint_slots, lens, min_offset=0)

    dt = compute_dtype(x)
    w = weight.to(dt)
    y = torch.zeros(x.shape, dtype=dt, device=x.device)
    zeros = torch.zeros(C, K - 1, dtype=dt, device=x.device)
    # Read every history before writing anything (a slot may be both read and written in one batch).
    hist = [conv_states[s].to(dt) if (s >= 0 and init[b]) else zeros for b, s in enumerate(slots)]
    writes: list[tuple[int, torch.Tensor]] = []
    ckpt_writes: list[tuple[int, torch.Tensor]] = []
    for b in range(B):
        if slots[b] < 0:
            continue
        full = torch.cat([hist[b], x[cu[b] : cu[b + 1]].to(dt).t()], dim=1)  # [C, K-1+L]
        if lens[b] > 0:
            win = full.unfold(1, K, 1)  # [C, L, K]: window of output t = full[:, t : t+K]
            out = (win * w[:, None, :]).sum(-1)
            if activation == "silu":
                out = torch.nn.functional.silu(out)
            y[cu[b] : cu[b + 1]] = out.t()
        writes.append((slots[b], full[:, lens[b] : lens[b] + K - 1]))
        for off, slot in ckpts.get(b, []):
            ckpt_writes.append((slot, full[:, off : off + K - 1]))
    for slot, val in writes + ckpt_writes:
        conv_states[slot].copy_(val.to(conv_states.dtype))
    return y.to(x.dtype)
