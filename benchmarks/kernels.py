# ruff: noqa: B023  (the timed closures run inside the loop iteration that defines them)
"""One-run benchmark of the Triton kernels on a CUDA GPU: one table, ceilings measured first.

    PYTHONSAFEPATH=1 python benchmarks/kernels.py [--budget-s 330] [--quick] [--tsv FILE]

Columns: op, shape, ours (µs), baseline (µs) and which baseline, baseline/ours, the floor-based rate
(bytes that must move / our time, or FLOPs / our time) and its fraction of the ceiling measured at the
start of the same run (device copy bandwidth counting read + write; bf16 matmul rate on random data),
the target from the issue and whether it is met. Baselines: FLA (`chunk_kda`, `fused_recurrent_kda`,
from the fla-core wheel if importable) for KDA; cuBLAS (F.linear) for the one-row projections; eager PyTorch
(the reference ops on the GPU) otherwise;
for MXFP4 MoE the plain "dequantize each active expert to bf16, one matmul per expert" loop.
Timings: medians of `triton.testing.do_bench` (CUDA events) after warm-up, inputs rotated where they
would fit in L2. Sections run in priority order; rows past --budget-s are reported as skipped.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton

from k3serve.kernels import ops, reference
from k3serve.kernels.reference.mxfp4 import mxfp4_dequantize, mxfp4_quantize

sys.path.insert(0, os.path.dirname(__file__))
from _util import copy_bandwidth, cuda_graph, kda_prefill_case, ragged_lens  # noqa: E402
from _util import gpu_time_us as bench  # noqa: E402

DEV = "cuda"
BF = torch.bfloat16
ROWS: list[list] = []
HEAD = ["op", "shape", "ours_us", "base_us", "baseline", "base/ours", "rate", "%ceil", "target", "met"]
CEIL = {"bw": None, "mm": None}
ANCHOR_RATIO = {(8192, 96): 1.81, (8192, 32): 1.27, (16384, 32): 0.91, (65536, 32): 0.91, (8192, 12): 1.66,
                (32768, 12): 0.53}  # FLA ms / FlashKDA ms from anchors.md, keyed (T, heads)


def emit(op, shape, ours, base, base_name, rate=None, rate_kind="bw", target="", met=None, out=None):
    ratio = base / ours if (ours and base) else None
    frac = None
    if rate is not None:
        frac = rate / (CEIL["bw"] if rate_kind == "bw" else CEIL["mm"])
    unit = "TB/s" if rate_kind == "bw" else "TFLOP/s"
    row = [op, shape, f"{ours:.1f}" if ours else "-", f"{base:.1f}" if base else "-", base_name,
           f"{ratio:.2f}" if ratio else "-", f"{rate / 1e12:.2f} {unit}" if rate is not None else "-",
           f"{100 * frac:.0f}%" if frac is not None else "-", target, "-" if met is None else ("yes" if met else "NO")]
    ROWS.append(row)
    print(" | ".join(str(c) for c in row), flush=True)
    if out:
        out.write("\t".join(str(c) for c in row) + "\n")
        out.flush()


def ceilings():
    CEIL["bw"] = copy_bandwidth()
    x = torch.randn(8192, 8192, device=DEV, dtype=BF)
    y = torch.randn(8192, 8192, device=DEV, dtype=BF)
    t = bench(lambda: x @ y)
    CEIL["mm"] = 2 * 8192**3 / (t * 1e-6)
    print(f"# ceilings: copy {CEIL['bw'] / 1e12:.2f} TB/s (read+write), bf16 matmul {CEIL['mm'] / 1e12:.0f} TFLOP/s",
          flush=True)


def try_fla():
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda

        return chunk_kda, fused_recurrent_kda
    except Exception as e:  # noqa: BLE001
        print(f"# FLA not available: {e!r}", flush=True)
        return None, None


# ------------------------------------------------------------------ KDA decode
def kda_decode_rows(fla_rec, out, heads, Ns):
    K = V = 128
    W = 4
    for H in heads:
        for N in Ns:
            C = 2 * H * K + H * V
            R = max(1, min(64, (256 << 20) // (N * H * V * K * 4)))  # rotate state sets past the L2
            pool = torch.randn(R * N, H, V, K, device=DEV) * 0.1
            cs = torch.randn(R * N, C, W - 1, device=DEV, dtype=BF)
            idx = [torch.arange(r * N, (r + 1) * N, device=DEV, dtype=torch.int32) for r in range(R)]
            qkv = torch.randn(N, C, device=DEV, dtype=BF)
            cw = torch.randn(C, W, device=DEV)
            rg = torch.randn(N, H, K, device=DEV, dtype=BF)
            al = torch.randn(H, device=DEV)
            dtb = torch.randn(H * K, device=DEV)
            bl = torch.randn(N, H, device=DEV, dtype=BF)
            gate = torch.randn(N, H, V, device=DEV, dtype=BF)
            onw = torch.ones(V, device=DEV)
            init = torch.ones(N, dtype=torch.bool, device=DEV)
            it = [0]

            def fused():
                it[0] = (it[0] + 1) % R
                ops.kda_decode(qkv, cw, cs, rg, al, dtb, bl, gate, onw, pool, idx[it[0]], init, lower_bound=-5.0)

            t_fused = bench(fused)
            # recurrence only (same work as FLA's fused_recurrent_kda): q,k,v,g,beta ready
            q = torch.randn(N, H, K, device=DEV, dtype=BF)
            k = torch.randn(N, H, K, device=DEV, dtype=BF)
            v = torch.randn(N, H, V, device=DEV, dtype=BF)
            g = -torch.rand(N, H, K, device=DEV)
            beta = torch.rand(N, H, device=DEV)
            cu = torch.arange(N + 1, device=DEV, dtype=torch.int32)

            def rec():
                it[0] = (it[0] + 1) % R
                ops.kda_recurrent(q, k, v, g, beta, pool, idx[it[0]], cu, init)

            t_rec = bench(rec)
            t_fla = None
            if fla_rec is not None:
                states = [pool[r * N:(r + 1) * N] for r in range(R)]
                cu64 = cu.long()

                def fla():
                    it[0] = (it[0] + 1) % R
                    fla_rec(q[None], k[None], v[None], g[None], beta[None], scale=K**-0.5,
                            initial_state=states[it[0]], output_final_state=True, use_qk_l2norm_in_kernel=True,
                            state_v_first=True, cu_seqlens=cu64)

                try:
                    t_fla = bench(fla)
                except Exception as e:  # noqa: BLE001
                    print(f"# FLA fused_recurrent_kda failed: {e!r}", flush=True)
            sb = 2 * N * H * V * K * 4
            tgt = "≥90% bw" if N == 256 else ""
            met = (sb / (t_fused * 1e-6)) / CEIL["bw"] >= 0.9 if N == 256 else None
            emit("kda_decode fused", f"N={N} H={H}", t_fused, t_fla, "FLA fused_recurrent (recur. only)",
                 sb / (t_fused * 1e-6), target=tgt, met=met, out=out)
            emit("kda recurrence", f"N={N} H={H}", t_rec, t_fla, "FLA fused_recurrent", sb / (t_rec * 1e-6), out=out)


def kda_decode_graph_rows(out, heads, layers=8):
    K = V = 128
    W = 4
    for H in heads:
        N = 1
        C = 2 * H * K + H * V
        pools = [torch.randn(4, H, V, K, device=DEV) * 0.1 for _ in range(layers)]
        css = [torch.randn(4, C, W - 1, device=DEV, dtype=BF) for _ in range(layers)]
        qkv = torch.randn(N, C, device=DEV, dtype=BF)
        cw = torch.randn(C, W, device=DEV)
        rg = torch.randn(N, H, K, device=DEV, dtype=BF)
        al = torch.randn(H, device=DEV)
        dtb = torch.randn(H * K, device=DEV)
        bl = torch.randn(N, H, device=DEV, dtype=BF)
        gate = torch.randn(N, H, V, device=DEV, dtype=BF)
        onw = torch.ones(V, device=DEV)
        idx = torch.tensor([1], device=DEV, dtype=torch.int32)
        init = torch.ones(N, dtype=torch.bool, device=DEV)

        def step():
            for i in range(layers):
                ops.kda_decode(qkv, cw, css[i], rg, al, dtb, bl, gate, onw, pools[i], idx, init, lower_bound=-5.0)

        step()
        torch.cuda.synchronize()
        t = bench(cuda_graph(step, warmups=1).replay) / layers
        sb = 2 * H * V * K * 4
        emit("kda_decode in graph", f"N=1 H={H} per layer", t, None, "-", sb / (t * 1e-6), target="≤15 µs",
             met=t <= 15.0, out=out)


# ------------------------------------------------------------------ KDA prefill
def kda_prefill_rows(fla_chunk, out, heads, Ts, ragged, deadline):
    K = V = 128
    for H in heads:
        cases = [(f"T={T // 1024}K H={H}", [T]) for T in Ts]
        if ragged:
            lens = ragged_lens(H)
            cases.append((f"ragged 64 seqs {sum(lens)} tok H={H}", lens))
        for name, lens in cases:
            if time.time() > deadline:
                emit("kda_chunked prefill", name + " (skipped: budget)", None, None, "-", out=out)
                continue
            T = sum(lens)
            B = len(lens)
            try:
                q, k, v, g, beta, pool, slots, cu, init = kda_prefill_case(lens, H, K, V, DEV)
                t_ours = bench(lambda: ops.kda_chunked(q, k, v, g, beta, pool, slots, cu, init), warmup=10, rep=60)
            except torch.OutOfMemoryError:
                emit("kda_chunked prefill", name + " (OOM)", None, None, "-", out=out)
                continue
            t_fla = None
            if fla_chunk is not None:
                cu64 = cu.long()
                h0 = pool.clone()
                try:
                    t_fla = bench(lambda: fla_chunk(q[None], k[None], v[None], g[None], beta[None], scale=K**-0.5,
                                                    initial_state=h0, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True, state_v_first=True,
                                                    cu_seqlens=cu64), warmup=10, rep=60)
                except Exception as e:  # noqa: BLE001
                    print(f"# FLA chunk_kda failed on {name}: {e!r}", flush=True)
            nbytes = T * H * (K * 2 * 2 + V * 2 + K * 4 + 4 + V * 2) + 2 * B * H * V * K * 4
            ratio = ANCHOR_RATIO.get((T, H)) if len(lens) == 1 else None
            need = 1.2 * max(1.0, ratio or 1.0)
            met = (t_fla / t_ours >= need) if t_fla else None
            emit("kda_chunked prefill", name, t_ours, t_fla, "FLA chunk_kda", nbytes / (t_ours * 1e-6),
                 target=f"≥{need:.2f}x FLA", met=met, out=out)
            torch.cuda.empty_cache()


# ------------------------------------------------------------------ AttnRes
def attn_res_rows(out, Ts, D=7168, n=8):
    NB = 9
    for T in Ts:
        R = max(1, min(32, (256 << 20) // (T * (NB + 3) * D * 2)))
        sets = [(torch.randn(T, D, device=DEV, dtype=BF), torch.randn(T, D, device=DEV, dtype=BF),
                 torch.randn(T, NB, D, device=DEV, dtype=BF)) for _ in range(R)]
        wn = torch.rand(D, device=DEV) + 0.5
        wq = torch.randn(1, D, device=DEV) * 0.05
        wo = torch.rand(D, device=DEV) + 0.5
        it = [0]

        def ours():
            it[0] = (it[0] + 1) % R
            p, d, b = sets[it[0]]
            ops.attn_res(p, d, b, wn, wq, wo, n, -1, 1e-5, round_dtype=BF)

        def eager():
            it[0] = (it[0] + 1) % R
            p, d, b = sets[it[0]]
            reference.attn_res(p, d, b, wn, wq, wo, n, -1, 1e-5, round_dtype=BF)

        t_o = bench(ours)
        t_e = bench(eager)
        nbytes = T * D * 2 * (n + 1 + 1 + 2)  # n blocks + partial + delta read; partial + out written
        emit("attn_res", f"T={T} D={D} sources={n + 1}", t_o, t_e, "eager PyTorch", nbytes / (t_o * 1e-6),
             target="≥80% bw", met=(nbytes / (t_o * 1e-6)) / CEIL["bw"] >= 0.8, out=out)


# ------------------------------------------------------------------ one-row projections (skinny GEMM)
def linear_rows(out, shapes=((2048, 2048), (8336, 2048), (2048, 1024), (7168, 8192))):
    """ops.linear at M=1 (kernels/triton/gemv.py) vs cuBLAS (F.linear): the small preset's o_proj, merged KDA
    input projection and latent up-projection, and a K3-sized o_proj; weights rotated past the L2."""
    import torch.nn.functional as F

    for N, K in shapes:
        nbytes = N * K * 2
        R = max(2, min(32, (512 << 20) // nbytes))
        ws = [torch.randn(N, K, device=DEV, dtype=BF) for _ in range(R)]
        x = torch.randn(1, K, device=DEV, dtype=BF)
        it = [0]

        def ours():
            it[0] = (it[0] + 1) % R
            ops.linear(x, ws[it[0]])

        def cublas():
            it[0] = (it[0] + 1) % R
            F.linear(x, ws[it[0]])

        t_o, t_b = bench(ours), bench(cublas)
        emit("linear M=1", f"N={N} K={K}", t_o, t_b, "cuBLAS (F.linear)", (nbytes + 2 * (N + K)) / (t_o * 1e-6),
             out=out)
        ws.clear()


# ------------------------------------------------------------------ MLA decode
def mla_rows(out, cases, ctx=32768, bs=64):
    L, R = 512, 64
    for Hh, B in cases:
        nblk = B * ctx // bs
        cache = torch.randn(nblk, bs, L + R, device=DEV, dtype=BF)
        bt = torch.randperm(nblk, device=DEV).view(B, ctx // bs).to(torch.int32)
        ql = torch.randn(B, Hh, L, device=DEV, dtype=BF) * 0.1
        qp = torch.randn(B, Hh, R, device=DEV, dtype=BF) * 0.1
        sl = torch.full((B,), ctx, device=DEV, dtype=torch.int32)
        cu = torch.arange(B + 1, device=DEV, dtype=torch.int32)
        t_o = bench(lambda: ops.mla_paged_attention(ql, qp, cache, bt, sl, cu, 192**-0.5, kv_lora_rank=L))
        t_e = bench(lambda: reference.mla_paged_attention(ql, qp, cache, bt, sl, cu, 192**-0.5, kv_lora_rank=L),
                    warmup=5, rep=30)
        nbytes = B * ctx * (L + R) * 2
        emit("mla_paged decode", f"B={B} ctx=32K heads={Hh}", t_o, t_e, "eager PyTorch", nbytes / (t_o * 1e-6),
             target="≥80% bw", met=(nbytes / (t_o * 1e-6)) / CEIL["bw"] >= 0.8, out=out)


# ------------------------------------------------------------------ MoE
def moe_baseline(z, tw, ids, p13, s13, p2, s2, beta=4.0, lin=25.0):
    """Plain PyTorch: per active expert, dequantize to bf16, one matmul each (SiTU), weighted sum."""
    out = torch.zeros(z.shape[0], p2.shape[1], device=z.device, dtype=torch.float32)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        w13 = mxfp4_dequantize(p13[e], s13[e], BF)
        w2 = mxfp4_dequantize(p2[e], s2[e], BF)
        h = reference.situ_and_mul(z[tok] @ w13.t(), beta, lin)
        out.index_add_(0, tok, (h @ w2.t()).float() * tw[tok, slot][:, None])
    return out.to(z.dtype)


def moe_rows(out, Ts, E=896, k=16, DIN=3584, I=384, DOUT=3584):
    g = torch.Generator(device=DEV).manual_seed(0)
    p13, s13 = mxfp4_quantize(torch.randn(E, 2 * I, DIN, device=DEV, generator=g) * DIN**-0.5)
    p2, s2 = mxfp4_quantize(torch.randn(E, DOUT, I, device=DEV, generator=g) * I**-0.5)
    bias = torch.randn(E, device=DEV) * 0.1
    for T in Ts:
        lg = torch.randn(T, E, device=DEV)
        t_ro = bench(lambda: ops.moe_route(lg, bias, k))
        t_re = bench(lambda: reference.moe_route(lg, bias, k))
        emit("moe_route", f"T={T} E={E} k={k}", t_ro, t_re, "eager PyTorch", T * E * 4 / (t_ro * 1e-6), out=out)
        tw, ids = ops.moe_route(lg, bias, k)
        z = torch.randn(T, DIN, device=DEV, dtype=BF)
        kw = dict(w13_packed=p13, w13_scale=s13, w2_packed=p2, w2_scale=s2, situ_linear_beta=25.0)
        t_o = bench(lambda: ops.moe_experts(z, tw, ids, **kw))
        t_b = bench(lambda: moe_baseline(z, tw, ids, p13, s13, p2, s2), warmup=5, rep=50)
        n_act = int(torch.unique(ids).numel())
        nbytes = n_act * (2 * I * DIN // 2 + 2 * I * DIN // 32 + DOUT * I // 2 + DOUT * I // 32)
        emit("moe_experts mxfp4", f"T={T} E={E} k={k} active={n_act}", t_o, t_b, "dequant+matmul per expert",
             nbytes / (t_o * 1e-6), target="≥2x base", met=t_b / t_o >= 2.0, out=out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=330.0)
    ap.add_argument("--quick", action="store_true", help="a few small shapes only")
    ap.add_argument("--tsv", default=None)
    ap.add_argument("--only", nargs="+", default=None, metavar="SECTION",
                    help="run only these sections (linear kda-decode kda-decode-graph mla attn_res moe "
                         "kda-prefill)")
    ap.add_argument("--prefill-heads", type=int, nargs="+", default=None)
    ap.add_argument("--prefill-T", type=int, nargs="+", default=None)
    args = ap.parse_args()
    t0 = time.time()
    deadline = t0 + args.budget_s
    out = open(args.tsv, "w") if args.tsv else None
    print(f"# device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    ceilings()
    fla_chunk, fla_rec = try_fla()
    q = args.quick
    print(" | ".join(HEAD), flush=True)
    sections = [
        ("linear", lambda: linear_rows(out, ((2048, 2048),)) if q else linear_rows(out)),
        ("kda decode", lambda: kda_decode_rows(fla_rec, out, [32] if q else [12, 32, 96], [1, 256] if q else [1, 32, 256])),
        ("kda decode graph", lambda: kda_decode_graph_rows(out, [32] if q else [12, 32, 96])),
        ("mla", lambda: mla_rows(out, [(32, 1)] if q else [(12, 1), (32, 1), (96, 1), (32, 32), (96, 32)])),
        ("attn_res", lambda: attn_res_rows(out, [64] if q else [1, 64, 4096])),
        ("moe", lambda: moe_rows(out, [8] if q else [1, 8, 64])),
        ("kda prefill", lambda: kda_prefill_rows(
            fla_chunk, out, args.prefill_heads or ([32] if q else [32, 96, 12]),
            args.prefill_T or ([8192] if q else [4096, 8192, 16384, 32768, 65536]), not q, deadline)),
    ]
    for name, fn in sections:
        if args.only and name.replace(" ", "-") not in args.only:
            continue
        if time.time() > deadline and name != "kda prefill":
            print(f"# section {name} skipped (budget)", flush=True)
            continue
        ts = time.time()
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            print(f"# section {name} FAILED: {e!r}", flush=True)
        print(f"# section {name}: {time.time() - ts:.0f} s", flush=True)
        torch.cuda.empty_cache()
    print(f"\n# TABLE (ceilings: copy {CEIL['bw'] / 1e12:.2f} TB/s, bf16 mm {CEIL['mm'] / 1e12:.0f} TFLOP/s)")
    widths = [max(len(str(r[i])) for r in [HEAD] + ROWS) for i in range(len(HEAD))]
    for r in [HEAD] + ROWS:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |")
    print(f"# total {time.time() - t0:.0f} s")
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
