"""Prefill-sized MoE expert batches on unpacked 16-bit experts (Kimi-Linear checkpoints) on a CUDA GPU: the 16-row
"dot" path against the "dense" variant (64-row blocks) with each down-GEMM combine, in one run.

    PYTHONSAFEPATH=1 python benchmarks/sweep_moe_prefill.py [--T 4096 16384] [--experts 64] [--topk 8]
        [--hidden 1024] [--inter 512]

Default shape: benchmarks/vs_transformers.py's `gpu` model (64 bf16 experts, top 8, hidden 1024, intermediate 512).
Rows, each timed with triton.testing.do_bench (median µs of one `moe_experts_triton` call, routing included):
* dot: variant="dot" (16-row sorted blocks, fp32 atomic combine): the form before the "dense" variant took
  unpacked weights;
* dense atomic: variant="dense" with moe.PAIR_SUM_MIN_PAIRS = 0 (64-row blocks, fp32 atomic adds into [T, DOUT]);
* dense per-pair: variant="dense" with moe.PAIR_SUM_MIN_PAIRS = 1 (each pair's weighted row stored, one kernel
  sums each token's rows; within moe.PAIR_SUM_MAX_BYTES).
Printed per T: µs, TFLOP/s of the expert GEMMs (2 x pairs x 3 x hidden x inter), the speedup over `dot`, and
rel_err against the reference op (float64 on the same GPU inputs).

`--tiles` adds one "dense" row per tile configuration (atomic combine): each "BM:BN1xBK1,BN2xBK2:W1,W2:S" (block
rows moe.DENSE_BM; gate/up tile; down tile; warps of the two kernels; num_stages, "-" for Triton's default), e.g.
`--tiles 64:64x64,64x64:8,4:- 64:128x64,128x64:8,8:3 128:128x64,128x64:8,8:3`; the fastest is the one to write into
moe.DENSE_BM / DENSE_TILES.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import print_table  # noqa: E402

from k3serve.kernels import reference  # noqa: E402
from k3serve.kernels.triton import moe  # noqa: E402


def parse_tiles(text: str) -> tuple[int, tuple[int, int, int, int], tuple[int, int], int | None]:
    """"BM:BN1xBK1,BN2xBK2:W1,W2:S" -> (BM, (BN1, BK1, BN2, BK2), (W1, W2), S or None for "-")."""
    try:
        bm, tiles, warps, stages = text.split(":")
        t1, t2 = tiles.split(",")
        bn1, bk1 = map(int, t1.split("x"))
        bn2, bk2 = map(int, t2.split("x"))
        w1, w2 = map(int, warps.split(","))
        cfg = (int(bm), (bn1, bk1, bn2, bk2), (w1, w2), None if stages == "-" else int(stages))
    except ValueError:
        raise ValueError(f"{text!r} is not BM:BN1xBK1,BN2xBK2:W1,W2:S (e.g. 64:64x64,64x64:8,4:-)") from None
    if any(v <= 0 or v & (v - 1) for v in (cfg[0], *cfg[1], *cfg[2])):
        raise ValueError(f"{text!r}: block rows, tiles and warps must be powers of two")
    return cfg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", nargs="+", type=int, default=[4096, 16384])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--tiles", nargs="*", default=[], metavar="BM:BN1xBK1,BN2xBK2:W1,W2:S",
                    help="extra dense rows, one per tile configuration (see the module docstring)")
    args = ap.parse_args()
    try:
        configs = [parse_tiles(t) for t in args.tiles]
    except ValueError as e:
        ap.error(f"--tiles: {e}")
    if not torch.cuda.is_available():
        print("sweep_moe_prefill: needs a CUDA device", file=sys.stderr)
        return 2
    import triton.testing

    dev, dt = "cuda", torch.bfloat16
    E, k, H, Inter = args.experts, args.topk, args.hidden, args.inter
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = (torch.randn(E, 2 * Inter, H, generator=g, device=dev) * H**-0.5).to(dt)
    w2 = (torch.randn(E, H, Inter, generator=g, device=dev) * Inter**-0.5).to(dt)
    rows = []
    for T in args.T:
        z = torch.randn(T, H, generator=g, device=dev).to(dt)
        ids = torch.rand(T, E, generator=g, device=dev).argsort(dim=1)[:, :k].contiguous()
        tw = torch.rand(T, k, generator=g, device=dev)
        ref = reference.moe_experts(z.double(), tw.double(), ids, w13=w13.double(), w2=w2.double(),
                                    situ_linear_beta=None)
        flops = 2 * T * k * 3 * H * Inter
        base = None
        cases = [("dot", "dot", None, None), ("dense atomic", "dense", 0, None), ("dense per-pair", "dense", 1, None)]
        cases += [(f"dense {text}", "dense", 0, cfg) for text, cfg in zip(args.tiles, configs)]
        for name, variant, pair_min, cfg in cases:
            keep = moe.PAIR_SUM_MIN_PAIRS, moe.DENSE_BM
            if pair_min is not None:
                moe.PAIR_SUM_MIN_PAIRS = pair_min
            kw = {}
            if cfg is not None:
                moe.DENSE_BM, (kw["bn1"], kw["bk1"], kw["bn2"], kw["bk2"]), kw["num_warps"], kw["num_stages"] = cfg
            try:
                def call(z=z, tw=tw, ids=ids, variant=variant, kw=kw):
                    return moe.moe_experts_triton(z, tw, ids, w13=w13, w2=w2, variant=variant, **kw)

                try:
                    out = call()
                except Exception as e:  # a tile that does not compile (shared memory, registers): say so, go on
                    rows.append([str(T), name, f"failed: {type(e).__name__}", "", "", ""])
                    continue
                err = ((out.double() - ref).norm() / ref.norm()).item()
                us = triton.testing.do_bench(call, warmup=5, rep=50) * 1e3
            finally:
                moe.PAIR_SUM_MIN_PAIRS, moe.DENSE_BM = keep
            base = base or us
            rows.append([str(T), name, f"{us:.0f}", f"{flops / us / 1e6:.0f}", f"{base / us:.2f}", f"{err:.1e}"])
    print(f"# {torch.cuda.get_device_name()}: {E} experts, top {k}, hidden {H}, intermediate {Inter}, bf16 "
          f"(unpacked)")
    print_table(["T", "variant", "µs", "TFLOP/s", "speedup vs dot", "rel_err"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
