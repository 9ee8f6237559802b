"""spec.<pool>.sequenceParallel: rendered as the worker's --enable-sequence-parallel (which the worker's own
CLI parses, docs/components.md), refused with a message (Degraded, nothing created; the CRD's admission rule
says the same) without expertParallel or with tensorParallelSize 1."""

from __future__ import annotations

import argparse
import copy
import json
import os

import pytest
import yaml

from k3serve.operator import crd, generate, layout
from k3serve.operator.reconcile import Reconciler
from k3serve.operator.render import default_spec, render
from k3serve.workers import worker

ROOT = generate.repo_root()


def _sample(name: str = "k3-tep8-dep16.yaml") -> dict:
    with open(os.path.join(ROOT, "manifests", "samples", name), encoding="utf-8") as f:
        return yaml.safe_load(f)


def _worker_args(objs):
    """{pod template owner name: worker args} of every worker container rendered."""
    out = {}
    for o in objs:
        spec = o.get("spec", {})
        tmpl = spec.get("template") or spec.get("leaderWorkerTemplate", {}).get("leaderTemplate") or {}
        for c in tmpl.get("spec", {}).get("containers", []):
            if (c.get("args") or [])[:1] == ["worker"]:
                out[o["metadata"]["name"]] = c["args"][1:]
    return out


def test_sequence_parallel_pool_renders_the_flag_the_worker_parses():
    cr = _sample()
    assert cr["spec"]["prefill"]["sequenceParallel"] is True  # the production sample: TEP8 + SP prefill
    rendered = render(cr)
    assert rendered.problems == []
    args = _worker_args(rendered.objects)
    prefill = {k: v for k, v in args.items() if "prefill" in k}
    decode = {k: v for k, v in args.items() if "decode" in k}
    assert prefill and decode
    p = argparse.ArgumentParser(exit_on_error=False)
    worker.configure(p)
    for name, a in prefill.items():
        assert "--enable-sequence-parallel" in a, name
        ns = p.parse_args([x.replace("$(K3SERVE_POD_IP)", "10.1.2.3") for x in a])
        assert (ns.enable_sequence_parallel, ns.enable_expert_parallel, ns.tensor_parallel_size) == (True, True, 8)
        assert worker.unsupported_layout(ns) is None
    for name, a in decode.items():  # DEP16 decode: TP 1, no sequence parallelism
        assert "--enable-sequence-parallel" not in a, name
    configs = [json.loads(doc) for o in rendered.objects if o["kind"] == "ConfigMap"
               for key, doc in (o.get("data") or {}).items() if key.endswith(".json")]
    layouts = {c["pool"]: c["layout"]["sequenceParallel"] for c in configs if "pool" in c}
    assert layouts == {"prefill": True, "decode": False}
    off = copy.deepcopy(cr)
    del off["spec"]["prefill"]["sequenceParallel"]  # the default: off
    assert not any("--enable-sequence-parallel" in a for a in _worker_args(render(off).objects).values())


HEAD = "spec.{}.sequenceParallel needs expertParallel and tensorParallelSize > 1, but "
NO_EP = "expertParallel is false (the MoE all-to-all moves each token shard to whole experts)"
TP1 = "tensorParallelSize is 1 (there are no ranks to shard the tokens over)"
BAD = [
    ({"prefill": {"expertParallel": False, "sequenceParallel": True}}, HEAD.format("prefill") + NO_EP),
    ({"decode": {"sequenceParallel": True}}, HEAD.format("decode") + TP1),  # DEP16 decode: tensorParallelSize 1
    ({"prefill": {"tensorParallelSize": 1, "expertParallel": False, "sequenceParallel": True, "gpusPerNode": 1}},
     HEAD.format("prefill") + NO_EP + " and " + TP1),
]


@pytest.mark.parametrize("patch,message", BAD, ids=["no-ep", "tp1", "both"])
def test_sequence_parallel_without_ep_or_with_tp1_is_degraded_with_the_reason(patch, message):
    cr = _sample()
    for pool, fields in patch.items():
        cr["spec"][pool].update(fields)
    rendered = render(cr)
    assert rendered.spec is not None  # schema-valid: only the layout is wrong
    assert message in rendered.problems
    assert rendered.objects == []  # nothing created
    outcome = Reconciler._unservable(rendered, {}, 1)
    assert (outcome.phase, outcome.result) == ("Degraded", "invalid")
    degraded = next(c for c in outcome.status_patch["conditions"] if c["type"] == "Degraded")
    assert (degraded["reason"], degraded["status"]) == ("InvalidLayout", "True") and message in degraded["message"]


def test_the_admission_rule_is_the_same_rule():
    rules = {r.name: r for r in layout.RULES}
    spec = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    cel = {r["message"]: r["rule"] for r in spec["x-kubernetes-validations"]}
    for pool in ("prefill", "decode"):
        rule = rules[f"{pool}-sequence-parallel"]
        assert cel[rule.message] == rule.cel and f"self.{pool}.sequenceParallel" in rule.cel
        assert spec["properties"][pool]["properties"]["sequenceParallel"]["default"] is False
    # colocated mode (no prefill pool) waives the prefill rule, as every prefill rule
    colocated = default_spec({"model": {"uri": "hf://x/y"},
                              "prefill": {"replicas": 0, "expertParallel": False, "sequenceParallel": True}})
    assert layout.problems("k3", colocated) == []
