"""`max_num_batched_tokens`'s default: a pure function of (device kind, device memory), resolved once when the
EngineArgs are made (workers/engine/api.py); an explicit value always wins."""

import argparse
import dataclasses

import pytest

from k3serve.workers.engine import api
from k3serve.workers.engine.api import EngineArgs, default_max_num_batched_tokens, device_memory
from k3serve.workers.engine_cli import add_engine_args, engine_args_from

GB = 10**9


@pytest.mark.parametrize("kind,mem,want", [
    ("cpu", None, 2048), ("cpu", 512 * GB, 2048), ("mps", 200 * GB, 2048), ("cuda", None, 2048),
    ("cuda", 24 * GB, 2048), ("cuda", 80 * GB - 1, 2048), ("cuda", 80 * GB, 16384),
    ("cuda", 85_029_158_912, 16384),  # an 80 GB H100 as torch reports it (79.2 GiB)
    ("cuda", 150_110_011_392, 16384),  # an H200
])
def test_default_is_a_function_of_kind_and_memory(kind, mem, want):
    assert default_max_num_batched_tokens(kind, mem) == want
    assert default_max_num_batched_tokens(kind, mem) == want  # the same answer every time


def test_device_memory_without_a_visible_gpu():
    assert device_memory("cpu") == ("cpu", None)
    if not __import__("torch").cuda.is_available():
        assert device_memory("cuda") == ("cuda", None)
        assert device_memory("cuda:3") == ("cuda", None)


def _counting(monkeypatch, mem):
    calls = []

    def fake(device):
        calls.append(device)
        return device.split(":")[0], mem

    monkeypatch.setattr(api, "device_memory", fake)
    return calls


def test_resolved_once_at_construction(monkeypatch):
    calls = _counting(monkeypatch, 141 * GB)
    a = EngineArgs(model="/m", device="cuda:1")
    assert a.max_num_batched_tokens == 16384 and calls == ["cuda:1"]
    b = dataclasses.replace(a, max_num_seqs=8)  # a copy carries the resolved int: no second resolution
    assert b.max_num_batched_tokens == 16384 and calls == ["cuda:1"]
    assert EngineArgs(model="/m").max_num_batched_tokens == 2048 and calls == ["cuda:1", "cpu"]
    monkeypatch.setattr(api, "device_memory", lambda d: ("cuda", 40 * GB))
    assert EngineArgs(model="/m", device="cuda").max_num_batched_tokens == 2048


def test_explicit_value_wins(monkeypatch):
    calls = _counting(monkeypatch, 141 * GB)
    assert EngineArgs(model="/m", device="cuda", max_num_batched_tokens=512).max_num_batched_tokens == 512
    assert EngineArgs(model="/m", max_num_batched_tokens=16384).max_num_batched_tokens == 16384
    assert calls == []


def test_cli_default_and_override(monkeypatch, capsys):
    p = argparse.ArgumentParser(prog="k3serve serve")
    add_engine_args(p)
    assert engine_args_from(p.parse_args([]), "/m").max_num_batched_tokens == 2048
    assert engine_args_from(p.parse_args(["--max-num-batched-tokens", "300"]), "/m").max_num_batched_tokens == 300
    _counting(monkeypatch, 141 * GB)
    assert engine_args_from(p.parse_args(["--device", "cuda"]), "/m").max_num_batched_tokens == 16384
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--max-num-batched-tokens", "0"])
    assert e.value.code == 2
    capsys.readouterr()
    p.print_help()
    assert "16384 on a CUDA device with >= 80 GB" in " ".join(capsys.readouterr().out.split())
