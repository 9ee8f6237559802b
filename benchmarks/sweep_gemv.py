"""Skinny GEMM (kernels/triton/gemv.py) against cuBLAS (torch.nn.functional.linear) on the `small` preset's
decode projections, in one run.

    PYTHONSAFEPATH=1 python benchmarks/sweep_gemv.py [--rows 1 2 8 16] [--variants]

Each case is timed as the engine runs it: inside a CUDA graph of 2 x `--sets` back-to-back calls that walk
`--sets` distinct weight copies (together several times the 50 MB L2, so every call reads its weight from
HBM), µs per call = replay time / calls. Prints µs per call for cuBLAS and ours (default knobs), the ratio
cuBLAS/ours, our weight-read bandwidth and its fraction of the device copy bandwidth measured in the same run;
`--variants` adds rows for other knob settings (block_n, block_k, num_warps, num_stages).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from _util import copy_bandwidth, cuda_graph, gpu_time_us, print_table  # noqa: E402

from k3serve.kernels.triton import gemv as G  # noqa: E402

SHAPES = {  # name: (N, K) of the small preset (hidden 2048); counts per decode step in brackets
    "kda in_proj merged [18]": (8336, 2048),
    "kda/mla o_proj [24]": (2048, 2048),
    "kda f_b_proj [18]": (2048, 128),
    "mla in_proj merged [6]": (3392, 2048),
    "mla q_b_proj [6]": (3072, 768),
    "moe in_proj merged [23]": (4096, 2048),
    "moe latent up [23]": (2048, 1024),
    "shared down [23]": (2048, 1536),
    "dense gate|up [1]": (12288, 2048),
    "dense down [1]": (2048, 6144),
}
VARIANTS = [dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
            for bn, bk, nw, ns in [(2, 2048, 4, 1), (8, 1024, 4, 1), (4, 2048, 8, 1), (8, 512, 4, 2),
                                   (16, 256, 4, 3), (16, 512, 8, 3)]]


def graph_us(fn_for_set, sets: int) -> float:
    def run():
        for _ in range(2):
            for i in range(sets):
                fn_for_set(i)
    g = cuda_graph(run)
    return gpu_time_us(g.replay) / (2 * sets)


def bench_shape(name: str, N: int, K: int, args, bw: float, rows: list) -> None:
    nbytes = N * K * 2
    sets = args.sets or max(2, min(64, (400 << 20) // nbytes))
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5 for _ in range(sets)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for M in args.rows:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        if not G.supported(x, ws[0]):
            print(f"# {name} M={M}: not taken by the kernel (stays on cuBLAS)")
            continue
        err = float((G.skinny_linear_triton(x, ws[0]).float() - F.linear(x, ws[0]).float()).abs().max())
        t_cb = graph_us(lambda i, x=x: F.linear(x, ws[i]), sets)
        t_us = graph_us(lambda i, x=x: G.skinny_linear_triton(x, ws[i]), sets)
        cfg = G.default_config(N, K, 2, sms)
        knob = f"bn{cfg['block_n']} bk{cfg['block_k']} w{cfg['num_warps']} s{cfg['num_stages']}"
        rows.append([name, M, knob, round(t_cb, 2), round(t_us, 2), round(t_cb / t_us, 2),
                     round(nbytes / t_us / 1e6, 2), f"{100 * nbytes / (t_us * 1e-6) / bw:.0f}%", f"{err:.2g}"])
        print("  ".join(map(str, rows[-1])), flush=True)
        if not args.variants:
            continue
        for v in VARIANTS:
            try:
                t_v = graph_us(lambda i, v=v, x=x: G.skinny_linear_triton(x, ws[i], **v), sets)
            except Exception as e:  # noqa: BLE001 (a knob setting the compiler rejects: say so, go on)
                print(f"#   {v}: {type(e).__name__}: {str(e)[:100]}")
                continue
            knob = f"bn{v['block_n']} bk{v['block_k']} w{v['num_warps']} s{v['num_stages']}"
            rows.append(["  variant", M, knob, round(t_cb, 2), round(t_v, 2), round(t_cb / t_v, 2),
                         round(nbytes / t_v / 1e6, 2), f"{100 * nbytes / (t_v * 1e-6) / bw:.0f}%", ""])
            print("  ".join(map(str, rows[-1])), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1])
    ap.add_argument("--sets", type=int, default=0, help="weight copies per case (default: ~400 MB of them)")
    ap.add_argument("--variants", action="store_true")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"# copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for name, (N, K) in SHAPES.items():
        bench_shape(name, N, K, args, bw, rows)
        torch.cuda.empty_cache()
    print_table(["case (N x K)", "M", "knobs", "cublas_us", "ours_us", "cublas/ours", "ours TB/s", "%copy bw",
                 "max|diff|"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
