"""benchmarks/host_step.py at its smallest settings: one row per batch size, three positive timings each, and the
model_runner.GRAPH_GREEDY default restored in the process after it."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "host_step.py")


def test_host_step_table():
    env = dict(os.environ, PYTHONSAFEPATH="1")
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--batches", "1", "3", "--steps", "3", "--repeats", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [
        line.split("|")[1:-1]
        for line in proc.stdout.splitlines()
        if line.startswith("| ") and "µs" not in line
    ]
    assert [int(r[0]) for r in rows] == [1, 3]
    for r in rows:
        assert all(float(c) > 0 for c in r[1:5]) and r[5].strip().endswith("x")
