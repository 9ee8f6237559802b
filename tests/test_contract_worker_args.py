"""The operator's rendered worker command lines parse with the worker's own CLI (docs/components.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from k3serve.operator.render import render
from k3serve.workers import worker

ROOT = Path(__file__).resolve().parents[1]


def _worker_args(objs):
    for o in objs:
        spec = o.get("spec", {})
        tmpl = spec.get("template") or spec.get("leaderWorkerTemplate", {}).get("leaderTemplate") or {}
        for c in tmpl.get("spec", {}).get("containers", []):
            args = c.get("args") or []
            if args[:1] == ["worker"]:
                yield o["metadata"]["name"], args[1:]


@pytest.mark.parametrize("sample", ["tiny-cpu.yaml", "k3-tep8-dep16.yaml"])
def test_rendered_worker_args_parse(sample):
    cr = yaml.safe_load((ROOT / "manifests" / "samples" / sample).read_text())
    found = 0
    for name, args in _worker_args(render(cr).objects):
        p = argparse.ArgumentParser(exit_on_error=False)
        worker.configure(p)
        ns = p.parse_args([a.replace("$(K3SERVE_POD_IP)", "10.1.2.3") for a in args])
        assert ns.grpc_port == 50051 and ns.metrics_port == 9100, name
        found += 1
    assert found >= 1


def test_multi_rank_layout_is_refused_clearly():
    p = argparse.ArgumentParser()
    worker.configure(p)
    for role in ("prefill", "decode"):  # P/D from / into a TP group: each rank's own pages (kv_transfer/)
        ns = p.parse_args(["--model", "m", "--tensor-parallel-size", "8", "--role", role])
        assert worker.unsupported_layout(ns) is None, role
    dp = ["--model", "m", "--data-parallel-size", "2", "--enable-expert-parallel"]
    assert p.parse_args(["--model", "m", "--expert-parallel"]).enable_expert_parallel  # the former spelling
    assert worker.unsupported_layout(p.parse_args(dp)) is None  # DEP is served (workers/engine/parallel/dp_front.py)
    assert worker.unsupported_layout(p.parse_args(dp + ["--role", "decode"])) is None  # DEP decode pulls per rank
    assert worker.unsupported_layout(p.parse_args(dp + ["--role", "prefill"])) is None  # each rank serves its pages
    assert worker.unsupported_layout(p.parse_args(dp + ["--nnodes", "2"])) is None  # DEP over nodes (dp_engine.py)
    assert "--data-parallel-size=2 does not split over --nnodes=3" in worker.unsupported_layout(
        p.parse_args(dp + ["--nnodes", "3"]))
    assert worker.unsupported_layout(p.parse_args(["--model", "m"])) is None
    # tensor parallelism itself is served (workers/engine/parallel/); the engine judges the model's shapes
    assert worker.unsupported_layout(p.parse_args(["--model", "m", "--tensor-parallel-size", "8"])) is None
