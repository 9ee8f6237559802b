"""Verify steps as fixed-shape batches, captured in CUDA graphs on CUDA (multi-slot rollback only).

A step whose every chunk is a verify chunk (1 + k' tokens, 1 <= k' <= k; no prefill, no plain decode, no
schedule-time snapshot export) runs as a batch of `size` rows of T = 1 + k tokens each, `size` the smallest
capture size (workers/engine/model_runner.py `capture_sizes`) >= the number of requests; rows past the
real ones are padding (state slots -1, so the KDA ops skip them; cache slots -1; their context reads the
never-allocated null block 0; their exports repeat row 0's first one). The batch always lives in the same persistent buffers
and carries the same number of checkpoint exports (offsets 1..k of every row into its multi-slot
blocks, workers/engine/spec/rollback.py), so on CUDA one graph per size is captured and replayed, as the
decode graphs are. A chunk with k' < k drafts is padded with copies of its last token: their cache
slots are -1 (never written), they only attend causally after the real tokens, and the state they move
the running KDA block to is always replaced by the commit (accepted_len <= 1 + k' < T); the logits (and
hidden states) of the real rows are gathered back into the eager path's order. Before a size is captured its first warm-up runs with CUDA's sync debug mode "error":
a verify step that waits for the host switches these graphs off (one warning) and verify steps run eagerly.
On the CPU (`static_decode=True`) the same fixed-shape batch runs eagerly (what the tests check).
With the MTP drafter the graph also keeps the pre-final-norm hidden states of every row.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from k3serve.workers.engine.forward_batch import ForwardBatch
from k3serve.workers.engine.spec.rollback import SpecBatch, VerifyRow

log = logging.getLogger(__name__)


class StaticVerify:
    def __init__(self, runner, num_speculative_tokens: int, max_num_seqs: int, max_batch: int = 256):
        from k3serve.workers.engine.model_runner import capture_sizes

        self.r = runner
        self.k = num_speculative_tokens
        self.T = num_speculative_tokens + 1
        buf = runner.inputs.buf
        limit = min(max_num_seqs, buf.max_tokens // self.T, buf.max_seqs, max_batch)
        self.sizes = capture_sizes(limit) if limit >= 1 else []
        dev = runner.device
        n = max(self.sizes or [0]) * self.k
        lt = dict(dtype=torch.long, device=dev)
        self.ck_seq = torch.zeros(n, **lt)
        self.ck_off = torch.zeros(n, **lt)
        self.ck_slots = [torch.zeros(n, **lt) for _ in runner.layout.kda_groups]
        self.enabled = bool(self.sizes)
        self.graphs: dict[int, tuple] = {}
        self.num_steps = 0  # verify steps served by this fixed-shape path

    def eligible(self, sched) -> bool:
        spec, T = sched.spec_token_ids, self.T
        cap = self.r.inputs.max_blocks * self.r.layout.block_size
        return (self.enabled and len(sched.chunks) <= self.sizes[-1]
                and all(c.request_id in spec and 2 <= len(c.token_ids) <= T and not c.checkpoints
                        and c.start + T <= cap for c in sched.chunks))

    def execute(self, sched) -> torch.Tensor | None:
        """Logits [n * T, V] for the step, or None when the eager path must run it."""
        if not self.eligible(sched):
            return None
        n = len(sched.chunks)
        size = next(s for s in self.sizes if s >= n)
        T = self.T
        full = all(len(c.token_ids) == T for c in sched.chunks)
        idx = None if full else torch.tensor([i * T + j for i, c in enumerate(sched.chunks)
                                              for j in range(len(c.token_ids))], device=self.r.device)
        model = self.r.model
        if self.r.device.type != "cuda":
            logits = model.forward(self.prepare(sched, size))
            hidden = model.hidden if model.keep_hidden else None
        else:
            graph = self.graphs.get(size) or self._capture(size)
            if graph is None:
                return None
            cuda_graph, logits, hidden = graph
            self.prepare(sched, size)
            cuda_graph.replay()
        self.num_steps += 1
        if hidden is not None:  # the real rows, packed per chunk as the eager path gives them
            model.hidden = hidden[: n * T] if full else hidden[idx]
        return logits[: n * T] if full else logits[idx]

    def prepare(self, sched, size: int) -> ForwardBatch:
        """The fixed-shape batch of `size` rows (sched None: all padding) in the persistent buffers; records
        the step's VerifyRows for the rollback commit."""
        r, T, k = self.r, self.T, self.k
        inp = r.inputs
        buf, tb, B = inp.buf, inp.tables, r.layout.block_size
        chunks = sched.chunks if sched is not None else []
        n = len(chunks)
        rows = tb.rows(chunks)
        starts = np.zeros(size, dtype=np.int64)
        starts[:n] = np.fromiter((c.start for c in chunks), dtype=np.int64, count=n)
        ids = np.zeros(size * T, dtype=np.int64)
        real_tok = np.zeros(size * T, dtype=bool)  # the chunks' own tokens (not padding rows, not pad tokens)
        for i, c in enumerate(chunks):
            m = len(c.token_ids)
            ids[i * T:i * T + m] = c.token_ids
            ids[i * T + m:(i + 1) * T] = c.token_ids[-1]
            real_tok[i * T:i * T + m] = True
        offs = np.tile(np.arange(T, dtype=np.int64), size)
        pos = np.repeat(starts, T) + offs

        def put(dst: torch.Tensor, src: np.ndarray) -> torch.Tensor:
            out = dst[: len(src)]
            out.copy_(torch.from_numpy(src))
            return out

        input_ids = put(buf.input_ids, ids)
        pos_t = put(buf.positions, pos)
        cu_t = put(buf.cu_seqlens, np.arange(size + 1, dtype=np.int64) * T)
        seq = np.full(size, T, dtype=np.int64)
        seq[:n] = starts[:n] + T
        seq_lens = put(buf.seq_lens, seq)
        init = np.zeros(size, dtype=bool)
        init[:n] = starts[:n] > 0
        has_init = buf.has_initial_state[:size]
        has_init.copy_(torch.from_numpy(init))
        block_tables, slot_mapping = [], []
        seq_of_tok = np.repeat(np.arange(size), T)
        for gi in range(len(r.layout.mla_groups)):
            bt = np.zeros((size, inp.max_blocks), dtype=np.int32)
            bt[:n] = tb.mla[gi][rows]
            slots = np.full(size * T, -1, dtype=np.int64)
            m = real_tok
            slots[m] = bt[seq_of_tok[m], pos[m] // B].astype(np.int64) * B + pos[m] % B
            bt_t = buf.block_tables[gi][:size]
            bt_t.copy_(torch.from_numpy(bt))
            block_tables.append(bt_t)
            slot_mapping.append(put(buf.slot_mapping[gi], slots))
        state_indices = []
        for gi in range(len(r.layout.kda_groups)):
            si = np.full(size, -1, dtype=np.int64)
            si[:n] = tb.kda[gi][rows]
            state_indices.append(put(buf.state_indices[gi], si))
        # every row exports offsets 1..k into its blocks; a padding row's k exports repeat row 0's first one
        # (the same state into the same block: the count stays fixed, no op sees an export of a skipped row)
        seqs = np.repeat(np.arange(size, dtype=np.int64), k)
        offsets = np.tile(np.arange(1, T, dtype=np.int64), size)
        seqs[n * k:], offsets[n * k:] = 0, 1
        ck_seq = put(self.ck_seq, seqs)
        ck_off = put(self.ck_off, offsets)
        verify_rows = []
        for i, c in enumerate(chunks):
            # num_tokens = T even for a padded chunk: its running block ends after the pad tokens, so the
            # commit always copies the accepted export (accepted_len <= len(c.token_ids) < T)
            verify_rows.append(VerifyRow(c.request_id, i, c.start, T, [int(t[rows[i]]) for t in tb.kda],
                                         sched.spec_slots[c.request_id]))
        ck_slots = []
        for gi in range(len(r.layout.kda_groups)):
            s = np.zeros(size * k, dtype=np.int64)
            for i, v in enumerate(verify_rows):
                s[i * k:(i + 1) * k] = v.spec_slots[gi][:k]
            s[n * k:] = s[0]
            ck_slots.append(put(self.ck_slots[gi], s))
        r._verify_rows = {v.request_id: v for v in verify_rows}
        logits_idx = put(buf.logits_indices, np.arange(size * T, dtype=np.int64))
        return ForwardBatch(input_ids, pos_t, cu_t, seq_lens, block_tables, slot_mapping, state_indices, has_init,
                            ck_seq, ck_off, ck_slots, logits_idx, is_decode=False, spec=SpecBatch(verify_rows))

    def _capture(self, size: int):
        r = self.r
        batch = self.prepare(None, size)
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                reason = r._host_sync_in_step(batch)
                if reason is None:
                    r.model.forward(batch)
            torch.cuda.current_stream().wait_stream(stream)
            if reason is None:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=r._graph_pool):
                    logits = r.model.forward(batch)
                r._graph_pool = graph.pool()
        except RuntimeError as e:  # an op that cannot be captured: verify steps stay eager
            reason = str(e).splitlines()[0][:200]
        if reason is not None:
            self.enabled = False
            log.warning("CUDA graphs off for verify steps (%s); verify steps run eagerly", reason)
            return None
        hidden = r.model.hidden if r.model.keep_hidden else None
        self.graphs[size] = (graph, logits, hidden)
        return self.graphs[size]
