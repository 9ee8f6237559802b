"""Host time of a whole engine decode step with the forward pass stubbed out, session 7's host changes on and off.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/host_step.py [--batches 1 8 64] [--steps 64] [--repeats 6]

The engine (`LLMEngine`, tiny preset, float32, CPU, tokenizer on, `static_decode=True` so decode steps take the
fixed-shape path the CUDA graphs replay) runs `--batches` greedy requests of `--steps` new tokens; the model's
forward returns a fixed logits tensor, so what is timed is the step's Python and torch work on the host:
scheduling, input preparation, sampling or taking the step's argmax ids, the scheduler's update, detokenization and
the outputs. Columns: "s6" = the sampler every step (workers/engine/model_runner.py GRAPH_GREEDY off), one
RequestOutput per request per step (LLMEngine.final_outputs_only off) and token-by-token detokenization
(LLMEngine.defer_detokenization off); "greedy ids" = GRAPH_GREEDY on; "+final only" = and final_outputs_only on;
"s7" = all three on (the defaults). They are timed in turn, `--repeats` rounds, and the best of each counts (a
noisy neighbour on a shared CPU hurts none more than the others). On the GPU host the same Python runs between
graph replays (benchmarks/decode_roofline.py --breakdown, "outside the graph").
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

from k3serve.sampling_params import SamplingParams
from k3serve.workers.engine import model_runner
from k3serve.workers.llm import LLM
from k3serve.workers.model.make_model import make_model

# (GRAPH_GREEDY, LLMEngine.final_outputs_only, LLMEngine.defer_detokenization)
MODES = {
    "s6": (False, False, False),
    "greedy ids": (True, False, False),
    "+final only": (True, True, False),
    "s7": (True, True, True),
}


def per_step_us(eng, prompts, steps: int, greedy: bool, final_only: bool, defer: bool) -> float:
    model_runner.GRAPH_GREEDY = greedy
    eng.final_outputs_only = final_only
    eng.defer_detokenization = defer
    sp = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for p in prompts:
        eng.add_request(eng.next_request_id(), p, sp.clone())
    eng.step()  # the prefill
    n = 0
    t = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
        n += 1
    return (time.perf_counter() - t) / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    d = tempfile.mkdtemp()
    make_model(d, "tiny")
    B_max = max(args.batches)
    llm = LLM(d, dtype="float32", max_model_len=32 + args.steps + 8, max_num_seqs=B_max, static_decode=True)
    eng = llm.engine
    fixed = torch.randn(max(B_max, *eng.runner.capture_sizes), eng.model_config.vocab_size)
    eng.runner.model.forward = lambda b: fixed[: b.logits_indices.shape[0]]
    before = model_runner.GRAPH_GREEDY
    print("| batch | " + " | ".join(f"{m} µs/step" for m in MODES) + " | s6 / s7 |")
    print("|---|" + "---|" * (len(MODES) + 1))
    try:
        for B in args.batches:
            prompts = [[(7 * i + j) % 200 + 10 for j in range(32)] for i in range(B)]
            per_step_us(eng, prompts, 4, True, True, True)  # warm-up
            best = {m: float("inf") for m in MODES}
            for _ in range(args.repeats):
                for m, knobs in MODES.items():
                    best[m] = min(best[m], per_step_us(eng, prompts, args.steps, *knobs))
            print(
                f"| {B} | "
                + " | ".join(f"{best[m]:.0f}" for m in MODES)
                + f" | {best['s6'] / best['s7']:.2f}x |",
                flush=True,
            )
    finally:
        model_runner.GRAPH_GREEDY = before
    return 0


if __name__ == "__main__":
    sys.exit(main())
