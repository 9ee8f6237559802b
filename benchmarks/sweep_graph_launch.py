"""Host cost of launching a CUDA graph, by node count: what the engine pays per decode step to replay its graph.

    PYTHONSAFEPATH=1 python benchmarks/sweep_graph_launch.py [--nodes 1 100 250 500 1000 1500]

For each count N, a graph of N small kernels (an in-place add on a 4 KB tensor, captured on one stream, as the
engine's decode graph is) is replayed; prints the host time of one `replay()` call while the GPU is idle (each
launch after a synchronize: the engine's case) and back to back (launch queue full), µs per call and per node,
and the GPU time per replay. decode_roofline.py --breakdown gives the engine's own figure ("replay (launch)").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 100, 250, 500, 1000, 1500])
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    x = torch.zeros(1024, device="cuda")
    print("| nodes | launch, GPU idle (µs) | per node (µs) | launch, back to back (µs) | GPU per replay (µs) |")
    for n in args.nodes:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            x.add_(1.0)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                x.add_(1.0)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        idle = []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            g.replay()
            idle.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        host = []
        for _ in range(args.reps):
            t1 = time.perf_counter()
            g.replay()
            host.append(time.perf_counter() - t1)
        torch.cuda.synchronize()
        gpu = (time.perf_counter() - t0) / args.reps
        li = 1e6 * statistics.median(idle)
        print(f"| {n} | {li:.1f} | {li / n:.3f} | {1e6 * statistics.median(host):.1f} | {1e6 * gpu:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
