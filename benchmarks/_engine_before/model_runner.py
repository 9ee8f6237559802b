"""ModelRunner: turns a SchedulerOutput into device tensors and runs the forward pass.

Inputs are built without a Python loop over tokens (per-sequence loops only, over block tables)
and copied into persistent, fixed-capacity buffers, so a decode step always reads the same
addresses (what CUDA-graph capture needs).
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from _engine_before.scheduler import SchedulerOutput
from k3serve.workers.engine.cache_layout import CacheLayout
from k3serve.workers.engine.forward_batch import ForwardBatch

log = logging.getLogger(__name__)


class InputBuffers:
    """Fixed-capacity device buffers; `view(T, B)` hands out the leading slices."""

    def __init__(self, layout: CacheLayout, max_tokens: int, max_seqs: int, max_blocks: int, device):
        i64 = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(max_tokens, **i64)
        self.positions = torch.zeros(max_tokens, **i64)
        self.cu_seqlens = torch.zeros(max_seqs + 1, **i64)
        self.seq_lens = torch.zeros(max_seqs, **i64)
        self.has_initial_state = torch.zeros(max_seqs, dtype=torch.bool, device=device)
        self.block_tables = [torch.zeros(max_seqs, max_blocks, dtype=torch.int32, device=device)
                             for _ in layout.mla_groups]
        self.slot_mapping = [torch.zeros(max_tokens, **i64) for _ in layout.mla_groups]
        self.state_indices = [torch.zeros(max_seqs, **i64) for _ in layout.kda_groups]
        self.logits_indices = torch.zeros(max_seqs, **i64)
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks


class InputPreparer:
    """SchedulerOutput -> ForwardBatch (views of the persistent buffers)."""

    def __init__(self, layout: CacheLayout, device, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int):
        self.layout = layout
        self.device = torch.device(device)
        self.max_blocks = math.ceil(max_model_len / layout.block_size)
        self.buf = InputBuffers(layout, max_num_batched_tokens, max_num_seqs, self.max_blocks, self.device)

    def prepare_decode(self, sched: SchedulerOutput | None, size: int) -> ForwardBatch:
        """A decode-only step as a fixed-shape batch of `size` rows (same buffers, same shapes every
        time, full-width block tables). Rows past the real ones are padding: state slots -1 (the
        KDA ops skip them), cache slots -1 (not written), one context token read from the never-
        allocated null block 0. `sched=None` gives an all-padding batch (graph capture)."""
        chunks = sched.chunks if sched is not None else []
        n = len(chunks)
        buf, B = self.buf, self.layout.block_size
        pos = np.zeros(size, dtype=np.int64)
        pos[:n] = np.fromiter((c.start for c in chunks), dtype=np.int64, count=n)
        ids = np.zeros(size, dtype=np.int64)
        ids[:n] = np.fromiter((c.token_ids[0] for c in chunks), dtype=np.int64, count=n)
        ar = np.arange(size + 1, dtype=np.int64)

        def put(dst: torch.Tensor, src: np.ndarray) -> torch.Tensor:
            out = dst[: len(src)]
            out.copy_(torch.from_numpy(src), non_blocking=True)
            return out

        input_ids = put(buf.input_ids, ids)
        pos_t = put(buf.positions, pos)
        cu_t = put(buf.cu_seqlens, ar)
        seq = np.ones(size, dtype=np.int64)
        seq[:n] = pos[:n] + 1
        seq_lens = put(buf.seq_lens, seq)
        init = np.zeros(size, dtype=bool)
        init[:n] = [c.plan.has_initial_state for c in chunks]
        has_init = buf.has_initial_state[:size]
        has_init.copy_(torch.from_numpy(init))
        block_tables, slot_mapping = [], []
        for gi in range(len(self.layout.mla_groups)):
            bt = np.zeros((size, self.max_blocks), dtype=np.int32)
            for r, c in enumerate(chunks):
                row = c.plan.mla_block_ids[gi]
                bt[r, : len(row)] = row
            slots = np.full(size, -1, dtype=np.int64)
            slots[:n] = bt[np.arange(n), pos[:n] // B].astype(np.int64) * B + pos[:n] % B
            bt_t = buf.block_tables[gi][:size]
            bt_t.copy_(torch.from_numpy(bt))
            block_tables.append(bt_t)
            slot_mapping.append(put(buf.slot_mapping[gi], slots))
        state_indices = []
        for gi in range(len(self.layout.kda_groups)):
            si = np.full(size, -1, dtype=np.int64)
            si[:n] = np.fromiter((c.plan.kda_slots[gi] for c in chunks), np.int64, n)
            state_indices.append(put(buf.state_indices[gi], si))
        logits_idx = put(buf.logits_indices, ar[:size])
        return ForwardBatch(input_ids, pos_t, cu_t, seq_lens, block_tables, slot_mapping, state_indices,
                            has_init, None, None, None, logits_idx, is_decode=True)

    def prepare(self, sched: SchedulerOutput) -> ForwardBatch:
        chunks = sched.chunks
        nseq = len(chunks)
        qlens = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64, count=nseq)
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=nseq)
        T = int(qlens.sum())
        cu = np.zeros(nseq + 1, dtype=np.int64)
        np.cumsum(qlens, out=cu[1:])
        ids = np.fromiter((t for c in chunks for t in c.token_ids), dtype=np.int64, count=T)
        seq_of_tok = np.repeat(np.arange(nseq), qlens)
        positions = np.repeat(starts, qlens) + (np.arange(T) - np.repeat(cu[:-1], qlens))
        buf = self.buf
        dev = self.device

        def put(dst: torch.Tensor, src: np.ndarray) -> torch.Tensor:
            out = dst[: len(src)]
            out.copy_(torch.from_numpy(src), non_blocking=True)
            return out

        input_ids = put(buf.input_ids, ids)
        pos_t = put(buf.positions, positions)
        cu_t = put(buf.cu_seqlens, cu)
        seq_lens = put(buf.seq_lens, starts + qlens)
        has_init = buf.has_initial_state[:nseq]
        has_init.copy_(torch.tensor([c.plan.has_initial_state for c in chunks], dtype=torch.bool))
        B = self.layout.block_size
        block_tables, slot_mapping = [], []
        for gi in range(len(self.layout.mla_groups)):
            width = max(len(c.plan.mla_block_ids[gi]) for c in chunks)
            bt = np.zeros((nseq, width), dtype=np.int32)
            for r, c in enumerate(chunks):
                row = c.plan.mla_block_ids[gi]
                bt[r, : len(row)] = row
            slots = bt[seq_of_tok, positions // B].astype(np.int64) * B + positions % B
            bt_t = buf.block_tables[gi][:nseq, :width]
            bt_t.copy_(torch.from_numpy(bt))
            block_tables.append(bt_t)
            slot_mapping.append(put(buf.slot_mapping[gi], slots))
        state_indices = []
        for gi in range(len(self.layout.kda_groups)):
            state_indices.append(put(buf.state_indices[gi],
                                     np.fromiter((c.plan.kda_slots[gi] for c in chunks), np.int64, nseq)))
        ck_seq, ck_off, ck_slots = [], [], [[] for _ in self.layout.kda_groups]
        for r, c in enumerate(chunks):
            for off, slots in c.plan.checkpoints:
                ck_seq.append(r)
                ck_off.append(off)
                for gi, s in enumerate(slots):
                    ck_slots[gi].append(s)
        sample_rows = np.fromiter((cu[r + 1] - 1 for r, c in enumerate(chunks) if c.sample), np.int64)
        logits_idx = put(buf.logits_indices, sample_rows)
        if ck_seq:
            lt = dict(dtype=torch.long, device=dev)
            ckpt = (torch.tensor(ck_seq, **lt), torch.tensor(ck_off, **lt),
                    [torch.tensor(s, **lt) for s in ck_slots])
        else:
            ckpt = (None, None, None)
        return ForwardBatch(input_ids, pos_t, cu_t, seq_lens, block_tables, slot_mapping, state_indices,
                            has_init, ckpt[0], ckpt[1], ckpt[2], logits_idx,
                            is_decode=T == nseq and not ck_seq)
