"""Smoke tests of the CPU benchmarks: each script runs at its smallest settings and prints its table.

benchmarks/prefix_cache.py and benchmarks/engine_overhead.py run as subprocesses (as `make bench`
runs them); benchmarks/run_all.py's exit status and the agentic trace are checked in-process.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")
PREFIX_ROWS = ["off", "vllm-style/lru", "dense/lru", "dense/cpb", "interval-64/lru", "interval-64/cpb",
               "prompt-end/lru", "prompt-end/cpb", "prompt-end+marconi/lru", "prompt-end+marconi/cpb"]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    sys.path.insert(0, BENCH)  # the scripts import their siblings (_util, _agentic_trace) by plain name
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(BENCH)
    return mod


def _run(script: str, *args: str) -> str:
    env = dict(os.environ, PYTHONSAFEPATH="1")
    proc = subprocess.run([sys.executable, os.path.join(BENCH, script), *args], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _table(out: str, first_header: str) -> tuple[list[str], list[list[str]]]:
    """The printed table whose header line starts with `first_header`: (headers, rows of cells)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first_header))
    headers = re.split(r"\s{2,}", lines[start].strip())
    assert set(lines[start + 1].replace(" ", "")) == {"-"}, lines[start + 1]
    rows = []
    for line in lines[start + 2:]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        assert len(cells) == len(headers), line
        rows.append(cells)
    return headers, rows


def test_prefix_cache_smallest_run(tiny_model_dir):
    out = _run("prefix_cache.py", "--quick", "--sessions", "2", "--turns", "2", "--shared-len", "32",
               "--new-min", "16", "--new-max", "16", "--output-tokens", "2", "--model", str(tiny_model_dir))
    assert "command: PYTHONSAFEPATH=1" in out and "budget: kv_cache_memory=" in out
    headers, rows = _table(out, "config")
    assert [r[0] for r in rows] == PREFIX_ROWS
    col = {h: i for i, h in enumerate(headers)}
    by = {r[0]: r for r in rows}
    assert all(r[col["tokens==off"]] == "True" for r in rows)
    # caching off computes every prompt token of the trace: 2 x (32+16) + 2 x (48+2+16)
    total = int(re.search(r"(\d+) prompt tokens in all", out).group(1))
    assert total == 2 * 48 + 2 * 66
    assert int(by["off"][col["prefill computed"]]) == total
    assert float(by["off"][col["hit%"]]) == 0.0
    # turn 1 replays turn 0: every unit-hashed caching row reuses something and computes less
    for label in PREFIX_ROWS[2:]:
        assert float(by[label][col["hit%"]]) > 0, label
        assert int(by[label][col["prefill computed"]]) < total, label
        assert float(by[label][col["peak KDA MiB"]]) > 0, label
    assert float(by["dense/lru"][col["hit/dense"]]) == 1.0


def test_engine_overhead_smallest_run():
    out = _run("engine_overhead.py", "--reqs", "4", "8", "--ctx", "64", "--steps", "3")
    headers, rows = _table(out, "running reqs")
    assert headers[:4] == ["running reqs", "schedule us/step", "prepare us/step", "total us/step"]
    assert [r[0] for r in rows] == ["4", "8"]
    for r in rows:
        sched, prep, total = (float(x) for x in r[1:4])
        assert sched > 0 and prep > 0
        assert total == pytest.approx(sched + prep, rel=0.01, abs=0.01)
    assert float(rows[0][-1]) == 1.0


def test_run_all_exit_status(tmp_path, monkeypatch, capfd):
    run_all = _load("run_all")
    ok = tmp_path / "ok.py"
    ok.write_text("print('table-ok')\n")
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nprint('table-bad')\nsys.exit(3)\n")
    monkeypatch.setattr(run_all, "CPU_BENCHMARKS", [("good", str(ok), []), ("broken", str(bad), ["--x"])])
    assert run_all.main([]) == 1
    out = capfd.readouterr().out
    assert "table-ok" in out and "table-bad" in out
    assert f"=== broken: PYTHONSAFEPATH=1 {sys.executable} {bad} --x" in out
    assert "broken: FAILED (exit 3)" in out and "good: ok" in out
    monkeypatch.setattr(run_all, "CPU_BENCHMARKS", [("good", str(ok), [])])
    assert run_all.main([]) == 0


def test_run_all_lists_the_cpu_benchmarks(capsys):
    run_all = _load("run_all")
    assert run_all.main(["--list"]) == 0
    out = capsys.readouterr().out
    for name, script in (("engine_overhead", "engine_overhead.py"), ("sampler_overhead", "sampler_overhead.py"),
                         ("prefix_cache", "prefix_cache.py")):
        assert re.search(rf"^{name}: PYTHONSAFEPATH=1 .*{script}", out, re.M), out
    assert "prefix_cache.py --quick" in out


def test_agentic_trace_replays_previous_turns():
    trace_mod = _load("_agentic_trace")
    tr = trace_mod.make_trace(3, 4, shared_len=20, new_min=5, new_max=9, output_tokens=2, seed=7)
    assert tr == trace_mod.make_trace(3, 4, shared_len=20, new_min=5, new_max=9, output_tokens=2, seed=7)
    assert tr.num_sessions == 3 and tr.num_turns == 4
    for s in range(3):
        prompt, reply, lengths = None, None, []
        for t in range(4):
            nxt = tr.prompt(s, t, prompt, reply)
            assert nxt[:20] == tr.shared
            if t:
                assert nxt[:len(prompt)] == prompt and nxt[len(prompt):len(prompt) + 2] == reply
            assert 5 <= len(tr.new_text[s][t]) <= 9 and nxt[-len(tr.new_text[s][t]):] == tr.new_text[s][t]
            prompt, reply = nxt, [1000 + t, 2000 + t]
            lengths.append(len(nxt))
        assert tr.prompt_lengths(s) == lengths
    assert tr.total_prompt_tokens() == sum(sum(tr.prompt_lengths(s)) for s in range(3))
    assert tr.max_length() == max(tr.prompt_lengths(s)[-1] for s in range(3)) + 2
    # block 16: shared 20 tokens = 1 full block counted once; per session ceil(end/16) - 1 + 3 snapshot pages
    want = 1 + sum(-(-(tr.prompt_lengths(s)[-1] + 2) // 16) - 1 + 3 for s in range(3))
    assert tr.working_set_blocks(16, 3) == want
    with pytest.raises(ValueError):
        tr.prompt(0, 1, None, None)


def test_mixed_step_smallest_run():
    """benchmarks/mixed_step.py (issue 19's mixed-step row) on the CPU: the parts and the mixed step are timed and
    the ratio column is mixed / (decode + prefill). (No ordering of the times is asserted: one repeat on a shared
    2-core machine can time the mixed step below the decode part alone.)"""
    out = _run("mixed_step.py", "--device", "cpu", "--preset", "tiny", "--chunk", "48", "--context", "16",
               "--repeats", "1", "--host", "5")
    # --host 5: one more prefill step under cProfile, its 5 functions of most own time, the forward's ops among them
    m = re.search(r"# prefill step under cProfile: (\d+) µs wall; top 5 functions.*\n((?:#   .*\n){5})", out)
    assert m and int(m.group(1)) > 0, out
    owns = [float(ln.split()[1]) for ln in m.group(2).splitlines()]
    assert owns == sorted(owns, reverse=True) and owns[0] > 0, m.group(2)
    headers, rows = _table(out, "measure")
    assert headers[-1] == "mixed / (decode + prefill)"
    assert [r[0] for r in rows] == ["wall", "op self time (CPU stand-in)"]
    for r in rows:
        dec, pre, mixed, ratio = (float(c) for c in r[1:])
        assert dec > 0 and pre > 0 and mixed > 0
        assert abs(ratio - mixed / (dec + pre)) < 2e-3


def test_mixed_step_loads_a_checkpoint(tmp_path):
    """mixed_step.py --model DIR runs a saved checkpoint (a `tiny` one here; on the GPU vs_transformers.py
    --save-model's) instead of generating --preset's; a directory without config.json is a usage error (exit 2)."""
    from k3serve.workers.model.make_model import make_model

    make_model(str(tmp_path), "tiny")
    out = _run("mixed_step.py", "--device", "cpu", "--model", str(tmp_path), "--chunk", "24", "--context", "8",
               "--decodes", "2", "--repeats", "1")
    assert f"# {tmp_path}, cpu, float32: 2 decodes of 8-token prompts + one 24-token prefill chunk" in out, out
    assert [r[0] for r in _table(out, "measure")[1]] == ["wall", "op self time (CPU stand-in)"]
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "mixed_step.py"), "--device", "cpu", "--model",
                           str(empty)], env=dict(os.environ, PYTHONSAFEPATH="1"), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "no config.json" in proc.stderr, proc.stderr


def test_set_module_constants():
    """`--set MODULE.NAME=VALUE` (benchmarks/_util.py apply_sets, shared by mixed_step, decode_roofline and
    vs_transformers): ints where they parse, strings otherwise; a missing module or name, or no `=`, exits 2."""
    import argparse

    from k3serve.workers.engine import k3_forward

    util = _load("_util")
    ap = argparse.ArgumentParser()
    before = k3_forward.FUSED_ADD_NORM
    try:
        util.apply_sets(ap, ["k3serve.workers.engine.k3_forward.FUSED_ADD_NORM=0"])
        assert k3_forward.FUSED_ADD_NORM == 0
        util.apply_sets(ap, ["k3serve.workers.engine.k3_forward.FUSED_ADD_NORM=x-1"])
        assert k3_forward.FUSED_ADD_NORM == "x-1"
    finally:
        k3_forward.FUSED_ADD_NORM = before
    for bad in ("k3serve.no_such_module.X=1", "k3serve.workers.engine.k3_forward.NO_SUCH=1",
                "k3serve.workers.engine.k3_forward.FUSED_ADD_NORM", "NOMODULE=1"):
        with pytest.raises(SystemExit) as e:
            util.apply_sets(ap, [bad])
        assert e.value.code == 2


def test_ab_alternation_and_summary():
    """`alternate` (decode_roofline.py --ab): side 0 and side 1 once a round, the order flipped every round, so a
    drift of the machine lands on both sides; `ab_summary`: the medians and the per-round B/A ratios' median and
    range; `parse_ab`: MODULE.NAME=A,B with ints where they parse, anything else exits 2."""
    import argparse

    util = _load("_util")
    calls = []
    clock = iter(range(1, 100))

    def measure(side):  # a machine that slows down by 1 every call: side 1 costs twice side 0
        calls.append(side)
        return (1 + side) * next(clock)

    vals = util.alternate(measure, 4)
    assert calls == [0, 1, 1, 0, 0, 1, 1, 0]
    assert vals == [[1, 4, 5, 8], [4, 6, 12, 14]]
    a, b, ratio, lo, hi = util.ab_summary(vals)
    assert (a, b) == (4.5, 9.0) and (lo, hi) == (1.5, 4.0) and ratio == pytest.approx((2.4 + 1.75) / 2)
    with pytest.raises(ValueError):
        util.alternate(measure, 0)
    ap = argparse.ArgumentParser()
    assert util.parse_ab(ap, "k3serve.x.Y=0,1") == ("k3serve.x.Y", [0, 1])
    assert util.parse_ab(ap, "m.N=atomic,loop") == ("m.N", ["atomic", "loop"])
    for bad in ("m.N=1", "m.N=1,2,3", "N=1,2", "m.N", "m.N=1,"):
        with pytest.raises(SystemExit) as e:
            util.parse_ab(ap, bad)
        assert e.value.code == 2
    # decode_roofline.py checks --ab (and the knob it names) before it needs a GPU
    for bad, msg in (("k3serve.workers.engine.k3_forward.NO_SUCH=0,1", "has no"), ("x=1", "MODULE.NAME=A,B")):
        proc = subprocess.run([sys.executable, os.path.join(BENCH, "decode_roofline.py"), "--ab", bad],
                              env=dict(os.environ, PYTHONSAFEPATH="1"), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and msg in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_sweep_moe_prefill_tiles_argument():
    """`sweep_moe_prefill.py --tiles BM:BN1xBK1,BN2xBK2:W1,W2:S`: parsed into (block rows, tiles, warps, stages or
    None for "-"); a malformed or non-power-of-two entry is an argument error (exit 2) before any GPU work."""
    mod = _load("sweep_moe_prefill")
    assert mod.parse_tiles("64:128x64,128x32:8,4:3") == (64, (128, 64, 128, 32), (8, 4), 3)
    assert mod.parse_tiles("128:64x64,64x64:4,4:-") == (128, (64, 64, 64, 64), (4, 4), None)
    for bad in ("64:128x64:8,4:3", "64:128x64,128x64:8:3", "64:96x64,64x64:4,4:3", "x:64x64,64x64:4,4:3", ""):
        with pytest.raises(ValueError):
            mod.parse_tiles(bad)
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "sweep_moe_prefill.py"), "--tiles", "64:12x64"],
                          env=dict(os.environ, PYTHONSAFEPATH="1"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--tiles" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_sweep_moe_prefill_without_cuda():
    """benchmarks/sweep_moe_prefill.py is GPU-only: on this CPU machine it imports, parses its arguments and exits 2
    with a message naming the missing device (no traceback)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the GPU run is the benchmark itself")
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "sweep_moe_prefill.py"), "--T", "64"],
                          env=dict(os.environ, PYTHONSAFEPATH="1"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "needs a CUDA device" in proc.stderr and "Traceback" not in proc.stderr, (
        proc.stdout + proc.stderr)
