# ruff: noqa: B023  (the timed closures run inside the loop iteration that defines them)
"""Tuning sweep of the fused KDA decode kernel (kernels/triton/kda_decode.py) on a CUDA GPU, < 60 s on an H200.

    PYTHONSAFEPATH=1 python benchmarks/sweep_kda_decode.py [--N 1 32 256] [--H 12 32 96] [--only NAME ...]
                                                           [--variant NAME:block_v=128,num_warps=8 ...]

Measures the device copy bandwidth first (read + write of 2 GiB), then for every shape (N sequences x H heads,
K = V = 128, fp32 state, bf16 activations) and every variant (knobs of `kda_decode_triton`): a call on a check
batch (padding slots, fresh states) compared with `reference.kda_decode` in fp64 (output, state, conv state;
10 times for combine="atomic"), then the median time. N = 1 is timed as a CUDA graph of 8 layers (µs per
layer, like the decode step); larger N with `triton.testing.do_bench`, state sets rotated past the 50 MB L2.
Rate = state bytes that must move (read + write of N·H·V·K fp32) / time, and its % of the copy bandwidth.
A variant that fails its check is reported and not timed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial

import torch
import triton

from k3serve.kernels import reference
from k3serve.kernels.triton.kda_decode import kda_decode_triton

sys.path.insert(0, os.path.dirname(__file__))
from _util import copy_bandwidth, cuda_graph, gpu_time_us, print_table  # noqa: E402

DEV = "cuda"
BF = torch.bfloat16
K = V = 128
W = 4
LAYERS = 8  # CUDA graph of this many layers for N = 1

# name -> knobs, with registers per thread on sm_90 (Triton 3.6, aot_check) and the CTAs per SM they allow
# (64K registers); "+epi" = a second light launch (norm, gate, q/k conv state), "atomic" = last split does it.
VARIANTS = {
    "default": {},  # block_v 32, 1 split, 4 warps: 166 regs -> 3 CTAs/SM, one 16 KB slice in flight each
    "bv32-cap128": dict(maxnreg=128),  # 128 regs (48 B spill) -> 4 CTAs/SM
    "whole-8w": dict(block_v=128, num_warps=8),  # 128 regs -> 2 CTAs/SM, the whole 64 KB state at once
    "split2-bv32": dict(v_splits=2),  # 128 regs -> 4 CTAs/SM, 2 slices each, +epi
    "split2-bv64-cap96": dict(block_v=64, v_splits=2, maxnreg=96),  # 96 regs -> 5 CTAs/SM x 32 KB, +epi
    "split2-bv64-cap96-atomic": dict(block_v=64, v_splits=2, maxnreg=96, combine="atomic"),  # 96 (32 B spill)
    "split4": dict(v_splits=4),  # 64 regs -> 8 CTAs/SM x 16 KB, +epi
    "split4-atomic": dict(v_splits=4, combine="atomic"),  # 72 regs -> 7 CTAs/SM
    "split8-2w": dict(block_v=16, v_splits=8, num_warps=2),  # 72 regs -> 14 CTAs/SM x 8 KB, +epi
    "split8-2w-atomic": dict(block_v=16, v_splits=8, num_warps=2, combine="atomic"),  # 96 regs -> 10 CTAs/SM
}


bench = partial(gpu_time_us, warmup=10, rep=30)


def rel(out, ref) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


class Shape:
    """Inputs of one (N, H) case: activations, R rotated state sets, and a check batch."""

    def __init__(self, N: int, H: int):
        self.N, self.H = N, H
        C = 2 * H * K + H * V
        g = torch.Generator(device=DEV).manual_seed(N * 1000 + H)
        set_bytes = N * H * V * K * 4
        self.R = max(1, min(64, (256 << 20) // set_bytes))  # rotate state sets past the L2
        self.pool = torch.randn(self.R * N, H, V, K, device=DEV, generator=g) * 0.1
        self.cs = torch.randn(self.R * N, C, W - 1, device=DEV, dtype=BF, generator=g)
        self.idx = [torch.arange(r * N, (r + 1) * N, device=DEV, dtype=torch.int32) for r in range(self.R)]
        self.qkv = torch.randn(N, C, device=DEV, dtype=BF, generator=g)
        self.cw = torch.randn(C, W, device=DEV, generator=g) * 0.5
        self.rest = (
            torch.randn(N, H, K, device=DEV, dtype=BF, generator=g),  # raw_g
            torch.randn(H, device=DEV, generator=g),  # A_log
            torch.randn(H * K, device=DEV, generator=g),  # dt_bias
            torch.randn(N, H, device=DEV, dtype=BF, generator=g),  # beta_logit
            torch.randn(N, H, V, device=DEV, dtype=BF, generator=g),  # gate
            torch.rand(V, device=DEV, generator=g) + 0.5,  # o_norm_weight
        )
        self.init = torch.ones(N, dtype=torch.bool, device=DEV)
        # check batch: slots of set 0 with every 5th sequence padded and every 3rd starting fresh
        self.chk_idx = self.idx[0].clone()
        self.chk_idx[3::5] = -1
        self.chk_init = self.init.clone()
        self.chk_init[1::3] = False
        # pristine copies of set 0: the timed runs update the pool and conv states in place
        self.pool0, self.cs0 = self.pool[:N].clone(), self.cs[:N].clone()
        self.ref = None

    def check(self, knobs) -> str:
        """Run `knobs` once on copies of set 0; '' if it matches the fp64 reference, else what differs."""
        if self.ref is None:
            rp, rc = self.pool0.double(), self.cs0.double()
            out = reference.kda_decode(
                self.qkv.double(),
                self.cw.double(),
                rc,
                *(a.double() for a in self.rest),
                rp,
                self.chk_idx,
                self.chk_init,
                lower_bound=-5.0,
            )
            self.ref = (out, rp, rc)
        out_r, rp, rc = self.ref
        pool, cs = self.pool0.clone(), self.cs0.clone()
        out = kda_decode_triton(
            self.qkv, self.cw, cs, *self.rest, pool, self.chk_idx, self.chk_init, lower_bound=-5.0, **knobs
        )
        torch.cuda.synchronize()
        errs = []
        e_out, e_pool = rel(out, out_r), rel(pool, rp)
        if not e_out < 1e-2:  # bf16 output
            errs.append(f"out rel {e_out:.2e}")
        if not e_pool < 1e-4:
            errs.append(f"state rel {e_pool:.2e}")
        if not torch.equal(cs.double(), rc):
            errs.append("conv state differs")
        return "; ".join(errs)

    def time_rotated(self, knobs) -> float:
        it = [0]

        def step():
            it[0] = (it[0] + 1) % self.R
            kda_decode_triton(
                self.qkv,
                self.cw,
                self.cs,
                *self.rest,
                self.pool,
                self.idx[it[0]],
                self.init,
                lower_bound=-5.0,
                **knobs,
            )

        return bench(step)

    def time_graph(self, knobs) -> float:
        """µs per layer of a CUDA graph of LAYERS decode calls (N = 1 latency), each layer its own state."""
        pools = [torch.randn(4, self.H, V, K, device=DEV) * 0.1 for _ in range(LAYERS)]
        css = [torch.randn(4, *self.cs.shape[1:], device=DEV, dtype=BF) for _ in range(LAYERS)]
        idx = torch.tensor([1] * self.N, device=DEV, dtype=torch.int32)

        def step():
            for i in range(LAYERS):
                kda_decode_triton(
                    self.qkv, self.cw, css[i], *self.rest, pools[i], idx, self.init, lower_bound=-5.0, **knobs
                )

        step()
        return bench(cuda_graph(step, warmups=1).replay) / LAYERS


def parse_variant(spec: str) -> tuple[str, dict]:
    name, _, kv = spec.partition(":")
    knobs = {}
    for item in filter(None, kv.split(",")):
        key, _, val = item.partition("=")
        val = val.strip()
        knobs[key.strip()] = int(val) if val.lstrip("-").isdigit() else val
    return name, knobs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--N", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--H", type=int, nargs="+", default=[12, 32, 96])
    ap.add_argument("--only", nargs="+", default=None, metavar="NAME", help="variants to run (default: all)")
    ap.add_argument(
        "--variant",
        nargs="+",
        default=[],
        metavar="NAME:k=v,...",
        help="extra variants, e.g. big:block_v=128,num_warps=16,maxnreg=64 s4a:v_splits=4,combine=atomic",
    )
    ap.add_argument("--budget-s", type=float, default=55.0)
    args = ap.parse_args()
    t0 = time.time()
    variants = {k: v for k, v in VARIANTS.items() if args.only is None or k in args.only}
    variants.update(parse_variant(s) for s in args.variant)
    print(f"# device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    bw = copy_bandwidth(warmup=10, rep=50)
    print(f"# copy bandwidth {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    rows = []
    for H in args.H:
        for N in args.N:
            shape = Shape(N, H)
            nbytes = 2 * N * H * V * K * 4
            for name, knobs in variants.items():
                if time.time() - t0 > args.budget_s:
                    print(f"# N={N} H={H} {name}: skipped (budget)", flush=True)
                    continue
                try:
                    # a combine="atomic" variant is checked repeatedly (a missing ordering would show by chance)
                    reps = 10 if knobs.get("combine") == "atomic" else 1
                    err = next((e for e in (shape.check(knobs) for _ in range(reps)) if e), "")
                    t = None if err else (shape.time_graph(knobs) if N == 1 else shape.time_rotated(knobs))
                except Exception as e:  # noqa: BLE001
                    err, t = f"failed: {e!r}"[:200], None
                rate = nbytes / (t * 1e-6) if t else None
                row = [
                    N,
                    H,
                    name,
                    t if t else "-",
                    f"{rate / 1e12:.2f}" if rate else "-",
                    f"{100 * rate / bw:.0f}%" if rate else "-",
                    "graph/layer" if N == 1 else "rotated",
                    err or "ok",
                ]
                rows.append(row)
                print(" | ".join(str(c) for c in row), flush=True)
            del shape
            torch.cuda.empty_cache()
    print()
    print_table(["N", "H", "variant", "us", "TB/s", "%copy", "timing", "check"], rows)
    print(f"# {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
