"""CPU time per engine step spent outside the model: scheduling + input preparation, ours vs before.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/engine_overhead.py [--reqs 16 64 256 1024] [--ctx 512] [--steps 50]

Runs the real Scheduler, KVCacheCoordinator (prefix caching on) and the model runner's
InputPreparer on the tiny preset's cache geometry with N running decode requests (context ~512
tokens each), excluding the forward pass, and prints microseconds per step and per request. In the
same run, the same workload goes through the code path from before the scheduler emitted deltas
(benchmarks/_engine_before/: whole block tables rebuilt and resent every step), so each row shows
ours, before, and their ratio; the last column is our per-request cost relative to the smallest batch
(flat = the per-step cost grows linearly with the batch, no worse). Both paths run with the pool
frozen out of the cyclic GC (`gc.freeze()` after set-up, `LLMEngine.freeze_gc()`; `--gc default`
leaves Python's GC alone, whose full collections over the pool dominate at 1024 requests).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import print_table  # noqa: E402

from k3serve.sampling_params import SamplingParams  # noqa: E402
from k3serve.workers.engine.cache_layout import plan_cache_layout  # noqa: E402
from k3serve.workers.engine.kv_cache.block_pool import BlockPool  # noqa: E402
from k3serve.workers.engine.kv_cache.coordinator import KVCacheCoordinator  # noqa: E402
from k3serve.workers.engine.model_runner import InputPreparer  # noqa: E402
from k3serve.workers.engine.request import Request  # noqa: E402
from k3serve.workers.engine.scheduler import Scheduler  # noqa: E402
from k3serve.workers.model.make_model import build_config  # noqa: E402

FREEZE_GC = True


def _geometry(n_reqs: int, ctx: int, steps: int):
    cfg = build_config("tiny")
    layout = plan_cache_layout(cfg, torch.float32, block_size=16)
    max_len = ctx + steps + n_reqs * ctx // 8192 + 8  # early requests decode while later ones prefill
    blocks_per_req = len(layout.mla_groups) * (max_len // 16 + 2) + 3 * len(layout.kda_groups)
    return layout, max_len, n_reqs * blocks_per_req + 64


def _prompt(i: int, ctx: int) -> list[int]:
    return [(i * 7 + t) % 200 for t in range(ctx)]


def measure(n_reqs: int, ctx: int = 512, steps: int = 50) -> tuple[float, float]:
    """Ours: (schedule s/step, prepare s/step)."""
    layout, max_len, nblocks = _geometry(n_reqs, ctx, steps)
    pool = BlockPool(nblocks, block_size=16)
    kv = KVCacheCoordinator(layout, pool, enable_caching=True, hash_unit=16, retention=0)
    sched = Scheduler(kv, max_num_batched_tokens=max(8192, n_reqs * 2), max_num_seqs=n_reqs, max_model_len=max_len)
    prep = InputPreparer(layout, "cpu", max(8192, n_reqs * 2), n_reqs, max_len)
    if FREEZE_GC:
        gc.collect()
        gc.freeze()  # LLMEngine.freeze_gc(): the pool's blocks are never scanned by the cyclic GC
    reqs = []
    for i in range(n_reqs):
        r = Request(f"r{i}", f"r{i}", 0, _prompt(i, ctx), SamplingParams(max_tokens=10**6), None)
        sched.add(r)
        reqs.append(r)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs):
        out = sched.schedule()
        prep.apply(out)
        prep.prepare(out)
        sched.end_step()
        sched.update_from_output(out, {c.request_id: 1 for c in out.chunks if c.sample})
    t_sched = t_prep = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        prep.apply(out)
        prep.prepare(out)
        t2 = time.perf_counter()
        sched.end_step()
        sched.update_from_output(out, {c.request_id: 1 for c in out.chunks})
        t_sched += t1 - t0
        t_prep += t2 - t1
        assert len(out.chunks) == n_reqs
    return t_sched / steps, t_prep / steps


def measure_before(n_reqs: int, ctx: int = 512, steps: int = 50) -> tuple[float, float]:
    """The same workload through benchmarks/_engine_before (the path before deltas)."""
    from _engine_before.block_pool import BlockPool as OldPool
    from _engine_before.kv_cache_manager import HybridKVCacheManager
    from _engine_before.model_runner import InputPreparer as OldPreparer
    from _engine_before.request import Request as OldRequest
    from _engine_before.scheduler import Scheduler as OldScheduler

    layout, max_len, nblocks = _geometry(n_reqs, ctx, steps)
    pool = OldPool(nblocks, block_size=16)
    kv = HybridKVCacheManager(layout, pool, enable_caching=True, hash_unit=16, retention=0)
    sched = OldScheduler(kv, max_num_batched_tokens=max(8192, n_reqs * 2), max_num_seqs=n_reqs,
                         max_model_len=max_len)
    prep = OldPreparer(layout, "cpu", max(8192, n_reqs * 2), n_reqs, max_len)
    if FREEZE_GC:
        gc.collect()
        gc.freeze()  # the same GC treatment for the old path, so the comparison is the code's alone
    reqs = []
    for i in range(n_reqs):
        r = OldRequest(f"r{i}", f"r{i}", 0, _prompt(i, ctx), SamplingParams(max_tokens=10**6), None)
        sched.add(r)
        reqs.append(r)
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
    ap.add_argument("--reqs", type=int, nargs="+", default=[16, 64, 256, 1024], help="running decode requests")
    ap.add_argument("--ctx", type=int, default=512, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=50, help="timed decode steps")
    ap.add_argument("--gc", choices=("freeze", "default"), default="freeze",
                    help="freeze: gc.freeze() after set-up (LLMEngine.freeze_gc(), a serving process); default: "
                         "Python's cyclic GC untouched (full collections scan the whole pool)")
    args = ap.parse_args(argv)
    global FREEZE_GC
    FREEZE_GC = args.gc == "freeze"
    torch.set_num_threads(1)
    rows, base = [], None
    for n in args.reqs:
        s, p = measure(n, ctx=args.ctx, steps=args.steps)
        bs, bp = measure_before(n, ctx=args.ctx, steps=args.steps)
        tot, btot = s + p, bs + bp
        base = base or tot / n
        rows.append([n, s * 1e6, p * 1e6, tot * 1e6, btot * 1e6, btot / tot, tot / n * 1e6, btot / n * 1e6,
                     (tot / n) / base])
    print(f"context {args.ctx} tokens, {args.steps} timed decode steps, tiny preset cache geometry, float32, CPU, "
          f"gc {args.gc}; "
          "'before' = benchmarks/_engine_before (whole block tables every step), same run")
    print_table(["running reqs", "schedule us/step", "prepare us/step", "total us/step", "before us/step",
                 "before/ours", "us/request", "before us/request", f"per-request vs {args.reqs[0]}"], rows)


if __name__ == "__main__":
    main()
