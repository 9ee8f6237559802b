"""Sampler overhead per engine step: milliseconds per call for a few batch sizes and knob mixes.

PYTHONSAFEPATH=1 .venv/bin/python benchmarks/sampler_overhead.py [--vocab 163840] [--batch 1 16 64]
    [--device cuda] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from k3serve.sampling_params import SamplingParams
from k3serve.workers.sampler import Sampler, SamplingState

sys.path.insert(0, os.path.dirname(__file__))
from _util import print_table, timeit  # noqa: E402

MIXES = {
    "greedy": lambda i: SamplingParams(temperature=0.0),
    "random": lambda i: SamplingParams(temperature=0.8),
    "seeded": lambda i: SamplingParams(temperature=0.8, seed=i),
    "top-k/p+min-p": lambda i: SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05),
    "penalties+lp5": lambda i: SamplingParams(
        temperature=0.8, repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.2, logprobs=5
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=512)
    args = ap.parse_args()
    torch.manual_seed(0)
    sampler = Sampler(seed=0)
    rows = []
    for n in args.batch:
        logits = torch.randn(n, args.vocab, device=args.device)
        for name, make in MIXES.items():
            states = [
                SamplingState.new(make(i), list(range(args.prompt_len)), eos_token_id=0) for i in range(n)
            ]
            for st in states:
                st.output_token_ids = list(range(64))
            sec = timeit(lambda: sampler(logits, states), repeat=args.repeat, warmup=1)  # noqa: B023
            rows.append([n, name, sec * 1e3, sec * 1e6 / n])
    print(f"vocab={args.vocab} device={args.device} prompt_len={args.prompt_len} output_len=64")
    print_table(["batch", "mix", "ms/step", "us/row"], rows)


if __name__ == "__main__":
    main()
