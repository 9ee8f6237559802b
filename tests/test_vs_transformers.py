"""benchmarks/vs_transformers.py at its smallest: the engine's greedy tokens equal transformers' batched,
left-padded `generate` (exact PyTorch path, float32) on a transformers-saved Kimi-Linear checkpoint, for a
mixed-length batch; the script prints its table and rejects bad arguments with exit code 2."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "vs_transformers.py")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONSAFEPATH="1")
    return subprocess.run([sys.executable, SCRIPT, *args], env=env, capture_output=True, text=True, timeout=300)


def test_tiny_run_agrees_with_transformers_on_every_request():
    p = _run("--size", "tiny", "--num-prompts", "5", "--min-len", "3", "--max-len", "40", "--new-tokens", "6",
             "--repeats", "1", "--threads", "1", "--slow-steps", "2")
    assert p.returncode == 0, p.stdout + p.stderr
    row = [ln for ln in p.stdout.splitlines() if ln.split()[:1] == ["5"]]
    assert len(row) == 1 and row[0].split()[-1] == "5/5", p.stdout
    ratio = float(row[0].split()[4])
    assert ratio > 0
    # --slow-steps: one more run, every step timed, as many steps as a timed run took, the 2 slowest listed
    counts = re.search(r"engine per timed run: steps (\d+)", p.stdout)
    slow = re.search(r"a run after the timed ones: (\d+) steps, [\d.]+ ms in execute; slowest: (.*)", p.stdout)
    assert counts and slow, p.stdout
    assert slow.group(1) == counts.group(1) and int(counts.group(1)) >= 6  # a prefill step + one per new token
    listed = re.findall(r"([\d.]+) ms \((\d+) prefill tokens, (\d+) decode rows\)", slow.group(2))
    assert len(listed) == 2 and float(listed[0][0]) >= float(listed[1][0]), slow.group(2)


def _main():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_vs_transformers", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # the script puts benchmarks/ on sys.path for its _util import
    return mod.main


@pytest.mark.parametrize("args", [["--num-prompts", "0"], ["--num-prompts", "129"], ["--min-len", "9", "--max-len", "3"],
                                  ["--new-tokens", "0"], ["--model", "/nonexistent"], ["--device", "tpu"]])
def test_bad_arguments_exit_2(args, capsys):
    with pytest.raises(SystemExit) as e:
        _main()(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.strip() and "Traceback" not in err


def test_save_model_writes_a_checkpoint_the_engine_loads(tmp_path):
    # `--save-model DIR`: the --size checkpoint for other benchmarks' --model (decode_roofline.py), then exit
    from k3serve.workers.model.config import K3Config

    d = tmp_path / "m"
    p = _run("--size", "tiny", "--save-model", str(d))
    assert p.returncode == 0, p.stdout + p.stderr
    cfg = K3Config.from_pretrained(d)
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.hidden_size) == (4, 8, 64)
    assert [cfg.is_kda_layer(i) for i in range(4)] == [True, True, True, False]
    again = _run("--size", "tiny", "--save-model", str(d))  # never over an existing checkpoint
    assert again.returncode == 2 and "already holds a checkpoint" in again.stderr


def test_decode_roofline_rejects_a_model_dir_without_config(tmp_path):
    script = os.path.join(os.path.dirname(SCRIPT), "decode_roofline.py")
    p = subprocess.run([sys.executable, script, "--model", str(tmp_path)], env=dict(os.environ, PYTHONSAFEPATH="1"),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "no config.json" in p.stderr and "Traceback" not in p.stderr
