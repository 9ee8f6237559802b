"""benchmarks/spec_decode.py runs end to end (smallest sizes) and prints every row with its ratios."""

from __future__ import annotations

import os
import sys

import pytest

from k3serve.workers.model.paths import DEMO_MODEL_DIR

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


@pytest.mark.skipif(not (DEMO_MODEL_DIR / "config.json").exists(), reason="demo model not in the tree")
def test_spec_decode_benchmark_smallest_run(capsys):
    import spec_decode

    spec_decode.main(["--device", "cpu", "--prompts", "1", "--max-tokens", "6", "--prompt-tokens", "24",
                      "--k", "2", "--threads", "1"])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("code", "entropy"))]
    assert len(rows) == 16
    rows, split = rows[:8], rows[8:]  # the speed table, then where a step's time goes
    for r in split:  # set, config (one or two words), steps, step wall, verify fwd, decode fwd, drafting, host
        assert int(r[-6]) > 0 and float(r[-5]) > 0
        if r[1] == "baseline":
            assert r[-4] == "nan" and float(r[-2]) == 0  # no verify steps, no drafting
    assert "measured requests only" in out
    for r in rows:
        assert r[-2] == "1/1"  # greedy: the same tokens as the baseline
        assert float(r[2 + (r[1] != "baseline")]) > 0  # tok/s/user
    assert [r[1] for r in rows[:1]] == ["baseline"]
