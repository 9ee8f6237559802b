# ruff: noqa: B023  (the timed closures run inside the loop iteration that defines them)
"""Sweep of the MXFP4 MoE expert kernels' variants and knobs on a CUDA GPU (tuning rows, not the registered op).

    PYTHONSAFEPATH=1 python benchmarks/sweep_moe.py [--budget-s 55] [--only big small] [--T 1 8 64] [--profile]

Copy bandwidth is measured first (2 GiB device copy, read + write). Then, for the K3 MoE shape (E=896 experts,
top-16, DIN=3584, I=384, DOUT=3584) and the `small` preset's (64 experts, top-8, latent 1024,
moe_intermediate_size 768), at T = 1, 8, 64 tokens (router: sigmoid + correction bias, as in
benchmarks/kernels.py), each variant/knob setting of `moe_experts_triton` is timed twice: eager (one call per
timed iteration, CPU launch overhead included, like benchmarks/kernels.py) and replayed from a CUDA graph (what
the engine's captured decode step pays). Both flush the L2 before every call (triton.testing.do_bench).
bytes = packed weights + scales of the active experts; floor = bytes / copy bandwidth; %copy is the graph
time's rate as a fraction of the copy bandwidth. rel_err = ‖ours − reference‖ / ‖reference‖ with the
reference op (k3serve.kernels.reference.moe_experts, fp32 math) on the same GPU inputs. Weights are random
bytes (every byte is a valid pair of FP4 codes) with scale bytes 119..122, so nothing is quantized at start.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial

import torch
import triton

from k3serve.kernels import ops, reference
from k3serve.kernels.triton import moe
from k3serve.kernels.triton.moe import moe_experts_triton

sys.path.insert(0, os.path.dirname(__file__))
from _util import copy_bandwidth, cuda_graph, gpu_time_us, kernel_breakdown, print_table  # noqa: E402

DEV = "cuda"
BF = torch.bfloat16
SHAPES = {  # name: (E, topk, DIN, I, DOUT)
    "big": (896, 16, 3584, 384, 3584),
    "small": (64, 8, 1024, 768, 1024),
}
# (label, knobs). First compiles dominate the run time: every distinct (tiles, warps) pair compiles 1-2
# kernels (~1-3 s each), so keep this list short; `programs` and `variant="auto"` do not recompile. "gemv" rows
# run only where T * topk <= moe.AUTO_GEMV_MAX_PAIRS (where "auto" takes that path), "dot" rows from 64 pairs.
CONFIGS = [
    ("gemv (defaults)", dict(variant="gemv")),
    ("gemv atomic bk1=512 bk2=128 (session 4 tiles)", dict(variant="gemv", combine="atomic", bk1=512, bk2=128)),
    ("gemv combine=loop", dict(variant="gemv", combine="loop")),
    ("gemv combine=unroll", dict(variant="gemv", combine="unroll")),
    ("gemv unroll bn2=8 bk2=1024", dict(variant="gemv", combine="unroll", bn2=8, bk2=1024)),
    ("gemv atomic bk1=1024 bk2=1024", dict(variant="gemv", combine="atomic", bk1=1024, bk2=1024)),
    ("gemv atomic bn1=8 bk1=1024 bk2=1024", dict(variant="gemv", combine="atomic", bn1=8, bk1=1024, bk2=1024)),
    ("gemv unroll bn1=8 bk1=1024 bn2=8 bk2=1024", dict(variant="gemv", combine="unroll", bn1=8, bk1=1024, bn2=8,
                                                       bk2=1024)),
    ("dot", dict(variant="dot")),
    ("dot programs=8/SM", dict(variant="dot", programs=-8)),
    ("dot bn2=64 warps=8", dict(variant="dot", bn2=64, num_warps=8)),
    ("auto", dict(variant="auto")),
    # prefill-sized batches (--T 512 2048): the experts decoded once into bf16, then the "dot" kernels on them
    ("dense (defaults)", dict(variant="dense")),
    ("dense bn1=128 bn2=128", dict(variant="dense", bn1=128, bn2=128)),
    ("dense bk1=128 bk2=128", dict(variant="dense", bk1=128, bk2=128)),
    ("dense warps=4", dict(variant="dense", num_warps=4)),
    ("dense warps=8 bn2=128", dict(variant="dense", num_warps=8, bn2=128)),
    ("dense DENSE_BM=128", dict(variant="dense", _globals=dict(DENSE_BM=128))),
    ("dense DENSE_BM=128 warps=8", dict(variant="dense", num_warps=8, _globals=dict(DENSE_BM=128))),
    ("dense programs=8/SM", dict(variant="dense", programs=-8)),
    ("dense programs=2/SM", dict(variant="dense", programs=-2)),
    ("dot DOT_BM_LARGE=64", dict(variant="dot", _globals=dict(DOT_BM_LARGE=64))),
]


bench = partial(gpu_time_us, warmup=10, rep=40)


def print_copy_bandwidth() -> float:
    bw = copy_bandwidth(warmup=10, rep=100)
    print(f"# copy bandwidth {bw / 1e12:.2f} TB/s (read + write, 2 GiB)", flush=True)
    return bw


def graph_of(fn):
    """fn captured in a CUDA graph (after warm-up runs on a side stream), or None if capture fails."""
    try:
        return cuda_graph(fn)
    except Exception as e:  # noqa: BLE001
        print(f"# graph capture failed: {e!r}", flush=True)
        return None


def route_rows(name, T, k, E, ids, rows):
    """`route_blocks` (the "dot" path's sort into blocks) both ways, graph-timed: PyTorch's sort/scan/scatter and
    the one-program Triton kernel (kernels/triton/moe_route.py); the results must be the same block layout."""
    res = {}
    for label, on in (("route_blocks torch", False), ("route_blocks triton", True)):
        moe.ROUTE_KERNEL = on
        try:
            fn = partial(moe.route_blocks, ids, E, True)
            res[on] = fn()
            gr = graph_of(fn)
            t = bench(gr.replay) if gr is not None else float("nan")
        finally:
            moe.ROUTE_KERNEL = True
        rows.append([name, T, "-", label, "-", round(t, 1), "-", "-", "-"])
        print(f"#   {label}: graph {t:.1f} us", flush=True)
    (s0, o0, b0, n0), (s1, o1, b1, n1) = res[False], res[True]
    same = torch.equal(s0, s1) and torch.equal(b0, b1) and torch.equal(n0, n1)
    P = ids.numel()
    seg = s1.long() * P + o1.long()  # the pairs of each expert as a set: compare after sorting within experts
    same = same and torch.equal(torch.sort(s0.long() * P + o0.long()).values, seg)
    print(f"#   route_blocks layouts equal: {same}", flush=True)


def run_shape(name, Ts, bw, deadline, rows, profile):
    E, k, DIN, I, DOUT = SHAPES[name]
    g = torch.Generator(device=DEV).manual_seed(0)
    p13 = torch.randint(0, 256, (E, 2 * I, DIN // 2), device=DEV, dtype=torch.uint8, generator=g)
    s13 = torch.randint(119, 123, (E, 2 * I, DIN // 32), device=DEV, dtype=torch.uint8, generator=g)
    p2 = torch.randint(0, 256, (E, DOUT, I // 2), device=DEV, dtype=torch.uint8, generator=g)
    s2 = torch.randint(119, 123, (E, DOUT, I // 32), device=DEV, dtype=torch.uint8, generator=g)
    bias = torch.randn(E, device=DEV, generator=g) * 0.1
    wkw = dict(w13_packed=p13, w13_scale=s13, w2_packed=p2, w2_scale=s2, activation="situ", situ_beta=4.0,
               situ_linear_beta=25.0)
    per_expert = 2 * I * DIN // 2 + 2 * I * DIN // 32 + DOUT * I // 2 + DOUT * I // 32
    for T in Ts:
        lg = torch.randn(T, E, device=DEV, generator=g)
        tw, ids = ops.moe_route(lg, bias, k)
        z = torch.randn(T, DIN, device=DEV, dtype=BF, generator=g)
        n_act = int(torch.unique(ids).numel())
        nbytes = n_act * per_expert
        floor = nbytes / bw * 1e6
        ref = reference.moe_experts(z.float(), tw, ids, **wkw).double()
        shape = f"{name} T={T} E={E} k={k} active={n_act} {nbytes / 1e6:.0f}MB floor={floor:.1f}us"
        print(f"# {shape}", flush=True)
        route_rows(name, T, k, E, ids, rows)
        for label, knobs in CONFIGS:
            path, pairs = knobs.get("variant"), T * k
            if ((path == "gemv" and pairs > moe.AUTO_GEMV_MAX_PAIRS) or (path == "dot" and pairs < 64)
                    or (path == "dense" and pairs < 16 * E)):
                continue
            if time.time() > deadline:
                print(f"#   {label}: skipped (budget)", flush=True)
                continue
            kn = dict(knobs)
            glob = kn.pop("_globals", {})
            saved = {a: getattr(moe, a) for a in glob}
            if kn.get("programs", 0) < 0:
                kn["programs"] = -kn["programs"] * torch.cuda.get_device_properties(0).multi_processor_count

            def fn():
                return moe_experts_triton(z, tw, ids, **wkw, **kn)

            try:
                for a, v in glob.items():
                    setattr(moe, a, v)
                out = fn()
                torch.cuda.synchronize()
                err = float((out.double() - ref).norm() / ref.norm())
                t_eager = bench(fn)
                gr = graph_of(fn)
                t_graph = bench(gr.replay) if gr is not None else float("nan")
            except Exception as e:  # noqa: BLE001
                print(f"#   {label}: FAILED {e!r}"[:300], flush=True)
                continue
            finally:
                for a, v in saved.items():
                    setattr(moe, a, v)
            pct = 100 * floor / t_graph if t_graph == t_graph else float("nan")
            valid = int((ids >= 0).sum())
            tflops = 2 * valid * (2 * I * DIN + DOUT * I) / (t_graph * 1e-6) / 1e12
            rows.append([name, T, n_act, label, round(t_eager, 1), round(t_graph, 1), round(floor, 1),
                         round(pct, 1), f"{err:.1e}"])
            print(f"#   {label}: eager {t_eager:.1f} us, graph {t_graph:.1f} us ({pct:.0f}% of copy bw), "
                  f"{tflops:.1f} TFLOP/s, rel_err {err:.1e}", flush=True)
            if profile and T == Ts[0]:
                kernel_breakdown(f"{shape} {label}", fn, reps=5, top=8)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=55.0)
    ap.add_argument("--only", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--T", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--profile", action="store_true", help="per-kernel breakdown at the first T (slower)")
    args = ap.parse_args()
    t0 = time.time()
    print(f"# device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"moe.DEFAULT_VARIANT={moe.DEFAULT_VARIANT!r} AUTO_GEMV_MAX_PAIRS={moe.AUTO_GEMV_MAX_PAIRS} "
          f"GEMV_COMBINE={moe.GEMV_COMBINE!r} GEMV_WIDE_K_MAX_PAIRS={moe.GEMV_WIDE_K_MAX_PAIRS}", flush=True)
    bw = print_copy_bandwidth()
    rows: list[list] = []
    for name in args.only:
        run_shape(name, args.T, bw, t0 + args.budget_s, rows, args.profile)
        torch.cuda.empty_cache()
    print()
    print_table(["shape", "T", "active", "config", "eager_us", "graph_us", "floor_us", "%copy", "rel_err"], rows)
    print(f"# total {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
