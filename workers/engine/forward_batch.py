"""ForwardBatch: the device tensors of one step, as the model consumes them (plain data)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """Device tensors for one step (views into the runner's persistent buffers)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    cu_seqlens: torch.Tensor  # [B+1] int64
    seq_lens: torch.Tensor  # [B] context length after this step
    block_tables: list[torch.Tensor]  # per MLA group [B, max_blocks] int32
    slot_mapping: list[torch.Tensor]  # per MLA group [T] int64
    state_indices: list[torch.Tensor]  # per KDA group [B] int64
    has_initial_state: torch.Tensor  # [B] bool
    checkpoint_seq: torch.Tensor | None  # [N] int64
    checkpoint_offsets: torch.Tensor | None  # [N] int64
    checkpoint_slots: list[torch.Tensor] | None  # per KDA group [N] int64
    logits_indices: torch.Tensor  # [S] rows whose logits are needed
    is_decode: bool = False  # one token per sequence and no checkpoints: the fused decode path applies
    spec: object | None = None  # a verify step's workers/engine/spec/rollback.py SpecBatch (None: none)
    # host copy of the longest sequence's token count in this step (None: unknown); ops route on it without
    # reading cu_seqlens back from the device (workers/engine/k3_forward.py `_short_rows`)
    max_query_len: int | None = None
    # per KDA group, host copies of that group's index arguments (kernels/reference/_varlen.py HostVarlen; None:
    # not built): the Triton chunked KDA builds its chunk grid from them instead of reading the tensors back
    kda_host: list | None = None
