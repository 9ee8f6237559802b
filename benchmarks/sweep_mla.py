# ruff: noqa: B023  (the timed closures run inside the loop iteration that defines them)
"""GPU sweep of the Triton absorbed-MLA paged decode (kernels/triton/mla_decode.py): every knob set, one table.

    PYTHONSAFEPATH=1 python benchmarks/sweep_mla.py [--budget-s 55] [--shapes 1x32 32x96] [--no-graph]

Shapes: B sequences x H heads, one query token each, context 32768, page size 64, bf16 (L 512, R 64).
First the device copy bandwidth is measured (2 GiB copy, read + write counted), then per shape the reference
op (`reference.mla_paged_attention`, fp32 math on the GPU) once, then each variant: its relative error
against the reference (must be < 2e-2 for bf16), its time (median of `triton.testing.do_bench`, L2 flushed
between calls) called eagerly and, unless --no-graph, replayed from a CUDA graph (no host launch overhead),
and the fraction of copy bandwidth that the cache bytes (B * ctx * 576 * 2) over that time reach.
Rows are in priority order; rows past --budget-s seconds are reported as skipped.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch
import triton

from k3serve.kernels import reference
from k3serve.kernels.triton.mla_decode import (
    _num_sms,
    choose_splits,
    default_config,
    mla_paged_attention_triton,
)

sys.path.insert(0, os.path.dirname(__file__))
from _util import copy_bandwidth, cuda_graph, gpu_time_us  # noqa: E402

DEV = "cuda"
BF = torch.bfloat16
L, R, CTX, BS = 512, 64, 32768, 64
SHAPES = [(1, 12), (1, 32), (1, 96), (32, 32), (32, 96)]
# (name, knobs, heads filter): the registered default first, then the alternatives by expected value
VARIANTS = [
    ("default", {}, None),
    ("default ns*2", {"_ns": 2.0}, None),
    ("default ns/2", {"_ns": 0.5}, None),
    ("plain h32 n32 s4", dict(variant="plain", block_h=32, block_n=32, num_stages=4), lambda h: h > 16),
    ("plain h64 n16 s5", dict(variant="plain", block_h=64, block_n=16, num_stages=5), lambda h: h > 16),
    ("plain h32 n64 s3", dict(variant="plain", block_h=32, block_n=64, num_stages=3), None),
    ("plain h32 n16 s4 w4", dict(variant="plain", block_h=32, block_n=16, num_stages=4, num_warps=4), None),
    (
        "plain h32 n16 s4 w4 ns*2",
        dict(variant="plain", block_h=32, block_n=16, num_stages=4, num_warps=4, _ns=2.0),
        None,
    ),
    ("trans h32 n32 s4", dict(variant="trans", block_h=32, block_n=32, num_stages=4), None),
    ("trans h32 n64 s2", dict(variant="trans", block_h=32, block_n=64, num_stages=2), None),
    ("plain h16 n64 s3", dict(variant="plain", block_h=16, block_n=64, num_stages=3), lambda h: h <= 16),
    ("plain h64 n32 s4", dict(variant="plain", block_h=64, block_n=32, num_stages=4), lambda h: h <= 16),
]


bench = partial(gpu_time_us, warmup=5, rep=30)


def make_inputs(B, Hh, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    nblk = B * CTX // BS
    cache = torch.randn(nblk, BS, L + R, device=DEV, dtype=BF, generator=g)
    bt = torch.randperm(nblk, device=DEV, generator=g).view(B, CTX // BS).to(torch.int32)
    ql = torch.randn(B, Hh, L, device=DEV, dtype=BF, generator=g) * 0.1
    qp = torch.randn(B, Hh, R, device=DEV, dtype=BF, generator=g) * 0.1
    sl = torch.full((B,), CTX, device=DEV, dtype=torch.int32)
    cu = torch.arange(B + 1, device=DEV, dtype=torch.int32)
    return ql, qp, cache, bt, sl, cu


def auto_splits(B, Hh, knobs) -> int:
    """The num_splits the wrapper would choose for these knobs (mirrors mla_paged_attention_triton)."""
    variant, bm, bn, _ = default_config(
        Hh, L, R, 2, knobs.get("variant"), knobs.get("block_h"), knobs.get("block_n"), knobs.get("num_stages")
    )
    items = B * triton.cdiv(Hh, bm)
    return choose_splits(
        items, CTX, bn, min(bm, Hh), L, (L + R) * 2, _num_sms(torch.cuda.current_device()), 256
    )


def knob_kwargs(case, knobs) -> dict:
    """Wrapper kwargs of a VARIANTS entry; "_ns" scales the automatic num_splits."""
    kw = {k: v for k, v in knobs.items() if not k.startswith("_")}
    if "_ns" in knobs:
        kw["num_splits"] = max(1, round(auto_splits(case["B"], case["Hh"], kw) * knobs["_ns"]))
    return kw


def rel(out, ref) -> float:
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def graph_time(fn) -> float | None:
    return bench(cuda_graph(fn).replay)


def prepare(B, Hh) -> dict:
    """Inputs of one shape and the reference output (fp32 math on the GPU)."""
    ql, qp, cache, bt, sl, cu = make_inputs(B, Hh)
    scale = 192**-0.5
    ref = reference.mla_paged_attention(ql, qp, cache, bt, sl, cu, scale, kv_lora_rank=L).float()
    return dict(B=B, Hh=Hh, args=(ql, qp, cache, bt, sl, cu, scale), ref=ref, nbytes=B * CTX * (L + R) * 2)


def run_row(case, name, knobs, bw, no_graph) -> list:
    B, Hh = case["B"], case["Hh"]
    kw = knob_kwargs(case, knobs)

    def fn():
        return mla_paged_attention_triton(*case["args"], kv_lora_rank=L, **kw)

    try:
        err = rel(fn(), case["ref"])
        torch.cuda.synchronize()
        te = bench(fn)
        tg = None if no_graph else graph_time(fn)
    except Exception as e:  # noqa: BLE001  (a knob set that does not compile / fit is reported)
        return [B, Hh, name, "-", "-", f"failed: {type(e).__name__}: {str(e)[:80]}", "-", "-", "-"]
    ns = kw.get("num_splits") or auto_splits(B, Hh, kw)
    pct = lambda t: "-" if t is None else f"{100 * case['nbytes'] / (t * 1e-6) / bw:.0f}%"  # noqa: E731
    flag = "" if err < 2e-2 else " BAD"
    tgs = "-" if tg is None else f"{tg:.1f}"
    return [B, Hh, name, ns, f"{err:.1e}{flag}", f"{te:.1f}", pct(te), tgs, pct(tg)]


def precompile(cases) -> None:
    """Compile every (variant, shape) specialization up front, in parallel threads (Triton's async compile
    mode; the launches are turned into warm-ups, so nothing runs). Errors surface later, per row."""
    from triton.runtime._async_compile import AsyncCompileMode
    from triton.runtime.jit import JITFunction

    orig = JITFunction.run

    def warm(self, *a, grid, warmup, **k):
        return orig(self, *a, grid=grid, warmup=True, **k)

    JITFunction.run = warm
    try:
        with AsyncCompileMode(ThreadPoolExecutor(max_workers=os.cpu_count() or 4), ignore_errors=True):
            for _, knobs, keep in VARIANTS:
                for case in cases:
                    if keep is None or keep(case["Hh"]):
                        try:
                            mla_paged_attention_triton(
                                *case["args"], kv_lora_rank=L, **knob_kwargs(case, knobs)
                            )
                        except Exception:  # noqa: BLE001
                            pass
    finally:
        JITFunction.run = orig


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=55.0)
    ap.add_argument("--shapes", nargs="+", default=None, help="BxH, e.g. 1x32 32x96")
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--no-precompile", action="store_true", help="compile lazily, one kernel at a time")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    shapes = SHAPES if not args.shapes else [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    bw = copy_bandwidth()
    print(f"# copy bandwidth {bw / 1e12:.2f} TB/s (read + write); {torch.cuda.get_device_name()}", flush=True)
    rows = []
    head = ["B", "H", "variant", "NS", "rel err", "eager µs", "eager %bw", "graph µs", "graph %bw"]

    def show(row):
        print("| " + " | ".join(str(c) for c in row) + " |", flush=True)

    def emit(row):
        rows.append(row)
        show(row)

    cases = [prepare(B, Hh) for B, Hh in shapes]
    if not args.no_precompile:
        t1 = time.time()
        precompile(cases)
        print(f"# precompiled in {time.time() - t1:.1f} s", flush=True)
    show(head)
    show(["---"] * len(head))
    for name, knobs, keep in VARIANTS:  # variant-major: a spent budget skips the least likely knob sets
        for case in cases:
            if keep is not None and not keep(case["Hh"]):
                continue
            if time.time() - t0 > args.budget_s:
                emit([case["B"], case["Hh"], name, "-", "-", "skipped (budget)", "-", "-", "-"])
                continue
            emit(run_row(case, name, knobs, bw, args.no_graph))
    print(f"\n# by shape ({time.time() - t0:.0f} s in all)", flush=True)
    show(head)
    show(["---"] * len(head))
    for row in sorted(rows, key=lambda r: (r[0], r[1])):
        show(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
