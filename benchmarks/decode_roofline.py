"""Engine decode throughput for the `small` preset next to the memory roofline of the same step.

    PYTHONSAFEPATH=1 python benchmarks/decode_roofline.py [--batches 1 8 64] [--prompt 256] [--steps 32]

Makes the `small` checkpoint on the GPU (make_model), measures the device copy bandwidth, then per batch
size B runs `LLM(..., device="cuda")`: the time of a generate with max_tokens = 1 + steps minus the time of
one with max_tokens = 1 (same prompts) gives the decode time of `steps` steps. Roofline of one step =
bytes that must move / copy bandwidth, with bytes = every non-expert weight once + the expected number of
distinct active experts per MoE layer (E·(1-(1-k/E)^B)) x their packed bytes + KDA recurrent and conv
state read+write per sequence and KDA layer + the MLA latent cache read per sequence and MLA layer.
Prints one table: B, decode tokens/s, roofline tokens/s, fraction. (Not yet run on a GPU: written in the
session whose device time ran out. The engine replays decode steps from captured CUDA graphs by default
on CUDA; pass --enforce-eager to compare without them.)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch


def copy_bandwidth() -> float:
    a = torch.randn(1 << 28, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        b.copy_(a)
    torch.cuda.synchronize()
    return 20 * 2 * a.numel() * 4 / (time.perf_counter() - t)


def step_bytes(cfg, weights: dict, batch: int, ctx: int) -> float:
    expert_bytes, other = 0, 0
    n_moe = 0
    for name, w in weights.items():
        nb = w.numel() * w.element_size()
        if ".experts." in name:
            expert_bytes += nb
        else:
            other += nb
    for i in range(cfg.num_hidden_layers):
        n_moe += int(cfg.is_moe_layer(i))
    E, k = cfg.num_experts, cfg.num_experts_per_token
    per_expert = expert_bytes / max(1, n_moe * E)
    active = E * (1 - (1 - k / E) ** batch)
    kda_layers = sum(int(cfg.is_kda_layer(i)) for i in range(cfg.num_hidden_layers))
    mla_layers = cfg.num_hidden_layers - kda_layers
    h, d = cfg.kda_num_heads, cfg.kda_head_dim
    state = 2 * (h * d * d * 4 + 3 * h * d * (4 - 1) * 2)  # fp32 state + bf16 conv state, read + write
    mla = ctx * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    return other + n_moe * active * per_expert + batch * (kda_layers * state + mla_layers * mla)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (compare against them)")
    args = ap.parse_args()
    from k3serve.workers.llm import LLM
    from k3serve.workers.model.make_model import make_model
    from k3serve.workers.sampling_params import SamplingParams

    bw = copy_bandwidth()
    print(f"# copy bandwidth {bw / 1e12:.2f} TB/s")
    with tempfile.TemporaryDirectory() as d:
        cfg = make_model(d, "small", device="cuda")
        llm = LLM(d, device="cuda", dtype="bfloat16", max_num_seqs=max(args.batches),
                  max_model_len=args.prompt + args.steps + 8, enforce_eager=args.enforce_eager)
        weights = llm.engine.runner.model.w  # the engine's own weights: their sizes give the step's bytes
        rows = []
        for B in args.batches:
            prompts = [[(7 * i + j) % 500 + 10 for j in range(args.prompt)] for i in range(B)]
            sp1 = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            spn = SamplingParams(max_tokens=1 + args.steps, temperature=0.0, ignore_eos=True)
            llm.generate(prompts, sp1)  # warm-up (kernel compiles)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate(prompts, sp1)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            llm.generate(prompts, spn)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            dec = (t2 - t1) - (t1 - t0)
            tok_s = B * args.steps / dec
            roof = B / (step_bytes(cfg, weights, B, args.prompt + args.steps // 2) / bw)
            rows.append((B, tok_s, roof))
        print("| batch | decode tok/s | roofline tok/s | fraction |")
        for B, tok_s, roof in rows:
            print(f"| {B} | {tok_s:.0f} | {roof:.0f} | {100 * tok_s / roof:.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
