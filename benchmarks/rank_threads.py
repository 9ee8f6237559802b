"""Torch threads of a multi-rank engine's ranks: each rank its share of the host's CPUs vs every rank all of them.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/rank_threads.py [--tokens 128] [--reps 5] [--ranks 2]

One TP(+EP) engine of the random model of benchmarks/parallel_comm.py (random_config(27), float32), run
twice in the same process: the baseline with K3SERVE_RANK_THREADS = the host's CPU count (what every
spawned rank ran before workers/engine/parallel/threads.py: torch's default pool, one thread per CPU, in
every rank), then ours (unset: max(1, CPUs // ranks on the host) per rank, rank 0 included). Median wall
time of a --tokens-token prefill step and of a decode step (--ranks requests), and baseline / ours.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _util import print_table  # noqa: E402
from parallel_comm import SEED, _decode_step_time, _opts, _prefill_step_time  # noqa: E402


def run(d: Path, cfg, ranks: int, tokens: int, reps: int, threads: int | None) -> tuple[float, float, list[int]]:
    """(prefill s, decode s, torch threads of every rank) of one engine; `threads` None = the default rule."""
    from k3serve.workers.engine.parallel.threads import ENV
    from k3serve.workers.llm import LLM

    if threads is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = str(threads)
    prompt = [(7 * i) % cfg.vocab_size for i in range(tokens)]
    llm = LLM(str(d), tensor_parallel_size=ranks, enable_expert_parallel=True, **_opts(tokens))
    try:
        seen = list(llm.engine.runner.rank_threads)  # what each rank reported when it had loaded
        pre = _prefill_step_time(llm, prompt, reps)
        dec = _decode_step_time(llm, prompt[:16], reps, ranks)
    finally:
        llm.engine.runner.close()
        os.environ.pop(ENV, None)
    return pre, dec, seen


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128, help="prefill tokens")
    p.add_argument("--reps", type=int, default=5, help="timed prefill and decode steps (median)")
    p.add_argument("--ranks", type=int, default=2, help="tensor-parallel ranks")
    a = p.parse_args(argv)
    import torch

    from k3serve.workers.engine.parallel.threads import host_cpus, rank_threads
    from k3serve.workers.model.testing import write_random_model

    cpus = host_cpus()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "m"
        cfg, _ = write_random_model(d, seed=SEED, dtype=torch.float32)
        base = run(d, cfg, a.ranks, a.tokens, a.reps, cpus)
        ours = run(d, cfg, a.ranks, a.tokens, a.reps, None)
    print(f"TP={a.ranks} + EP, random_config({SEED}) float32, {cpus} host CPUs; threads per rank: baseline {cpus}, "
          f"ours {rank_threads(a.ranks)} (as the ranks report them, rank 0 first: baseline {base[2]}, ours {ours[2]})")
    print_table(["threads per rank", f"{a.tokens}-token prefill ms", f"decode ms/step ({a.ranks} req)"],
                [[f"baseline: {cpus} (all CPUs)", base[0] * 1e3, base[1] * 1e3],
                 [f"ours: {rank_threads(a.ranks)} (CPUs // ranks)", ours[0] * 1e3, ours[1] * 1e3],
                 ["baseline / ours", base[0] / ours[0], base[1] / ours[1]]])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
