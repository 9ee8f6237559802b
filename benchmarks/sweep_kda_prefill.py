# ruff: noqa: B023  (the timed closures run inside the loop iteration that defines them)
"""Sweep of the KDA chunked-prefill prep variants on a CUDA GPU: one markdown table (< 60 s on an H200).

    PYTHONSAFEPATH=1 python benchmarks/sweep_kda_prefill.py [--budget-s 50] [--profile]

For T=8192 with H in (32, 96) and a 64-sequence ragged batch at H=32 (K = V = 128, bf16 q/k/v, fp32 gates),
times the whole `kda_chunked_triton` call (median of `triton.testing.do_bench`, CUDA events) for each
`prep_variant` / knob setting (see the wrapper's docstring) and FLA's `chunk_kda` when importable (called
as benchmarks/kernels.py does). Before timing, every variant's output and final states are compared with
the "fused" variant's (relative L2 error). Variants past --budget-s (compile time included) are listed
as skipped. --profile adds a per-kernel breakdown (torch.profiler) of fused / split / onepass at 8K x 32.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial

import torch
import triton

from k3serve.kernels.triton.kda_chunk import kda_chunked_triton

sys.path.insert(0, os.path.dirname(__file__))
from _util import gpu_time_us, kda_prefill_case, kernel_breakdown, ragged_lens  # noqa: E402

DEV = "cuda"
K = V = 128

# (name, kwargs) in priority order; the first is the registered default and the reference of the error columns
VARIANTS: list[tuple[str, dict]] = [
    ("fused", {}),
    ("split", dict(prep_variant="split")),
    ("onepass", dict(prep_variant="onepass")),
    (
        "split w4 bk32 maxnreg=168",
        dict(prep_variant="split", prep_num_warps=4, intra_block_k=32, prep_maxnreg=168),
    ),
    ("split w4 maxnreg=168", dict(prep_variant="split", prep_num_warps=4, prep_maxnreg=168)),
    ("split maxnreg=off", dict(prep_variant="split", prep_maxnreg=None)),
    ("split wu w8 bn64", dict(prep_variant="split", wu_num_warps=8, wu_block_n=64)),
    ("split tinv fp32", dict(prep_variant="split", tinv_fp32=True)),
    ("split exact inline", dict(prep_variant="split", exact_inline=True, prep_maxnreg=None)),
    ("fused w4", dict(prep_num_warps=4)),
]


bench = partial(gpu_time_us, warmup=5, rep=40)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def make_case(lens: list[int], H: int, seed: int = 0):
    return kda_prefill_case(lens, H, K, V, DEV, torch.Generator(device=DEV).manual_seed(seed))


def try_fla():
    try:
        from fla.ops.kda import chunk_kda

        return chunk_kda
    except Exception as e:  # noqa: BLE001
        print(f"# FLA not available: {e!r}", flush=True)
        return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=50.0)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    t_start = time.time()
    print(f"# device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    fla = try_fla()
    cases = [("T=8K H=32", [8192], 32), ("T=8K H=96", [8192], 96)]
    lens = ragged_lens(32)
    cases.append((f"ragged 64 seqs {sum(lens)} tok H=32", lens, 32))
    head = ["case", "variant", "µs", "fused/this", "FLA/this", "rel err o", "rel err state"]
    data, rows = [], {}
    for cname, lens_c, H in cases:
        inp = make_case(lens_c, H)
        q, k, v, gate, beta, pool, slots, cu, init = inp
        ref_pool = pool.clone()
        ref_out = kda_chunked_triton(q, k, v, gate, beta, ref_pool, slots, cu, init)
        t_fla = None
        if fla is not None:
            h0, cu64 = pool.clone(), cu.long()
            try:
                t_fla = bench(
                    lambda: fla(
                        q[None],
                        k[None],
                        v[None],
                        gate[None],
                        beta[None],
                        scale=K**-0.5,
                        initial_state=h0,
                        output_final_state=True,
                        use_qk_l2norm_in_kernel=True,
                        state_v_first=True,
                        cu_seqlens=cu64,
                    )
                )
            except Exception as e:  # noqa: BLE001
                print(f"# FLA chunk_kda failed on {cname}: {e!r}", flush=True)
        rows[cname] = [[cname, "FLA chunk_kda", f"{t_fla:.1f}" if t_fla else "-", "-", "-", "-", "-"]]
        data.append((cname, inp, ref_out, ref_pool, t_fla))
    t_fused: dict[str, float] = {}
    # variants outermost (priority order), so that the budget cuts the least important knobs first
    for vname, kw in VARIANTS:
        for cname, inp, ref_out, ref_pool, t_fla in data:
            q, k, v, gate, beta, pool, slots, cu, init = inp
            if time.time() - t_start > args.budget_s:
                rows[cname].append([cname, vname, "skipped (budget)", "-", "-", "-", "-"])
                continue
            try:
                p = pool.clone()
                out = kda_chunked_triton(q, k, v, gate, beta, p, slots, cu, init, **kw)
                e_o, e_s = rel(out, ref_out), rel(p, ref_pool)
                t = bench(lambda: kda_chunked_triton(q, k, v, gate, beta, p, slots, cu, init, **kw))
            except Exception as e:  # noqa: BLE001
                print(f"# {cname} {vname} failed: {e!r}", flush=True)
                rows[cname].append([cname, vname, "FAILED", "-", "-", "-", "-"])
                continue
            if vname == "fused":
                t_fused[cname] = t
            tf = t_fused.get(cname)
            row = [
                cname,
                vname,
                f"{t:.1f}",
                f"{tf / t:.2f}" if tf else "-",
                f"{t_fla / t:.2f}" if t_fla else "-",
                f"{e_o:.2e}",
                f"{e_s:.2e}",
            ]
            rows[cname].append(row)
            print(" | ".join(row), f"({time.time() - t_start:.0f} s)", flush=True)
    print("\n| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for r in (r for case_rows in rows.values() for r in case_rows):
        print("| " + " | ".join(r) + " |")
    if args.profile:
        q, k, v, gate, beta, pool, slots, cu, init = make_case([8192], 32)
        for vname, kw in VARIANTS[:3]:
            kernel_breakdown(
                f"{vname} T=8K H=32",
                lambda: kda_chunked_triton(q, k, v, gate, beta, pool, slots, cu, init, **kw),
                reps=10,
            )
    print(f"# total {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
