"""benchmarks/_util.py: aligned tables and median timing."""

from __future__ import annotations

import importlib.util
import io
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "_util.py")
_spec = importlib.util.spec_from_file_location("bench_util", _PATH)
util = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(util)


def test_table_alignment():
    buf = io.StringIO()
    util.print_table(["name", "n", "ms"], [["a", 1, 0.5], ["longer", 123, 12.25]], file=buf)
    lines = buf.getvalue().splitlines()
    assert lines == [
        "name      n     ms",
        "------  ---  -----",
        "a         1    0.5",
        "longer  123  12.25",
    ]
    assert len({len(line) for line in lines}) == 1


def test_cells_and_errors():
    assert util.format_cell(1234567.0) == "1.235e+06"
    assert util.format_cell(0.00012) == "1.200e-04"
    assert util.format_cell(12345.6) == "12346"
    assert util.format_cell(None) == "None"
    with pytest.raises(ValueError):
        util.format_table(["a", "b"], [[1]])
    assert util.format_table(["x"], []) == "x\n-"


def test_timeit_returns_median_and_runs_warmup(monkeypatch):
    clock = iter([0.0, 1.0, 10.0, 13.0, 20.0, 22.0])  # durations 1, 3, 2 -> median 2
    monkeypatch.setattr(util.time, "perf_counter", lambda: next(clock))
    calls, syncs = [], []
    med = util.timeit(lambda: calls.append(1), repeat=3, warmup=2, sync=lambda: syncs.append(1))
    assert med == 2.0
    assert len(calls) == 5 and len(syncs) == 6
    with pytest.raises(ValueError):
        util.timeit(lambda: None, repeat=0)


def test_timeit_real_clock():
    t = util.timeit(lambda: sum(range(1000)), repeat=3, warmup=0, sync=None)
    assert 0.0 < t < 1.0
