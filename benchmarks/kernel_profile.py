"""Per-kernel GPU time of one call of each hot op (torch.profiler, CUDA activity), ours next to FLA's.

    PYTHONSAFEPATH=1 python benchmarks/kernel_profile.py [--only kda_prefill mla attn_res kda_decode moe]

Where `benchmarks/kernels.py` gives one number per op, this splits it: which launch (prep vs state kernel,
split vs merge, glue ops such as dtype casts) takes the time. Each case is warmed up, then profiled over
`--reps` calls; the table gives µs per call per kernel name.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from k3serve.kernels import ops

sys.path.insert(0, os.path.dirname(__file__))
from _util import kda_prefill_case, kernel_breakdown, ragged_lens  # noqa: E402

DEV = "cuda"
BF = torch.bfloat16


def kda_prefill(reps, T=8192, H=32, lens=None):
    K = 128
    lens = lens or [T]
    T, B = sum(lens), len(lens)
    q, k, v, g, beta, pool, slots, cu, init = kda_prefill_case(lens, H)
    kernel_breakdown(f"ours kda_chunked T={T} H={H} seqs={B}", lambda: ops.kda_chunked(q, k, v, g, beta, pool, slots, cu, init), reps)
    try:
        from fla.ops.kda import chunk_kda
    except Exception as e:  # noqa: BLE001
        print(f"# no FLA: {e!r}")
        return
    h0 = pool.clone()
    kernel_breakdown(f"FLA chunk_kda T={T} H={H} seqs={B}", lambda: chunk_kda(
        q[None], k[None], v[None], g[None], beta[None], scale=K**-0.5, initial_state=h0, output_final_state=True,
        use_qk_l2norm_in_kernel=True, state_v_first=True, cu_seqlens=cu.long()), reps)


def mla(reps, B=1, Hh=32, ctx=32768, bs=64):
    L, R = 512, 64
    nblk = B * ctx // bs
    cache = torch.randn(nblk, bs, L + R, device=DEV, dtype=BF)
    bt = torch.randperm(nblk, device=DEV).view(B, ctx // bs).to(torch.int32)
    ql = torch.randn(B, Hh, L, device=DEV, dtype=BF) * 0.1
    qp = torch.randn(B, Hh, R, device=DEV, dtype=BF) * 0.1
    sl = torch.full((B,), ctx, device=DEV, dtype=torch.int32)
    cu = torch.arange(B + 1, device=DEV, dtype=torch.int32)
    kernel_breakdown(f"mla B={B} H={Hh} ctx={ctx}",
              lambda: ops.mla_paged_attention(ql, qp, cache, bt, sl, cu, 192**-0.5, kv_lora_rank=L), reps)


def attn_res(reps, T=4096, D=7168, n=8):
    p, d = torch.randn(T, D, device=DEV, dtype=BF), torch.randn(T, D, device=DEV, dtype=BF)
    b = torch.randn(T, 9, D, device=DEV, dtype=BF)
    wn, wq, wo = torch.rand(D, device=DEV) + 0.5, torch.randn(1, D, device=DEV) * 0.05, torch.rand(D, device=DEV)
    kernel_breakdown(f"attn_res T={T}", lambda: ops.attn_res(p, d, b, wn, wq, wo, n, -1, 1e-5, round_dtype=BF), reps)


def kda_decode(reps, N=256, H=32):
    K = V = 128
    C = 2 * H * K + H * V
    qkv = torch.randn(N, C, device=DEV, dtype=BF)
    cw = torch.randn(C, 4, device=DEV)
    cs = torch.randn(N, C, 3, device=DEV, dtype=BF)
    rg = torch.randn(N, H, K, device=DEV, dtype=BF)
    al, dtb = torch.randn(H, device=DEV), torch.randn(H * K, device=DEV)
    bl, gate = torch.randn(N, H, device=DEV, dtype=BF), torch.randn(N, H, V, device=DEV, dtype=BF)
    onw = torch.ones(V, device=DEV)
    pool = torch.randn(N, H, V, K, device=DEV) * 0.1
    si = torch.arange(N, device=DEV, dtype=torch.int32)
    init = torch.ones(N, dtype=torch.bool, device=DEV)
    kernel_breakdown(f"kda_decode fused N={N} H={H}", lambda: ops.kda_decode(
        qkv, cw, cs, rg, al, dtb, bl, gate, onw, pool, si, init, lower_bound=-5.0), reps)


CASES = {"kda_prefill": [kda_prefill, lambda r: kda_prefill(r, H=96), lambda r: kda_prefill(r, T=32768, H=12)],
         "kda_prefill_ragged": [lambda r: kda_prefill(r, T=16384, H=12), lambda r: kda_prefill(r, H=12, lens=ragged_lens(12)),
                                lambda r: kda_prefill(r, H=32, lens=ragged_lens(32))],
         "mla": [mla, lambda r: mla(r, B=32)], "attn_res": [attn_res], "kda_decode": [kda_decode]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="+", default=list(CASES))
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    for name in args.only:
        for fn in CASES[name]:
            try:
                fn(args.reps)
            except Exception as e:  # noqa: BLE001
                print(f"# {name} failed: {e!r}")
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
