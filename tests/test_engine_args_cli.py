"""EngineArgs is the one configuration source: the engine flags of `serve` and `worker` are generated from
its fields (workers/engine/api.py), every field is settable from the CLI, the pod contract's spellings
(docs/components.md) are kept, and every other flag is listed in engine_cli.HAND_WRITTEN."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from k3serve.common.sizes import format_size, parse_size
from k3serve.workers import generate_cli, serve, worker
from k3serve.workers.engine import api
from k3serve.workers.engine.api import CLI, EngineArgs, arg
from k3serve.workers.engine_cli import (
    HAND_WRITTEN,
    add_engine_args,
    engine_args_from,
    engine_flags,
    is_switch,
)

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {"serve": (serve, ["/m"]), "worker": (worker, ["--model", "/m"]), "generate": (generate_cli, None)}
CANDIDATES = ("7", "3M", "dense", "0.5", "x", "h:1", '{"method": "ngram", "num_speculative_tokens": 2}')  # tried in order for a field's non-default CLI value


def _parser(module):
    p = argparse.ArgumentParser(prog="k3serve x", exit_on_error=False)
    module.configure(p)
    return p


def _options(p: argparse.ArgumentParser) -> set[str]:
    out = set()
    for a in p._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        out |= set(a.option_strings) if a.option_strings else {a.metavar or a.dest}
    return out


def _non_default(field, spec, opt) -> tuple[list[str], object]:
    """argv setting `field` to something other than its default, and the value EngineArgs must get."""
    if is_switch(field):
        return [opt], True
    if spec.choices:
        v = next(c for c in spec.choices if c != field.default)
        return [opt, v], v
    if spec.nargs:
        return [opt, "a", "b"], spec.to_field(["a", "b"]) if spec.to_field else ["a", "b"]
    parse = spec.parse or (type(field.default) if field.default is not None else str)
    for text in CANDIDATES:
        try:
            v = parse(text)
        except ValueError:
            continue
        if v != field.default:
            return [opt, text], v
    raise AssertionError(f"{opt}: none of {CANDIDATES} parses to a non-default value; extend CANDIDATES")


def test_every_field_has_a_flag_but_the_model():
    off_cli = [f.name for f in dataclasses.fields(EngineArgs) if CLI not in f.metadata]
    assert off_cli == ["model"], f"EngineArgs fields without a flag: {off_cli} (declare them with arg(...))"


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_every_field_reaches_engine_args(command):
    module, head = COMMANDS[command]
    for f, spec, opt in engine_flags():
        argv, want = _non_default(f, spec, opt)
        e = engine_args_from(_parser(module).parse_args([*head, *argv]), "/m")
        assert getattr(e, f.name) == want != f.default, (command, argv)
        # and nothing else moved
        others = {g.name: getattr(e, g.name) for g in dataclasses.fields(e) if g.name not in (f.name, "model")}
        base = EngineArgs(model="/m")  # the defaults as made (a None default may resolve, e.g. the token budget)
        assert others == {g.name: getattr(base, g.name) for g in dataclasses.fields(EngineArgs)
                          if g.name not in (f.name, "model")}, argv
    defaults = engine_args_from(_parser(module).parse_args(head), "/m")
    assert defaults == EngineArgs(model="/m")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_other_flag_is_listed_as_hand_written(command):
    module, _ = COMMANDS[command]
    fields = {f.name for f, _s, _o in engine_flags()}
    generated = {o for a in _parser(module)._actions if a.dest in fields for o in a.option_strings}
    opts = _options(_parser(module))
    hand = opts - generated if command != "generate" else opts
    assert hand == set(HAND_WRITTEN[command]), (
        f"`k3serve {command}` flags that are neither generated from EngineArgs nor listed in "
        f"engine_cli.HAND_WRITTEN: {sorted(hand - set(HAND_WRITTEN[command]))}; listed but gone: "
        f"{sorted(set(HAND_WRITTEN[command]) - hand)}")


def test_pod_contract_cache_flags_are_engine_fields():
    doc = (ROOT / "docs" / "components.md").read_text()
    table = doc.split("Cache flags", 1)[1].split("\n\n", 2)[1]
    flags = set(re.findall(r"^\| `(--[a-z-]+)", table, flags=re.M))
    assert {"--enable-prefix-caching", "--kv-cache-memory", "--max-model-len", "--block-size"} <= flags
    generated = {opt for _f, _s, opt in engine_flags()}
    assert flags <= generated, f"cache flags of the pod contract not generated from EngineArgs: {flags - generated}"


def test_a_new_field_gets_its_flag(monkeypatch):
    """What the api.py docstring promises: declare the field, and the flag, parser and value follow."""
    @dataclasses.dataclass
    class Extended(EngineArgs):
        my_budget: int | None = arg(None, "a budget", parse=parse_size)
        my_switch: bool = arg(False, "a switch")

    monkeypatch.setattr(api, "EngineArgs", Extended)
    p = argparse.ArgumentParser(exit_on_error=False)
    add_engine_args(p)
    e = engine_args_from(p.parse_args(["--my-budget", "8GiB", "--my-switch"]), "/m")
    assert (type(e), e.my_budget, e.my_switch) == (Extended, 8 << 30, True)
    assert "a budget" in p.format_help()
    with pytest.raises(argparse.ArgumentError, match="not a size"):
        p.parse_args(["--my-budget", "lots"])


@pytest.mark.parametrize("text,n", [("8G", 8 << 30), ("8GiB", 8 << 30), ("8Gi", 8 << 30), ("8g", 8 << 30),
                                    ("512M", 512 << 20), ("1.5K", 1536), ("4096", 4096), ("4096B", 4096),
                                    ("8GB", 8 * 10**9), ("2T", 2 << 40)])
def test_sizes(text, n):
    assert parse_size(text) == n
    assert parse_size(format_size(n)) == n


@pytest.mark.parametrize("text,msg", [("0", "must be positive"), ("lots", "not a size"), ("-1", "not a size"),
                                      ("1.5", "whole number"), ("8XB", "not a size"), ("", "not a size")])
def test_bad_sizes(text, msg):
    with pytest.raises(ValueError, match=msg):
        parse_size(text)


def test_kv_cache_memory_flag_uses_the_size_parser():
    p = _parser(serve)
    assert engine_args_from(p.parse_args(["/m", "--kv-cache-memory", "8GiB"]), "/m").kv_cache_memory == 8 << 30
    assert engine_args_from(p.parse_args(["/m", "--kv-cache-memory", "1.5G"]), "/m").kv_cache_memory == 3 << 29
    assert engine_args_from(p.parse_args(["/m", "--kv-cache-memory", "0.9"]), "/m").kv_cache_memory == 0.9


def test_model_paths_accept_the_home_shorthand():
    import os

    assert EngineArgs(model="~/models/tiny").model == os.path.expanduser("~/models/tiny") != "~/models/tiny"
    p = _parser(serve)
    assert engine_args_from(p.parse_args(["~/m"]), "~/m").model == os.path.expanduser("~/m")
