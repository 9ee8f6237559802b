"""CPU time per engine step spent outside the model: scheduling + input preparation.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/engine_overhead.py [--reqs 16 64 256] [--ctx 512] [--steps 50]

Runs the real Scheduler, HybridKVCacheManager (prefix caching on) and the model runner's
InputPreparer on the tiny preset's cache geometry with 16, 64 and 256 running decode requests
(context ~512 tokens each), excluding the forward pass, and prints microseconds per step and per
request, with the per-request cost relative to the smallest batch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import print_table  # noqa: E402

from k3serve.sampling_params import SamplingParams  # noqa: E402
from k3serve.workers.engine.block_pool import BlockPool  # noqa: E402
from k3serve.workers.engine.cache_layout import plan_cache_layout  # noqa: E402
from k3serve.workers.engine.kv_cache_manager import HybridKVCacheManager  # noqa: E402
from k3serve.workers.engine.model_runner import InputPreparer  # noqa: E402
from k3serve.workers.engine.request import Request  # noqa: E402
from k3serve.workers.engine.scheduler import Scheduler  # noqa: E402
from k3serve.workers.model.make_model import build_config  # noqa: E402


def measure(n_reqs: int, ctx: int = 512, steps: int = 50) -> tuple[float, float]:
    cfg = build_config("tiny")
    layout = plan_cache_layout(cfg, torch.float32, block_size=16)
    max_len = ctx + steps + 8
    blocks_per_req = len(layout.mla_groups) * (max_len // 16 + 2) + 3 * len(layout.kda_groups)
    pool = BlockPool(n_reqs * blocks_per_req + 64, block_size=16)
    kv = HybridKVCacheManager(layout, pool, enable_caching=True, hash_unit=16, retention=0)
    sched = Scheduler(kv, max_num_batched_tokens=max(8192, n_reqs * 2), max_num_seqs=n_reqs,
                      max_model_len=max_len)
    prep = InputPreparer(layout, "cpu", max(8192, n_reqs * 2), n_reqs, max_len)
    reqs = []
    for i in range(n_reqs):
        r = Request(f"r{i}", f"r{i}", 0, [(i * 7 + t) % 200 for t in range(ctx)], SamplingParams(max_tokens=10**6),
                    None)
        sched.add(r)
        reqs.append(r)
    # admit everything (prefill, done in a few steps), then time pure decode steps
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs):
        out = sched.schedule()
        prep.prepare(out)
        sched.end_step()
        for c in out.chunks:
            if c.sample:
                r = sched.requests[c.request_id]
                r.append_output(1)
                kv.update_hashes(r)
    t_sched = t_prep = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        prep.prepare(out)
        t2 = time.perf_counter()
        sched.end_step()
        for c in out.chunks:
            r = sched.requests[c.request_id]
            r.append_output(1)
            kv.update_hashes(r)
        t_sched += t1 - t0
        t_prep += t2 - t1
        assert len(out.chunks) == n_reqs
    return t_sched / steps, t_prep / steps


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reqs", type=int, nargs="+", default=[16, 64, 256], help="running decode requests")
    ap.add_argument("--ctx", type=int, default=512, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=50, help="timed decode steps")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows, base = [], None
    for n in args.reqs:
        s, p = measure(n, ctx=args.ctx, steps=args.steps)
        tot = s + p
        base = base or tot / n
        rows.append([n, s * 1e6, p * 1e6, tot * 1e6, tot / n * 1e6, (tot / n) / base])
    print(f"context {args.ctx} tokens, {args.steps} timed decode steps, tiny preset cache geometry, float32, CPU")
    print_table(["running reqs", "schedule us/step", "prepare us/step", "total us/step", "us/request",
                 f"per-request vs {args.reqs[0]}"], rows)


if __name__ == "__main__":
    main()
