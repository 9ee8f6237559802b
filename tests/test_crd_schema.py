"""The KimiK3Deployment CRD: one generated definition, a valid CRD object, a schema that accepts the
samples and rejects bad CRs with messages that name the field."""

from __future__ import annotations

import copy
import os

import pytest
import yaml

from k3serve.operator import crd, generate, layout, validation
from k3serve.operator.render import default_spec
from k3serve.operator.testing import validate

ROOT = generate.repo_root()
SAMPLES = ["tiny-cpu.yaml", "k3-tep8-dep16.yaml"]


def sample(name: str) -> dict:
    with open(os.path.join(ROOT, "manifests", "samples", name), encoding="utf-8") as f:
        return yaml.safe_load(f)


def test_crd_files_are_generated_from_the_one_definition():
    text = generate.crd_yaml()
    for rel in (f"charts/k3serve/crds/{generate.CRD_FILE}", f"manifests/crd/{generate.CRD_FILE}"):
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            assert f.read() == text, f"{rel} is stale: run `k3serve operator generate`"
    assert yaml.safe_load(text) == crd.crd()


def test_crd_object_is_valid_for_kubernetes():
    assert validate.errors(crd.crd(), "1.33") == []
    assert validate.errors(crd.crd(), "1.37") == []


def test_crd_shape_subresources_and_printer_columns():
    version = crd.crd()["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    scale = version["subresources"]["scale"]
    assert scale == {
        "specReplicasPath": ".spec.decode.replicas",
        "statusReplicasPath": ".status.decode.replicas",
        "labelSelectorPath": ".status.decode.selector",
    }
    schema = version["schema"]["openAPIV3Schema"]
    # every path the scale subresource and the printer columns name exists in the schema
    for path in [*scale.values(), *(c["jsonPath"] for c in version["additionalPrinterColumns"])]:
        if path.startswith(".metadata."):
            continue  # the API server's own metadata
        node = schema
        for part in path.strip(".").split("."):
            node = node["properties"][part]
        assert node.get("type") in ("integer", "string")
    columns = {c["name"] for c in version["additionalPrinterColumns"]}
    assert {"Ready", "Gateway", "Age"} <= columns
    conditions = schema["properties"]["status"]["properties"]["conditions"]["items"]["properties"]["type"]
    assert conditions["enum"] == ["Ready", "Progressing", "Degraded"]


def test_defaults_are_k3_tep8_prefill_and_dep16_decode():
    spec = default_spec({"model": {"uri": "hf://moonshotai/Kimi-K3"}})
    assert spec["model"]["architecture"] == {"kdaHeads": 96, "mlaHeads": 96, "numExperts": 896}
    assert (spec["prefill"]["tensorParallelSize"], spec["prefill"]["expertParallel"]) == (8, True)
    assert (spec["decode"]["dataParallelSize"], spec["decode"]["gpusPerNode"]) == (16, 8)
    assert spec["engine"] == "native" and spec["router"]["policy"] == "hybrid-prefix"
    plan = layout.plan(spec)
    assert plan.decode.nodes_per_group == 2 and plan.decode.gpus_per_pod == 8  # DEP16 spans two nodes
    assert plan.prefill.nodes_per_group == 1 and plan.prefill.world == 8
    assert layout.problems("k3", spec) == []
    # defaulting is idempotent, as on a real API server
    assert default_spec(spec) == spec


@pytest.mark.parametrize("name", SAMPLES)
def test_samples_are_valid(name):
    cr = sample(name)
    assert validation.errors(cr) == []
    assert layout.problems(cr["metadata"]["name"], default_spec(cr["spec"])) == []


def _with(cr: dict, path: str, value) -> dict:
    out = copy.deepcopy(cr)
    node = out
    parts = path.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    if value is _DELETE:
        del node[parts[-1]]
    else:
        node[parts[-1]] = value
    return out


class _Deleted:
    def __repr__(self) -> str:  # a stable test id (xdist workers must collect the same ids)
        return "<deleted>"


_DELETE = _Deleted()

INVALID = [
    (
        "spec.prefill.tensorParallelSize",
        0,
        "spec.prefill.tensorParallelSize: 0 is less than the minimum of 1",
    ),
    ("spec.decode.replicas", -1, "spec.decode.replicas: -1 is less than the minimum of 0"),
    ("spec.router.policy", "fastest", "spec.router.policy: 'fastest' is not one of ['hybrid-prefix'"),
    ("spec.engine", "tgi", "spec.engine: 'tgi' is not one of ['native', 'vllm']"),
    ("spec.router.serviceType", "Ingress", "spec.router.serviceType: 'Ingress' is not one of"),
    ("spec.cache.eviction", "fifo", "spec.cache.eviction: 'fifo' is not one of ['lru', 'compute-per-byte']"),
    ("spec.cache.retentionInterval", "sparse", "spec.cache.retentionInterval: 'sparse' does not match"),
    ("spec.cache.retentionInterval", -5, "spec.cache.retentionInterval: -5 is less than the minimum of 0"),
    ("spec.cache.kvCacheMemory", "lots", "spec.cache.kvCacheMemory: 'lots' does not match"),
    ("spec.kvStore.memory", "16 gigs", "spec.kvStore.memory: '16 gigs' does not match"),
    ("spec.model.uri", "ftp://x/y", "spec.model.uri: 'ftp://x/y' does not match"),
    ("spec.decode.tensorParalelSize", 2, "spec.decode: unknown field(s) 'tensorParalelSize'"),
    ("spec.decode.gpusPerNode", "8", "spec.decode.gpusPerNode: '8' is not of type 'integer'"),
    (
        "spec.prefill.tolerations",
        [{"operator": "Maybe"}],
        "spec.prefill.tolerations[0].operator: 'Maybe' is not one of",
    ),
    ("spec.model", _DELETE, "spec: 'model' is required"),
]


@pytest.mark.parametrize("path,value,message", INVALID, ids=[i[0] + "=" + repr(i[1]) for i in INVALID])
def test_invalid_crs_are_rejected_with_the_field_and_reason(path, value, message):
    bad = _with(sample("tiny-cpu.yaml"), path, value)
    errors = validation.errors(bad)
    assert errors, f"{path}={value!r} was accepted"
    assert any(e.startswith(message) for e in errors), errors


def test_cel_rules_carry_the_layout_rules_and_messages():
    spec = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = {r["message"]: r["rule"] for r in spec["x-kubernetes-validations"]}
    for rule in layout.RULES:
        if rule.cel:
            assert rules[rule.message] == rule.cel
    # every prefill rule is waived in colocated mode (prefill.replicas == 0), at admission as in Python
    assert all(
        r.cel.startswith("self.prefill.replicas == 0 ||")
        for r in layout.RULES
        if r.name.startswith("prefill-")
    )
    root = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert (
        root["x-kubernetes-validations"][0]["rule"] == f"size(self.metadata.name) <= {layout.MAX_NAME_LENGTH}"
    )


UNSERVABLE = [
    (
        {"prefill": {"tensorParallelSize": 5}},
        "spec.prefill.tensorParallelSize 5 does not divide the model's 96 KDA heads and 96 MLA heads",
    ),
    (
        {
            "model": {"uri": "hf://x/y", "architecture": {"kdaHeads": 32, "mlaHeads": 96}},
            "prefill": {"tensorParallelSize": 3},
        },
        "spec.prefill.tensorParallelSize 3 does not divide the model's 32 KDA heads",
    ),
    (
        {"decode": {"dataParallelSize": 12}},
        "spec.decode: 12 ranks per group (tensorParallelSize x dataParallelSize) "
        "do not fill whole 8-GPU nodes",
    ),
    (
        {"decode": {"dataParallelSize": 3, "gpusPerNode": 4}},
        "spec.decode: expertParallel over 3 ranks needs numExperts divisible by 3",
    ),
    (
        {"decode": {"tensorParallelSize": 3, "dataParallelSize": 1}},
        "prefill tensorParallelSize 8 and decode tensorParallelSize 3 do not divide one another",
    ),
    (
        {"decode": {"gpusPerNode": 0, "dataParallelSize": 2}},
        "spec.decode: a CPU pool (gpusPerNode 0) runs one rank",
    ),
    (
        {"model": {"uri": "hf://x/y", "pvc": {"claimName": "m"}}},
        "spec.model: set exactly one of uri or pvc (both",
    ),
    ({"engine": "vllm"}, "spec.engine 'vllm' is reserved for a later release"),
    (
        {"cache": {"blockSize": 64, "retentionInterval": 100}},
        "spec.cache.retentionInterval 100 must be a multiple",
    ),
]


@pytest.mark.parametrize("patch,message", UNSERVABLE, ids=[m.split(":")[0][:40] for _, m in UNSERVABLE])
def test_unservable_layouts_are_explained(patch, message):
    spec = {"model": {"uri": "hf://moonshotai/Kimi-K3"}}
    for key, value in patch.items():
        spec[key] = value
    assert (
        validation.errors(
            {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "k3"}, "spec": spec}
        )
        == []
    )  # schema-valid: only the layout is wrong
    problems = layout.problems("k3", default_spec(spec))
    assert any(p.startswith(message) for p in problems), problems


def test_colocated_mode_waives_prefill_rules_and_long_names_are_refused():
    spec = default_spec({"model": {"uri": "hf://x/y"}, "prefill": {"replicas": 0, "tensorParallelSize": 5}})
    assert layout.problems("k3", spec) == []
    assert layout.plan(spec).colocated and layout.plan(spec).decode.role == "both"
    assert "metadata.name is 41 characters" in layout.problems("x" * 41, spec)[0]


def test_every_generated_file_is_current():
    """CRD copies, dashboards, RBAC rules and the docs' field reference (helm-free part of `generate`)."""
    files = generate.expected(ROOT)
    assert "docs/kubernetes.md" in files and "charts/k3serve/files/operator-rules.yaml" in files
    for rel, text in files.items():
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            assert f.read() == text, f"{rel} is stale: run `k3serve operator generate`"
    reference = files["docs/kubernetes.md"]
    for path in (
        "`prefill.tensorParallelSize`",
        "`decode.dataParallelSize`",
        "`router.apiKeySecretRef.key`",
        "`cache.retentionInterval`",
        "`kvStore.memory`",
        "`monitoring.podMonitor`",
        "`model.pvc.claimName`",
    ):
        assert path in reference
