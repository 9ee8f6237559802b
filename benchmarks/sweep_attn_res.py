# ruff: noqa: B023  (the timed closures run inside the loop iteration that defines them)
"""GPU sweep of the AttnRes kernel variants and knobs (`attn_res_triton(..., variant=, ...)`).

    PYTHONSAFEPATH=1 python benchmarks/sweep_attn_res.py [--T 1 64 4096] [--only row chunk_resident] [--tsv F]

Shape as in benchmarks/kernels.py (attn_res_rows): D=7168, NB=9 block slots, n=8 stored blocks (9 sources),
bf16 partial/delta/blocks, round_dtype=bf16, write_idx=-1, fp32 weights with the output RMSNorm. Input sets
are rotated so that a small T does not sit in the L2. The device copy bandwidth (read + write) is measured
first; each row gives µs, TB/s over the bytes that must move (n blocks + partial + delta read, partial + out
written) and its % of the copy bandwidth. Every configuration is first checked on the GPU against the
reference op (the timed call shape, and one with write_idx inside the sources); a configuration that fails
is reported and not timed. Target: >= 80% of copy at T=4096.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton

from k3serve.kernels import reference
from k3serve.kernels.triton.attn_res import attn_res_triton

sys.path.insert(0, os.path.dirname(__file__))
from _util import copy_bandwidth  # noqa: E402
from _util import gpu_time_us as bench  # noqa: E402

DEV = "cuda"
BF = torch.bfloat16
D, NB, N = 7168, 9, 8

# (label, knobs): the registered default first, then the alternatives (see kernels/triton/attn_res.py)
CONFIGS = [
    ("row (default)", dict(variant="row")),
    ("resident w8 v4", dict(variant="chunk_resident")),
    ("resident w8 v4 prescale", dict(variant="chunk_resident", prescale=True)),
    ("resident w16 v2", dict(variant="chunk_resident", num_warps=16, vec=2)),
    ("resident w16 v2 prescale", dict(variant="chunk_resident", num_warps=16, vec=2, prescale=True)),
    ("chunk w4 c1024 s3", dict(variant="chunk")),
    ("chunk w4 c1024 s2", dict(variant="chunk", num_stages=2)),
    ("chunk w8 c2048 s3", dict(variant="chunk", num_warps=8)),
]


def rel(out, ref) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def check(knobs) -> tuple[bool, str]:
    """The configuration against the reference on the GPU (fp32 math on the same bf16 inputs)."""
    worst = 0.0
    # (both with delta and output norm, i.e. the timed specialization: the check costs no second compile)
    for T, n, wi, has_delta, has_out in ((37, N, -1, True, True), (5, 5, 3, True, True)):
        g = torch.Generator(device=DEV).manual_seed(T)
        p = torch.randn(T, D, device=DEV, generator=g).to(BF)
        d = torch.randn(T, D, device=DEV, generator=g).to(BF) if has_delta else None
        bl = torch.randn(T, NB, D, device=DEV, generator=g).to(BF)
        wn = torch.rand(D, device=DEV, generator=g) + 0.5
        wq = torch.randn(1, D, device=DEV, generator=g) * (2.0 / D**0.5)
        wo = torch.rand(D, device=DEV, generator=g) + 0.5 if has_out else None
        rp, rb = p.clone(), bl.clone()
        ref = reference.attn_res(rp, d, rb, wn, wq, wo, n, wi, 1e-5, round_dtype=BF)
        out = attn_res_triton(p, d, bl, wn, wq, wo, n, wi, 1e-5, round_dtype=BF, **knobs)
        torch.cuda.synchronize()
        r_out, r_p, r_b = rel(out, ref), rel(p, rp), rel(bl, rb)
        worst = max(worst, r_out)
        if not (r_out < 1e-2 and r_p < 4e-3 and r_b < 4e-3):  # bf16: the partial within ~1 ulp
            return False, f"T={T} n={n} wi={wi}: rel out {r_out:.2e} partial {r_p:.2e} blocks {r_b:.2e}"
    return True, f"max rel {worst:.1e}"


def make_sets(T):
    R = max(1, min(32, (256 << 20) // (T * (NB + 3) * D * 2)))  # rotate input sets past the L2
    sets = [
        (
            torch.randn(T, D, device=DEV, dtype=BF),
            torch.randn(T, D, device=DEV, dtype=BF),
            torch.randn(T, NB, D, device=DEV, dtype=BF),
        )
        for _ in range(R)
    ]
    wn = torch.rand(D, device=DEV) + 0.5
    wq = torch.randn(1, D, device=DEV) * 0.05
    wo = torch.rand(D, device=DEV) + 0.5
    return sets, wn, wq, wo


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="+", default=[1, 64, 4096])
    ap.add_argument("--only", nargs="+", default=None, help="variants to run (row chunk chunk_resident)")
    ap.add_argument("--tsv", default=None)
    args = ap.parse_args()
    t0 = time.time()
    print(f"# device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    bw = copy_bandwidth()
    torch.cuda.empty_cache()
    print(f"# copy bandwidth {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    configs = [(lab, k) for lab, k in CONFIGS if not args.only or k["variant"] in args.only]
    ok = {}
    for lab, knobs in configs:
        tc = time.time()
        try:
            ok[lab], msg = check(knobs)
        except Exception as e:  # noqa: BLE001
            ok[lab], msg = False, f"error {e!r}"[:300]
        print(
            f"# check {lab}: {'ok' if ok[lab] else 'FAILED'} ({msg}; compile + check {time.time() - tc:.1f} s)",
            flush=True,
        )
    head = ["config", "T", "us", "TB/s", "%copy"]
    rows = []
    print(" | ".join(head), flush=True)
    for T in args.T:
        sets, wn, wq, wo = make_sets(T)
        nbytes = T * D * 2 * (N + 1 + 1 + 2)  # n blocks + partial + delta read; partial + out written
        for lab, knobs in configs:
            if not ok[lab]:
                continue
            it = [0]

            def call():
                it[0] = (it[0] + 1) % len(sets)
                p, d, b = sets[it[0]]
                attn_res_triton(p, d, b, wn, wq, wo, N, -1, 1e-5, round_dtype=BF, **knobs)

            t = bench(call)
            rate = nbytes / (t * 1e-6)
            row = [lab, T, f"{t:.1f}", f"{rate / 1e12:.2f}", f"{100 * rate / bw:.0f}%"]
            rows.append(row)
            print(" | ".join(str(c) for c in row), flush=True)
        sets = None
        torch.cuda.empty_cache()
    if args.tsv:
        with open(args.tsv, "w") as f:
            f.write("\t".join(head) + "\n")
            f.writelines("\t".join(str(c) for c in r) + "\n" for r in rows)
    print(f"# total {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
