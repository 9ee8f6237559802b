"""Shared plumbing of the reference ops: compute dtype, variable-length batches, slots and checkpoints.

Plain data only; nothing here touches a state pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

SKIP_NOOP_CASTS = True
"""`cast` returns a tensor that already has the wanted dtype as it is (False: always `Tensor.to`, the earlier form,
for benchmarks): a no-op `Tensor.to` still costs about 1-2 us of argument parsing and dispatch on the CPU, and a
decode step made hundreds of them."""


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)` (same values, same aliasing), skipping the call when x already is `dtype`."""
    if SKIP_NOOP_CASTS and x.dtype == dtype:
        return x
    return x.to(dtype)


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any given tensor is float64, else float32 (the reference ops' arithmetic dtype)."""
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def seq_starts(cu_seqlens: torch.Tensor | Sequence[int]) -> list[int]:
    """`cu_seqlens` int32/int64 [B+1] (non-decreasing, cu[0] == 0) -> Python list of B+1 offsets."""
    cu = [int(v) for v in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu}")
    return cu


def int_list(t: torch.Tensor | Sequence[int], n: int, what: str) -> list[int]:
    """A length-n integer tensor/sequence -> Python list (validates the length)."""
    vals = [int(v) for v in (t.tolist() if isinstance(t, torch.Tensor) else t)]
    if len(vals) != n:
        raise ValueError(f"{what}: expected {n} entries, got {len(vals)}")
    return vals


def bool_list(t: torch.Tensor | Sequence[bool] | None, n: int, what: str) -> list[bool]:
    """`has_initial_state` bool [B] (None means all False) -> Python list of B bools."""
    if t is None:
        return [False] * n
    vals = [bool(v) for v in (t.tolist() if isinstance(t, torch.Tensor) else t)]
    if len(vals) != n:
        raise ValueError(f"{what}: expected {n} entries, got {len(vals)}")
    return vals


@dataclass(eq=False)
class HostVarlen:
    """Host copies (plain lists) of a variable-length call's index arguments, for ONE cache group of one step.

    The engine has these on the host anyway (workers/engine/model_runner.py `InputPreparer.prepare` writes the device
    tensors from them); a kernel given them (`host=` of `kda_chunked`) builds its launch grid from the lists instead of
    reading the device tensors back, which on CUDA is a host sync each. They must hold the same values as the tensors
    passed beside them. `memo` keeps what a kernel derived from them (kernels/triton/kda_chunk.py: its chunk plan), so
    every layer of the group reuses one build; it lives and dies with the step's batch."""

    cu_seqlens: list[int]
    state_indices: list[int]
    has_initial_state: list[bool]
    checkpoint_seq: list[int] | None = None
    checkpoint_offsets: list[int] | None = None
    checkpoint_slots: list[int] | None = None
    memo: dict = field(default_factory=dict, repr=False)


def checkpoints_by_seq(
    checkpoint_seq: torch.Tensor | None,
    checkpoint_offsets: torch.Tensor | None,
    checkpoint_slots: torch.Tensor | None,
    seq_lens: list[int],
    *,
    min_offset: int,
) -> dict[int, list[tuple[int, int]]]:
    """Group the checkpoint request triples by sequence.

    Returns {b: [(offset, slot), ...]} sorted by offset. Offsets must lie in [min_offset, len_b].
    All three must be given together (LongTensor [N] or lists) or all be None.
    """
    given = [t is not None for t in (checkpoint_seq, checkpoint_offsets, checkpoint_slots)]
    if not any(given):
        return {}
    if not all(given):
        raise ValueError("checkpoint_seq, checkpoint_offsets and checkpoint_slots go together")
    seqs = [int(v) for v in (checkpoint_seq.tolist() if isinstance(checkpoint_seq, torch.Tensor) else checkpoint_seq)]
    n = len(seqs)
    offs = int_list(checkpoint_offsets, n, "checkpoint_offsets")
    slots = int_list(checkpoint_slots, n, "checkpoint_slots")
    out: dict[int, list[tuple[int, int]]] = {}
    for b, off, slot in zip(seqs, offs, slots):
        if not 0 <= b < len(seq_lens):
            raise ValueError(f"checkpoint_seq {b} out of range for {len(seq_lens)} sequences")
        if not min_offset <= off <= seq_lens[b]:
            raise ValueError(
                f"checkpoint offset {off} outside [{min_offset}, {seq_lens[b]}] for sequence {b}"
            )
        if slot < 0:
            raise ValueError(f"checkpoint slot {slot} must be >= 0")
        out.setdefault(b, []).append((off, slot))
    for lst in out.values():
        lst.sort()
    return out
