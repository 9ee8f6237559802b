"""Host time of a decode step's input preparation: ours (`InputPreparer.prepare_decode`, one packed buffer, one
pinned host->device copy: workers/engine/model_runner.py DecodeStaging) against the ten-copy version it replaced
(below, `ten_copies`: one pageable copy per input tensor), in one run, on the `small` preset's cache layout.

    PYTHONSAFEPATH=1 python benchmarks/sweep_decode_inputs.py [--device cpu|cuda] [--batches 1 8 64]

Prints µs per call (median of 300 after 20 warm-up calls) for both, their ratio, and on CUDA also the time of a
call followed by a synchronize (the copies done). On the CPU neither copies anything to a device, so the figure is
the Python/numpy work only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _util import print_table  # noqa: E402

from k3serve.workers.engine.cache_layout import plan_cache_layout  # noqa: E402
from k3serve.workers.engine.forward_batch import ForwardBatch  # noqa: E402
from k3serve.workers.engine.model_runner import InputPreparer  # noqa: E402
from k3serve.workers.model.make_model import build_config  # noqa: E402


def ten_copies(prep: InputPreparer, sched, size: int) -> ForwardBatch:
    """The baseline: prepare_decode as it was before DecodeStaging (one copy per input tensor)."""
    chunks = sched.chunks if sched is not None else []
    n = len(chunks)
    buf, B, tb = prep.buf, prep.layout.block_size, prep.tables
    rows = tb.rows(chunks)
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
    init[:n] = pos[:n] > 0
    has_init = buf.has_initial_state[:size]
    has_init.copy_(torch.from_numpy(init))
    block_tables, slot_mapping = [], []
    for gi in range(len(prep.layout.mla_groups)):
        bt = np.zeros((size, prep.max_blocks), dtype=np.int32)
        bt[:n] = tb.mla[gi][rows]
        slots = np.full(size, -1, dtype=np.int64)
        slots[:n] = bt[np.arange(n), pos[:n] // B].astype(np.int64) * B + pos[:n] % B
        bt_t = buf.block_tables[gi][:size]
        bt_t.copy_(torch.from_numpy(bt))
        block_tables.append(bt_t)
        slot_mapping.append(put(buf.slot_mapping[gi], slots))
    state_indices = []
    for gi in range(len(prep.layout.kda_groups)):
        si = np.full(size, -1, dtype=np.int64)
        si[:n] = tb.kda[gi][rows]
        state_indices.append(put(buf.state_indices[gi], si))
    logits_idx = put(buf.logits_indices, ar[:size])
    return ForwardBatch(input_ids, pos_t, cu_t, seq_lens, block_tables, slot_mapping, state_indices,
                        has_init, None, None, None, logits_idx, is_decode=True)


def time_us(fn, sync: bool) -> float:
    for _ in range(20):
        fn()
    ts = []
    for _ in range(300):
        t0 = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(ts)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--max-model-len", type=int, default=4096)
    args = ap.parse_args()
    cfg = build_config("small")
    layout = plan_cache_layout(cfg, torch.bfloat16, block_size=64)
    cuda = args.device.startswith("cuda")
    rows = []
    for B in args.batches:
        prep = InputPreparer(layout, args.device, 16384, max(args.batches), args.max_model_len)
        for i in range(B):
            prep.tables.row_of[f"r{i}"] = i
            for t in prep.tables.mla:
                t[i, :8] = np.arange(1 + 8 * i, 9 + 8 * i)
        sched = SimpleNamespace(chunks=[SimpleNamespace(request_id=f"r{i}", start=300 + i, token_ids=[5])
                                        for i in range(B)])
        ours = time_us(lambda p=prep, s=sched, b=B: p.prepare_decode(s, b), False)
        base = time_us(lambda p=prep, s=sched, b=B: ten_copies(p, s, b), False)
        row = [B, round(base, 1), round(ours, 1), round(base / ours, 2)]
        if cuda:
            ours_s = time_us(lambda p=prep, s=sched, b=B: p.prepare_decode(s, b), True)
            base_s = time_us(lambda p=prep, s=sched, b=B: ten_copies(p, s, b), True)
            row += [round(base_s, 1), round(ours_s, 1), round(base_s / ours_s, 2)]
        rows.append(row)
    heads = ["batch", "ten copies us", "ours us", "ratio"]
    if cuda:
        heads += ["+sync ten copies us", "+sync ours us", "ratio"]
    print(f"# device {args.device}, small preset layout ({len(layout.mla_groups)} MLA, {len(layout.kda_groups)} KDA "
          "groups)")
    print_table(heads, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
