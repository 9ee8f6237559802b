"""ModelRunner: turns a SchedulerOutput into device tensors and runs the forward pass.

Inputs are built without a Python loop over tokens (per-sequence loops only, over block tables)
and copied into persistent, fixed-capacity buffers, so a decode step always reads the same
addresses (what CUDA-graph capture needs).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch

from k3serve.kernels.reference._varlen import HostVarlen
from k3serve.workers.engine.cache_layout import CacheLayout, KVCacheTensors
from k3serve.workers.engine.forward_batch import ForwardBatch
from k3serve.workers.engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)

# Fixed-shape decode steps also compute each row's argmax token inside the step (in the CUDA graph on CUDA), which
# the engine takes instead of running the sampler when every row is plain greedy (LLMEngine._greedy_ids).
# benchmarks/decode_roofline.py's "graphs-s6" mode turns it off, to time before and after in one process.
GRAPH_GREEDY = True


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
        self.logits_indices = torch.zeros(max(max_seqs, max_tokens), **i64)  # verify steps: 1 + k rows a request
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks


class BlockTables:
    """The runner's copy of every scheduled request's block tables and KDA slots, one row each.

    Kept from the scheduler's deltas (workers/engine/scheduler_output.py): a request's row is
    written once from its `NewRequestData`, extended by each chunk's `new_block_ids`, and dropped
    when its id is in `finished_req_ids` or `preempted`."""

    def __init__(self, num_mla: int, num_kda: int, max_rows: int, max_blocks: int):
        self.mla = [np.zeros((max_rows, max_blocks), dtype=np.int32) for _ in range(num_mla)]
        self.kda = [np.zeros(max_rows, dtype=np.int64) for _ in range(num_kda)]
        self.num_blocks = np.zeros(max_rows, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(max_rows - 1, -1, -1))

    def apply(self, sched: SchedulerOutput) -> None:
        row_of = self.row_of
        for rid in sched.finished_req_ids:
            r = row_of.pop(rid, None)
            if r is not None:
                self.free_rows.append(r)
        for rid in sched.preempted:
            r = row_of.pop(rid, None)
            if r is not None:
                self.free_rows.append(r)
        for nr in sched.new_requests:
            r = row_of.get(nr.request_id)
            if r is None:
                r = self.free_rows.pop()
                row_of[nr.request_id] = r
            n = len(nr.block_ids[0]) if nr.block_ids else 0
            for gi, ids in enumerate(nr.block_ids):
                self.mla[gi][r, :n] = ids
                self.mla[gi][r, n:] = 0  # nothing of the row's previous request stays
            self.num_blocks[r] = n
            for gi, slot in enumerate(nr.kda_slots):
                self.kda[gi][r] = slot
        mla, nb = self.mla, self.num_blocks
        for c in sched.chunks:
            if c.new_block_ids:
                r = row_of[c.request_id]
                n0 = nb[r]
                for gi, ids in enumerate(c.new_block_ids):
                    mla[gi][r, n0:n0 + len(ids)] = ids
                nb[r] = n0 + len(c.new_block_ids[0])

    def rows(self, chunks) -> np.ndarray:
        row_of = self.row_of
        return np.fromiter((row_of[c.request_id] for c in chunks), dtype=np.int64, count=len(chunks))


class DecodeStaging:
    """The inputs of a fixed-shape decode batch packed into ONE byte buffer, so a decode step makes one host->device
    copy (from pinned memory on CUDA, asynchronous) instead of ten pageable ones.

    For a batch of `size` rows the buffer holds, in this order: int64 input ids, positions, cu_seqlens (size+1),
    seq_lens, one slot mapping per MLA group, one state-slot row per KDA group, logits indices; then the
    has-initial-state flags (bool, padded to 8 bytes); then one int32 [size, max_blocks] block table per MLA group.
    Every size starts at offset 0 of the same device buffer, so a captured graph of any size reads fixed addresses
    (only one batch is in flight at a time). On the CPU the host buffer is the device buffer (no copy)."""

    def __init__(self, num_mla: int, num_kda: int, max_size: int, max_blocks: int, device: torch.device):
        self.num_mla, self.num_kda, self.max_blocks = num_mla, num_kda, max_blocks
        nbytes = self.nbytes(max_size)
        self.device_buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        if device.type == "cuda":  # two pinned host buffers, each reused only after its last copy has run
            self.host_bufs = [torch.zeros(nbytes, dtype=torch.uint8).pin_memory() for _ in range(2)]
            self.copied = [None, None]
        else:
            self.host_bufs, self.copied = [self.device_buf], [None]
        self.turn = 0
        self._cache: dict[tuple[int, int], dict] = {}  # (buffer, size) -> its views (made once per size)

    def _n64(self, size: int) -> int:
        return 5 * size + 1 + (self.num_mla + self.num_kda) * size

    def nbytes(self, size: int) -> int:
        return 8 * self._n64(size) + -(-size // 8) * 8 + 4 * self.num_mla * size * self.max_blocks

    def views(self, buf: torch.Tensor, size: int) -> dict:
        """Typed views of `buf` for a batch of `size` rows (see the class docstring for the layout)."""
        n64 = self._n64(size)
        i64 = buf[: 8 * n64].view(torch.int64)
        o = 0

        def take(k: int) -> torch.Tensor:
            nonlocal o
            o += k
            return i64[o - k: o]

        v = dict(input_ids=take(size), positions=take(size), cu_seqlens=take(size + 1), seq_lens=take(size),
                 slot_mapping=[take(size) for _ in range(self.num_mla)],
                 state_indices=[take(size) for _ in range(self.num_kda)], logits_indices=take(size))
        b0 = 8 * n64
        v["has_initial_state"] = buf[b0: b0 + size].view(torch.bool)
        t0 = b0 + -(-size // 8) * 8
        w = size * self.max_blocks
        i32 = buf[t0: t0 + 4 * w * self.num_mla].view(torch.int32)
        v["block_tables"] = [i32[g * w:(g + 1) * w].view(size, self.max_blocks) for g in range(self.num_mla)]
        return v

    def host(self, size: int) -> tuple[dict, int]:
        """Numpy views of the next host buffer (waits for that buffer's previous copy, normally long done)."""
        t = self.turn
        if self.copied[t] is not None:
            self.copied[t].synchronize()
        key = (t, size)
        if key not in self._cache:
            v = self.views(self.host_bufs[t], size)
            self._cache[key] = {k: ([a.numpy() for a in x] if isinstance(x, list) else x.numpy()) for k, x in v.items()}
        return self._cache[key], t

    def send(self, t: int, size: int) -> dict:
        """Copy host buffer `t` (a batch of `size` rows) to the device; returns the device views."""
        if self.host_bufs[t] is not self.device_buf:
            nb = self.nbytes(size)
            self.device_buf[:nb].copy_(self.host_bufs[t][:nb], non_blocking=True)
            ev = self.copied[t] or torch.cuda.Event()
            ev.record()
            self.copied[t] = ev
            self.turn = 1 - t
        key = (-1, size)
        if key not in self._cache:
            self._cache[key] = self.views(self.device_buf, size)
        return self._cache[key]


class InputPreparer:
    """SchedulerOutput -> ForwardBatch (views of the persistent buffers)."""

    def __init__(self, layout: CacheLayout, device, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int):
        self.layout = layout
        self.device = torch.device(device)
        self.max_blocks = math.ceil(max_model_len / layout.block_size)
        self.buf = InputBuffers(layout, max_num_batched_tokens, max_num_seqs, self.max_blocks, self.device)
        self.tables = BlockTables(len(layout.mla_groups), len(layout.kda_groups), max_num_seqs, self.max_blocks)
        self._decode: DecodeStaging | None = None  # made on the first decode batch (its size bounds the rest)
        self._decode_max = max_num_seqs

    def apply(self, sched: SchedulerOutput) -> None:
        """Bring the block tables up to date with this step's deltas (call once per step)."""
        self.tables.apply(sched)

    def prepare_decode(self, sched: SchedulerOutput | None, size: int) -> ForwardBatch:
        """A decode-only step as a fixed-shape batch of `size` rows (same buffers, same shapes every
        time, full-width block tables). Rows past the real ones are padding: state slots -1 (the
        KDA ops skip them), cache slots -1 (not written), one context token read from the never-
        allocated null block 0. `sched=None` gives an all-padding batch (graph capture)."""
        if self._decode is None:
            self._decode = DecodeStaging(len(self.layout.mla_groups), len(self.layout.kda_groups),
                                         self._decode_max, self.max_blocks, self.device)
        if size > self._decode_max:
            raise ValueError(f"a decode batch of {size} rows exceeds max_num_seqs={self._decode_max}")
        chunks = sched.chunks if sched is not None else []
        n = len(chunks)
        B, tb = self.layout.block_size, self.tables
        rows = tb.rows(chunks)
        h, turn = self._decode.host(size)
        pos = h["positions"]
        pos[:n] = np.fromiter((c.start for c in chunks), dtype=np.int64, count=n)
        pos[n:] = 0
        ids = h["input_ids"]
        ids[:n] = np.fromiter((c.token_ids[0] for c in chunks), dtype=np.int64, count=n)
        ids[n:] = 0
        h["cu_seqlens"][:] = np.arange(size + 1, dtype=np.int64)
        h["logits_indices"][:] = h["cu_seqlens"][:size]
        seq = h["seq_lens"]
        seq[:n] = pos[:n] + 1
        seq[n:] = 1
        init = h["has_initial_state"]
        init[:n] = pos[:n] > 0
        init[n:] = False
        for gi in range(len(self.layout.mla_groups)):
            bt = h["block_tables"][gi]
            bt[:n] = tb.mla[gi][rows]
            bt[n:] = 0
            slots = h["slot_mapping"][gi]
            slots[:n] = bt[np.arange(n), pos[:n] // B].astype(np.int64) * B + pos[:n] % B
            slots[n:] = -1
        for gi in range(len(self.layout.kda_groups)):
            si = h["state_indices"][gi]
            si[:n] = tb.kda[gi][rows]
            si[n:] = -1
        d = self._decode.send(turn, size)
        return ForwardBatch(d["input_ids"], d["positions"], d["cu_seqlens"], d["seq_lens"], list(d["block_tables"]),
                            list(d["slot_mapping"]), list(d["state_indices"]), d["has_initial_state"], None, None,
                            None, d["logits_indices"], is_decode=True, max_query_len=1)

    def prepare(self, sched: SchedulerOutput) -> ForwardBatch:
        chunks = sched.chunks
        nseq = len(chunks)
        tb = self.tables
        rows = tb.rows(chunks)
        qlens = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64, count=nseq)
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=nseq)
        T = int(qlens.sum())
        cu = np.zeros(nseq + 1, dtype=np.int64)
        np.cumsum(qlens, out=cu[1:])
        if T == nseq:
            ids = np.fromiter((c.token_ids[0] for c in chunks), dtype=np.int64, count=T)
            seq_of_tok = np.arange(nseq)
            positions = starts
        else:
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
        has_init.copy_(torch.from_numpy(starts > 0))
        B = self.layout.block_size
        block_tables, slot_mapping = [], []
        width = int(tb.num_blocks[rows].max()) if nseq else 0
        for gi in range(len(self.layout.mla_groups)):
            bt = tb.mla[gi][rows, :width]
            slots = bt[seq_of_tok, positions // B].astype(np.int64) * B + positions % B
            bt_t = buf.block_tables[gi][:nseq, :width]
            bt_t.copy_(torch.from_numpy(bt))
            block_tables.append(bt_t)
            slot_mapping.append(put(buf.slot_mapping[gi], slots))
        state_indices = []
        for gi in range(len(self.layout.kda_groups)):
            state_indices.append(put(buf.state_indices[gi], tb.kda[gi][rows]))
        ck_seq, ck_off, ck_slots = [], [], [[] for _ in self.layout.kda_groups]
        for r, c in enumerate(chunks):
            if not c.checkpoints:
                continue
            for off, slots in c.checkpoints:
                ck_seq.append(r)
                ck_off.append(off)
                for gi, s in enumerate(slots):
                    ck_slots[gi].append(s)
        spec = sched.spec_token_ids
        if spec:  # a verify chunk (speculative decoding) needs the logits of every one of its rows
            sample_rows = np.fromiter((i for r, c in enumerate(chunks) if c.sample
                                       for i in (range(cu[r], cu[r + 1]) if c.request_id in spec
                                                 else (cu[r + 1] - 1,))), np.int64)
        else:
            sample_rows = np.fromiter((cu[r + 1] - 1 for r, c in enumerate(chunks) if c.sample), np.int64)
        logits_idx = put(buf.logits_indices, sample_rows)
        if ck_seq:
            lt = dict(dtype=torch.long, device=dev)
            ckpt = (torch.tensor(ck_seq, **lt), torch.tensor(ck_off, **lt),
                    [torch.tensor(s, **lt) for s in ck_slots])
        else:
            ckpt = (None, None, None)
        cu_list, init_list = cu.tolist(), (starts > 0).tolist()
        kda_host = None if not KDA_HOST_LISTS else [HostVarlen(cu_list, tb.kda[gi][rows].tolist(), init_list, ck_seq or None,
                               ck_off or None, ck_slots[gi] if ck_seq else None)
                    for gi in range(len(self.layout.kda_groups))]
        return ForwardBatch(input_ids, pos_t, cu_t, seq_lens, block_tables, slot_mapping, state_indices,
                            has_init, ckpt[0], ckpt[1], ckpt[2], logits_idx,
                            is_decode=T == nseq and not ck_seq, max_query_len=int(qlens.max()) if nseq else 0,
                            kda_host=kda_host)


KDA_HOST_LISTS = True
"""`prepare` gives each KDA group's index arguments as host lists too (ForwardBatch.kda_host): the Triton chunked KDA
builds its plan from them, with no device read-back. False: the kernel reads the tensors back (the earlier form, for
benchmarks/mixed_step.py --set comparisons)."""


class ModelRunner:
    model_class = None  # K3ForwardModel when None; a TP rank's runner sets its own (workers/engine/parallel/)

    def __init__(self, config, weights, layout: CacheLayout, num_blocks: int, dtype: torch.dtype,
                 device: str, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 cuda_graphs: bool | None = None, cuda_graph_max_batch: int = 256):
        from k3serve.workers.engine.k3_forward import K3ForwardModel

        self.layout = layout
        self.kv = KVCacheTensors(layout, num_blocks, torch.device(device))
        self.model = (self.model_class or K3ForwardModel)(config, weights, layout, self.kv, dtype)
        self.inputs = InputPreparer(layout, device, max_num_batched_tokens, max_num_seqs, max_model_len)
        self.device = torch.device(device)
        # Decode-only steps run as a fixed-shape batch padded to a capture size; on CUDA that batch is
        # captured once per size in a CUDA graph and replayed. `cuda_graphs=None`: on for CUDA only.
        self.static_decode = self.device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        self.capture_sizes = capture_sizes(min(max_num_seqs, max_num_batched_tokens, cuda_graph_max_batch))
        self.graphs: dict[int, _Graph] = {}
        self._graph_pool = None
        self.num_static_decode_steps = 0
        self.rollback = None  # speculative decoding: a workers/engine/spec/rollback.py RollbackScheme
        self.static_verify = None  # workers/engine/spec/static_verify.py StaticVerify (fixed-shape verify steps)
        self._verify_rows: dict = {}
        # after a fixed-shape decode step: Tensor[size] int64 on the device, each row's argmax of the step's logits
        # (GRAPH_GREEDY; None after any other step); `take_greedy_ids` reads it
        self.greedy_ids: torch.Tensor | None = None
        self.num_greedy_steps = 0  # steps whose tokens were `take_greedy_ids`' (no sampler)
        self._ids_host: torch.Tensor | None = None  # pinned host copy of greedy_ids (CUDA)
        self._ids_event = None

    def enable_speculation(self, scheme_cls, num_speculative_tokens: int, max_num_seqs: int,
                           keep_hidden: bool) -> None:
        """Verify steps with `scheme_cls` rollback; `keep_hidden`: keep the forward's pre-final-norm states
        (`self.model.hidden`, every row) for the MTP drafter. Verify steps of 1 + k tokens every request
        run as fixed-shape (on CUDA: captured) batches when decode steps do, with multi-slot rollback
        (workers/engine/spec/static_verify.py); with keep_hidden the decode graphs also keep the hidden states."""
        from k3serve.workers.engine.spec.static_verify import StaticVerify

        self.rollback = scheme_cls(self.kv, self.layout, num_speculative_tokens, max_num_seqs)
        self.model.keep_hidden = keep_hidden
        if self.static_decode and self.rollback.name == "multi_slot":
            self.static_verify = StaticVerify(self, num_speculative_tokens, max_num_seqs, self.capture_sizes[-1])

    def commit_speculation(self, commits) -> None:
        """After sampling: (request id, accepted_len, snapshots) per verified request still running."""
        for rid, accepted, snaps in commits:
            self.rollback.commit(self._verify_rows[rid], accepted, snaps)
        if self.rollback is not None:
            self.rollback.end_verify()
        self._verify_rows = {}

    def _begin_verify(self, sched: SchedulerOutput, batch: ForwardBatch) -> None:
        from k3serve.workers.engine.spec.rollback import SpecBatch, VerifyRow

        tb = self.inputs.tables
        rows = []
        for r, c in enumerate(sched.chunks):
            if c.request_id in sched.spec_token_ids:
                row = tb.row_of[c.request_id]
                rows.append(VerifyRow(c.request_id, r, c.start, len(c.token_ids),
                                      [int(t[row]) for t in tb.kda], sched.spec_slots[c.request_id]))
        self._verify_rows = {v.request_id: v for v in rows}
        batch.spec = SpecBatch(rows)
        self.rollback.begin_verify(rows, batch)

    def execute(self, sched: SchedulerOutput) -> torch.Tensor | None:
        """Run one step; returns logits for the chunks with `sample=True`, in chunk order (None for
        a step with no chunks: only the block-table deltas and page copies are applied)."""
        self.greedy_ids = None
        self.inputs.apply(sched)
        self.kv.copy_blocks(sched.copies)
        n = len(sched.chunks)
        if not n:
            return None
        if self.static_decode and n <= self.capture_sizes[-1] and _decode_only(sched):
            size = next(c for c in self.capture_sizes if c >= n)
            if self.device.type != "cuda":
                self.num_static_decode_steps += 1
                logits = self.model.forward(self.inputs.prepare_decode(sched, size))
                if GRAPH_GREEDY:
                    self.greedy_ids = logits.argmax(dim=-1)
                return logits[:n]
            graph = self.graphs.get(size) or self._capture(size)
            if graph is not None:
                self.num_static_decode_steps += 1
                self.inputs.prepare_decode(sched, size)
                graph.graph.replay()
                if graph.hidden is not None:  # the MTP drafter reads every row's hidden state
                    self.model.hidden = graph.hidden[:n]
                self.greedy_ids = graph.ids
                return graph.logits[:n]
            # capture refused (the step waits for the host): this step and the next ones run eagerly
        if sched.spec_token_ids and self.static_verify is not None:
            logits = self.static_verify.execute(sched)
            if logits is not None:
                return logits
        batch = self.inputs.prepare(sched)
        if sched.spec_token_ids and self.rollback is not None:
            self._begin_verify(sched, batch)
        return self.model.forward(batch)

    def _capture(self, size: int) -> _Graph | None:
        """Capture the decode step of `size` rows. Warm-up and capture run on an all-padding batch
        (state slots -1, cache slots -1), so no request's state is touched; a replay then reads
        whatever `prepare_decode` wrote into the same persistent buffers.

        The first warm-up runs with CUDA's sync debug mode set to "error": a decode step that waits
        for the host anywhere (an op with no kernel for these shapes or dtypes falls back to a
        reference op that does) cannot be captured, so graphs are switched off for this runner, with
        one warning naming the cause, and decode steps run eagerly (returns None)."""
        batch = self.inputs.prepare_decode(None, size)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in range(2):  # compile the Triton kernels and settle the allocator
                if i == 0:
                    reason = self._host_sync_in_step(batch)
                    if reason is not None:
                        torch.cuda.current_stream().wait_stream(stream)
                        self.static_decode = False
                        log.warning("CUDA graphs off: the decode step synchronizes with the host (%s); "
                                    "decode steps run eagerly", reason)
                        return None
                else:
                    self.model.forward(batch)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            logits = self.model.forward(batch)
            ids = logits.argmax(dim=-1) if GRAPH_GREEDY else None
        self._graph_pool = graph.pool()
        self.graphs[size] = _Graph(graph, batch, logits, self.model.hidden if self.model.keep_hidden else None, ids)
        return self.graphs[size]

    def take_greedy_ids(self, n: int) -> list[int] | None:
        """The last step's first `n` rows' argmax tokens as host ints (None unless that step was a fixed-shape
        decode step with GRAPH_GREEDY): ties go to the lowest id, as the sampler's argmax over its float copy of
        the same logits (the same values), so a plain-greedy row gets the sampler's token. On CUDA one small
        copy into pinned memory, then a wait for it (the step's one host sync). Once per step."""
        ids, self.greedy_ids = self.greedy_ids, None
        if ids is None:
            return None
        self.num_greedy_steps += 1
        if ids.device.type != "cuda":
            return ids[:n].tolist()
        if self._ids_host is None or self._ids_host.numel() < ids.numel():
            self._ids_host = torch.empty(ids.numel(), dtype=ids.dtype).pin_memory()
            self._ids_event = torch.cuda.Event()
        host = self._ids_host[:n]
        host.copy_(ids[:n], non_blocking=True)
        self._ids_event.record()
        self._ids_event.synchronize()
        return host.tolist()


    def _host_sync_in_step(self, batch: ForwardBatch) -> str | None:
        prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            self.model.forward(batch)
        except RuntimeError as e:
            if "synchroniz" not in str(e):
                raise
            return str(e).splitlines()[0][:200]
        finally:
            torch.cuda.set_sync_debug_mode(prev)
        return None


@dataclass
class _Graph:
    graph: object  # torch.cuda.CUDAGraph
    batch: ForwardBatch
    logits: torch.Tensor
    hidden: torch.Tensor | None = None  # the pre-final-norm states of every row (speculative decoding, MTP)
    ids: torch.Tensor | None = None  # each row's argmax of `logits`, computed in the graph (GRAPH_GREEDY)


def _decode_only(sched: SchedulerOutput) -> bool:
    return all(len(c.token_ids) == 1 and c.sample and not c.checkpoints for c in sched.chunks)


def capture_sizes(limit: int) -> list[int]:
    """Decode batch sizes with a captured graph: 1, 2, 4, 8, then multiples of 8 up to `limit`."""
    sizes = [s for s in (1, 2, 4) if s <= limit] + list(range(8, limit + 1, 8))
    return sizes or [1]
