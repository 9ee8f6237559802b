"""Engine options of `k3serve serve` and `k3serve worker` (prefix caching, block size, KV budget, context
length, dtype): accepted values map onto EngineArgs, bad ones exit with a clear error, at parse time or,
for values only the engine can judge, from `start_engine` (in process and as real processes)."""

import argparse
import os
import subprocess
import sys

import pytest

from k3serve.workers import serve, worker
from k3serve.workers.engine_cli import EngineConfigError, engine_args_from, start_engine

COMMANDS = {"serve": (serve, ["/m"]), "worker": (worker, ["--model", "/m"])}


def parse(command, argv):
    module, head = COMMANDS[command]
    p = argparse.ArgumentParser(prog=f"k3serve {command}")
    module.configure(p)
    return p.parse_args([*head, *argv])


@pytest.mark.parametrize("command", COMMANDS)
def test_prefix_cache_options_map_to_engine_args(command):
    a = parse(command, ["--enable-prefix-caching", "--prefix-match-unit", "8", "--prefix-cache-retention-interval",
                        "32", "--prefix-cache-selective-retention", "--prefix-cache-eviction", "compute-per-byte",
                        "--block-size", "16", "--kv-cache-memory", "3M", "--max-model-len", "256", "--dtype",
                        "bfloat16"])
    e = engine_args_from(a, "/m")
    assert (e.enable_prefix_caching, e.prefix_match_unit, e.prefix_cache_retention_interval) == (True, 8, 32)
    assert (e.prefix_cache_selective_retention, e.prefix_cache_eviction) == (True, "compute-per-byte")
    assert (e.block_size, e.kv_cache_memory, e.max_model_len, e.dtype) == (16, 3 << 20, 256, "bfloat16")
    d = engine_args_from(parse(command, ["--prefix-cache-retention-interval", "dense"]), "/m")
    assert (d.prefix_cache_retention_interval, d.enable_prefix_caching, d.prefix_cache_eviction) == ("dense", False, "lru")
    assert (d.prefix_match_unit, d.block_size, d.kv_cache_memory, d.prefix_cache_selective_retention) == \
        (None, None, None, False)
    assert engine_args_from(parse(command, ["--kv-cache-memory", "0.25"]), "/m").kv_cache_memory == 0.25


BAD = [
    (["--block-size", "0"], "--block-size: must be a positive integer"),
    (["--block-size", "x"], "--block-size: not an integer"),
    (["--prefix-match-unit", "-8"], "--prefix-match-unit: must be a positive integer"),
    (["--prefix-cache-retention-interval", "-16"], "retention interval must be >= 0"),
    (["--prefix-cache-retention-interval", "sparse"], "not a retention interval"),
    (["--prefix-cache-eviction", "fifo"], "invalid choice: 'fifo'"),
    (["--kv-cache-memory", "lots"], "not a size"),
    (["--kv-cache-memory", "0"], "must be positive"),
    (["--kv-cache-memory", "1.5"], "must be in (0, 1]"),
    (["--max-model-len", "0"], "--max-model-len: must be a positive integer"),
    (["--dtype", "int3"], "--dtype: invalid choice"),
]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("argv,needle", BAD)
def test_bad_values_exit_at_parse_time(command, argv, needle, capsys):
    with pytest.raises(SystemExit) as ei:
        parse(command, argv)
    assert ei.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["--enable-prefix-caching", "--block-size", "16", "--prefix-match-unit", "5"],
     "prefix_match_unit: must divide the block size 16"),
    (["--enable-prefix-caching", "--block-size", "16", "--prefix-match-unit", "8",
      "--prefix-cache-retention-interval", "12"], "prefix_cache_retention_interval: must be 0, 'dense' or a positive"),
    (["--max-model-len", "128", "--kv-cache-memory", "10K"], "kv_cache_memory: 10240 bytes is too small"),
])
def test_engine_rejections_are_config_errors(tiny_model_dir, argv, needle):
    args = parse("serve", argv)
    with pytest.raises(EngineConfigError) as ei:
        start_engine(args, str(tiny_model_dir))
    assert str(ei.value.code).startswith("k3serve: error: ") and needle in str(ei.value.code)
    with pytest.raises(EngineConfigError, match="no config.json"):
        start_engine(args, "/nonexistent-model-dir")


@pytest.mark.parametrize("command", COMMANDS)
def test_processes_exit_with_the_message(tiny_model_dir, command):
    head = [str(tiny_model_dir), "--port", "0"] if command == "serve" else \
        ["--model", str(tiny_model_dir), "--grpc-port", "0", "--metrics-port", "0"]
    r = subprocess.run([sys.executable, "-m", "k3serve.cli", command, *head, "--enable-prefix-caching",
                        "--block-size", "16", "--prefix-match-unit", "5", "--log-level", "warning"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONSAFEPATH="1"))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == "k3serve: error: prefix_match_unit: must divide the block size 16 (got 5)"
    assert "Traceback" not in r.stderr
