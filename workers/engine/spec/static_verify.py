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
from k3serve.workers.engine.spec.staging import Staging

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
        self._staging: dict[int, Staging] = {}  # per size: its inputs, one host->device copy a step
        self._const: dict[int, dict] = {}  # per size: index patterns (`_consts`)
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
        model = self.r.model
        if self.r.device.type != "cuda":
            batch, m = self.prepare(sched, size)
            logits = model.forward(batch)
            hidden = model.hidden if model.keep_hidden else None
        else:
            graph = self.graphs.get(size) or self._capture(size)
            if graph is None:
                return None
            cuda_graph, logits, hidden = graph
            _batch, m = self.prepare(sched, size)
            cuda_graph.replay()
        self.num_steps += 1
        if m == n * T:  # every chunk 1 + k tokens: the real rows are the first n * T
            if hidden is not None:
                model.hidden = hidden[:m]
            return logits[:m]
        idx = self._staged(size)["gather"][:m]  # the real rows, packed per chunk as the eager path gives them
        if hidden is not None:
            model.hidden = hidden[idx]
        return logits[idx]

    def _consts(self, size: int) -> dict:
        """`prepare`'s index patterns that depend on the size only (made once per size)."""
        c = self._const.get(size)
        if c is None:
            T, k = self.T, self.k
            c = self._const[size] = dict(
                tok=np.arange(size * T, dtype=np.int64), offs=np.tile(np.arange(T, dtype=np.int64), size),
                cu=np.arange(size + 1, dtype=np.int64) * T, seq_of_tok=np.repeat(np.arange(size), T),
                ck_seq=np.repeat(np.arange(size, dtype=np.int64), k),
                ck_off=np.tile(np.arange(1, T, dtype=np.int64), size))
        return c

    def _staged(self, size: int) -> dict:
        """The device views of `size`'s staging buffer (workers/engine/spec/staging.py; one per size, so each
        size's graph reads its own fixed addresses)."""
        st = self._staging.get(size)
        if st is None:
            r, T, k = self.r, self.T, self.k
            i64, mla, kda = torch.int64, len(r.layout.mla_groups), len(r.layout.kda_groups)
            f = dict(input_ids=(i64, (size * T,)), positions=(i64, (size * T,)), cu_seqlens=(i64, (size + 1,)),
                     seq_lens=(i64, (size,)), ck_seq=(i64, (size * self.k,)), ck_off=(i64, (size * k,)),
                     logits_idx=(i64, (size * T,)), gather=(i64, (size * T,)),
                     has_init=(torch.bool, (size,)))
            for g in range(mla):
                f[f"bt{g}"] = (torch.int32, (size, r.inputs.max_blocks))
                f[f"slots{g}"] = (i64, (size * T,))
            for g in range(kda):
                f[f"si{g}"] = (i64, (size,))
                f[f"ck_slots{g}"] = (i64, (size * k,))
            st = self._staging[size] = Staging(f, r.device)
        return st.dev

    def prepare(self, sched, size: int) -> tuple[ForwardBatch, int]:
        """The fixed-shape batch of `size` rows (sched None: all padding) in `size`'s staging buffer, sent to the
        device in one copy; records the step's VerifyRows for the rollback commit. Also returns the number of
        real token rows (their indices in the batch are the staged `gather` field)."""
        r, T, k = self.r, self.T, self.k
        inp = r.inputs
        tb, B = inp.tables, r.layout.block_size
        chunks = sched.chunks if sched is not None else []
        n = len(chunks)
        rows = tb.rows(chunks)
        dev = self._staged(size)
        st = self._staging[size]
        h = st.host()
        starts = np.zeros(size, dtype=np.int64)
        starts[:n] = np.fromiter((c.start for c in chunks), dtype=np.int64, count=n)
        ids = h["input_ids"]
        ids[:] = 0
        real_tok = np.zeros(size * T, dtype=bool)  # the chunks' own tokens (not padding rows, not pad tokens)
        for i, c in enumerate(chunks):
            m = len(c.token_ids)
            ids[i * T:i * T + m] = c.token_ids
            ids[i * T + m:(i + 1) * T] = c.token_ids[-1]
            real_tok[i * T:i * T + m] = True
        cst = self._consts(size)
        full = all(len(c.token_ids) == T for c in chunks)
        real = cst["tok"][:n * T] if full else np.flatnonzero(real_tok)  # (every chunk 1 + k tokens: the first n*T)
        h["gather"][:len(real)] = real
        pos = h["positions"]
        np.add(np.repeat(starts, T), cst["offs"], out=pos)
        h["cu_seqlens"][:] = cst["cu"]
        seq = h["seq_lens"]
        seq[:] = T
        seq[:n] = starts[:n] + T
        init = h["has_init"]
        init[:] = False
        init[:n] = starts[:n] > 0
        seq_of_tok = cst["seq_of_tok"]
        for gi in range(len(r.layout.mla_groups)):
            bt = h[f"bt{gi}"]
            bt[:] = 0
            bt[:n] = tb.mla[gi][rows]
            slots = h[f"slots{gi}"]
            slots[:] = -1
            p = pos[real]
            slots[real] = bt[seq_of_tok[real], p // B].astype(np.int64) * B + p % B
        for gi in range(len(r.layout.kda_groups)):
            si = h[f"si{gi}"]
            si[:] = -1
            si[:n] = tb.kda[gi][rows]
        # every row exports offsets 1..k into its blocks; a padding row's k exports repeat row 0's first one
        # (the same state into the same block: the count stays fixed, no op sees an export of a skipped row)
        seqs, offsets = h["ck_seq"], h["ck_off"]
        seqs[:] = cst["ck_seq"]
        offsets[:] = cst["ck_off"]
        seqs[n * k:], offsets[n * k:] = 0, 1
        verify_rows = []
        for i, c in enumerate(chunks):
            # num_tokens = T even for a padded chunk: its running block ends after the pad tokens, so the
            # commit always copies the accepted export (accepted_len <= len(c.token_ids) < T)
            verify_rows.append(VerifyRow(c.request_id, i, c.start, T, [int(t[rows[i]]) for t in tb.kda],
                                         sched.spec_slots[c.request_id]))
        for gi in range(len(r.layout.kda_groups)):
            s = h[f"ck_slots{gi}"]
            s[:] = 0
            for i, v in enumerate(verify_rows):
                s[i * k:(i + 1) * k] = v.spec_slots[gi][:k]
            s[n * k:] = s[0]
        r._verify_rows = {v.request_id: v for v in verify_rows}
        h["logits_idx"][:] = cst["tok"]
        st.send()
        mla, kda = range(len(r.layout.mla_groups)), range(len(r.layout.kda_groups))
        batch = ForwardBatch(dev["input_ids"], dev["positions"], dev["cu_seqlens"], dev["seq_lens"],
                             [dev[f"bt{g}"] for g in mla], [dev[f"slots{g}"] for g in mla],
                             [dev[f"si{g}"] for g in kda], dev["has_init"], dev["ck_seq"], dev["ck_off"],
                             [dev[f"ck_slots{g}"] for g in kda], dev["logits_idx"], is_decode=False,
                             spec=SpecBatch(verify_rows))
        if hasattr(batch, "max_query_len"):  # a host field some kernels route on (workers/engine/forward_batch.py)
            batch.max_query_len = T
        return batch, len(real)

    def _capture(self, size: int):
        r = self.r
        batch, _m = self.prepare(None, size)
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
