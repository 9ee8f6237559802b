"""Run the CPU benchmarks one after another (what `make bench` does).

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/run_all.py [--list]

Each benchmark runs as its own script (a subprocess with this interpreter, PYTHONSAFEPATH=1); its
command is printed before it and its output (the table) streams through. The exit status is 0 when
every benchmark exited 0, else 1; a summary line per benchmark ends the run. `kernels.py` and
`decode_roofline.py` need a CUDA GPU and are not part of this CPU run.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# (name, script, arguments): the CPU benchmarks, cheapest first
CPU_BENCHMARKS: list[tuple[str, str, list[str]]] = [
    ("engine_overhead", "engine_overhead.py", []),
    ("sampler_overhead", "sampler_overhead.py", ["--device", "cpu"]),
    ("prefix_cache", "prefix_cache.py", ["--quick"]),
]


def command(script: str, args: list[str]) -> list[str]:
    """The argv that runs `script` (a file in benchmarks/) with this interpreter."""
    return [sys.executable, os.path.join(HERE, script), *args]


def run_one(name: str, argv: list[str]) -> tuple[int, float]:
    """Run one benchmark with its output streaming to ours; returns (exit status, seconds)."""
    env = dict(os.environ, PYTHONSAFEPATH="1")
    print(f"=== {name}: PYTHONSAFEPATH=1 {shlex.join(argv)}", flush=True)
    t0 = time.perf_counter()
    rc = subprocess.call(argv, env=env)
    dt = time.perf_counter() - t0
    print(f"=== {name}: exit {rc} in {dt:.1f} s\n", flush=True)
    return rc, dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="print the commands without running them")
    args = ap.parse_args(argv)
    if args.list:
        for name, script, extra in CPU_BENCHMARKS:
            print(f"{name}: PYTHONSAFEPATH=1 {shlex.join(command(script, extra))}")
        return 0
    results = [(name, *run_one(name, command(script, extra))) for name, script, extra in CPU_BENCHMARKS]
    print("summary:")
    for name, rc, dt in results:
        print(f"  {name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} ({dt:.1f} s)")
    return 0 if all(rc == 0 for _, rc, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
