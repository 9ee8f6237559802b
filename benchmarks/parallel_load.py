"""What one tensor-parallel rank reads and holds while loading: the whole checkpoint then its cut (the
baseline: what every rank did before) vs only its slices (workers/engine/parallel/shard.py load_shard), for
1, 2 and 4 ranks, measured in the same run.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/parallel_load.py [--ranks 1,2,4] [--layers 4] [--experts 16]
        [--hidden 2048] [--moe-intermediate 512] [--dtype bfloat16] [--expert-parallel] [--model DIR]

The model is the "small" preset's shapes with fewer layers and experts and dense (not MXFP4) experts,
written once with random weights (bf16 on disk, like a real checkpoint; --model reuses a directory) and
loaded in --dtype (float32 by default, the CPU engine's: every tensor read is converted, so a full read
materializes the whole model). Every (mode, ranks, rank) loads in a fresh process, one after another, and
then touches every byte it kept (a rank computes with them): "read" is the tensor bytes requested from the
safetensors files (loader stats), "peak" the process's peak resident set during the load (VmHWM, reset
just before it) minus its resident set then (torch and the interpreter excluded), which counts the mmap'd
file pages a read touches as well as the copies. The files are in the page cache (just written), so the
seconds are memory-speed reads, not disk reads. Ratios: shard-only / full read, per rank. With --dtype
equal to the file's (bfloat16) safetensors returns lazily mapped tensors, and the full read costs less
RSS than its "read" column says (only the pages the cut touches are faulted in).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    """Restart the kernel's peak-RSS count (VmHWM) from the current RSS (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(mode: str, model: str, size: int, rank: int, ep: bool, dtype: str) -> None:
    from k3serve.workers.engine.parallel.shard import ShardPlan, load_shard, shard_weights
    from k3serve.workers.model.loader import load_model_weights

    dt = getattr(torch, dtype)
    before = _status_kb("VmRSS")
    _reset_peak()  # the imports' transient peak must not count
    stats: dict = {}
    t0 = time.perf_counter()
    if mode == "full":  # the baseline: the whole checkpoint, then this rank's cut (one rank: no cut)
        cfg, w = load_model_weights(model, dtype=dt, stats=stats)
        if size > 1:
            _rc, shard = shard_weights(cfg, w, ShardPlan.make(cfg, rank, size, ep), dt)
            del w
        else:
            shard = w
    else:
        _cfg, _plan, _rc, shard = load_shard(model, dt, rank, size, ep, stats=stats)
    for t in shard.values():  # a rank computes with every weight it keeps: fault in lazily mapped ones
        t.contiguous().reshape(-1).view(torch.uint8)[::4096].sum()  # one byte per 4 KiB page
    secs = time.perf_counter() - t0
    kept = sum(t.numel() * t.element_size() for t in shard.values())
    peak = _status_kb("VmHWM")
    print(json.dumps(dict(bytes_read=stats["bytes_read"], kept=kept, peak_rss_kb=peak - before, seconds=secs)))


def write_model(out: Path, args) -> int:
    from k3serve.workers.model.checkpoint import save_checkpoint
    from k3serve.workers.model.init_weights import init_weights
    from k3serve.workers.model.make_model import build_config

    sets = ["quantization_config=null", f"num_hidden_layers={args.layers}", f"num_experts={args.experts}",
            f"hidden_size={args.hidden}", f"moe_intermediate_size={args.moe_intermediate}",
            f"routed_expert_hidden_size={args.hidden // 2}", "num_experts_per_token=4"]
    cfg = build_config("small", sets, vocab_size=32768)
    with torch.no_grad():
        w = init_weights(cfg, seed=0, device="cpu", dtype=torch.bfloat16)
        save_checkpoint(cfg, w, out)
    return sum(f.stat().st_size for f in out.glob("*.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--moe-intermediate", type=int, default=512)
    ap.add_argument("--dtype", default="float32", help="the load (compute) dtype; the CPU engine's default")
    ap.add_argument("--expert-parallel", action="store_true")
    ap.add_argument("--model", default=None, help="an existing checkpoint directory (default: write one)")
    ap.add_argument("--child", nargs=4, metavar=("MODE", "MODEL", "SIZE", "RANK"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        mode, model, size, rank = args.child
        child(mode, model, int(size), int(rank), args.expert_parallel, args.dtype)
        return
    tmp = None
    if args.model:
        model = Path(args.model)
        on_disk = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    else:
        tmp = tempfile.TemporaryDirectory(prefix="k3serve-parallel-load-")
        model = Path(tmp.name) / "m"
        on_disk = write_model(model, args)
    print(f"checkpoint {on_disk / 2**20:.1f} MiB on disk ({model}); load dtype {args.dtype}; "
          f"experts {'expert-parallel' if args.expert_parallel else 'tensor-parallel'}")
    env = dict(os.environ, PYTHONSAFEPATH="1")
    print(f"{'ranks':>5} {'rank':>4} | {'full: read MiB':>14} {'peak MiB':>9} {'s':>6} | "
          f"{'shard: read MiB':>15} {'peak MiB':>9} {'s':>6} | {'read x':>6} {'peak x':>6}")
    for size in [int(x) for x in args.ranks.split(",")]:
        for rank in range(size):
            row = {}
            for mode in ("full", "shard"):
                cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, str(model), str(size), str(rank),
                       "--dtype", args.dtype] + (["--expert-parallel"] if args.expert_parallel else [])
                out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
                row[mode] = json.loads(out.strip().splitlines()[-1])
            f, s = row["full"], row["shard"]
            mib = 2**20
            print(f"{size:>5} {rank:>4} | {f['bytes_read'] / mib:>14.1f} {f['peak_rss_kb'] / 1024:>9.1f} "
                  f"{f['seconds']:>6.2f} | {s['bytes_read'] / mib:>15.1f} {s['peak_rss_kb'] / 1024:>9.1f} "
                  f"{s['seconds']:>6.2f} | {s['bytes_read'] / f['bytes_read']:>6.2f} "
                  f"{s['peak_rss_kb'] / max(f['peak_rss_kb'], 1):>6.2f}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
