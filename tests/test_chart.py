"""The Helm chart and the kustomize base, with the real helm (and kubectl) binaries from
scripts/install-helm.sh: lint, template several value sets, validate every object strictly."""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml

from k3serve.operator import crd, generate, kube
from k3serve.operator.testing import validate

ROOT = generate.repo_root()
HELM = os.path.join(ROOT, ".tools", "helm")
KUBECTL = os.path.join(ROOT, ".tools", "kubectl")
CHART = os.path.join(ROOT, "charts", "k3serve")

needs_helm = pytest.mark.skipif(
    not os.access(HELM, os.X_OK), reason=".tools/helm is absent: run `bash scripts/install-helm.sh`"
)
needs_kubectl = pytest.mark.skipif(
    not os.access(KUBECTL, os.X_OK), reason=".tools/kubectl is absent: run `bash scripts/install-helm.sh`"
)


@pytest.fixture(scope="module")
def helm_env(tmp_path_factory):
    home = tmp_path_factory.mktemp("helm-home")
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / "cache"),
        "XDG_CONFIG_HOME": str(home / "config"),
        "XDG_DATA_HOME": str(home / "data"),
    }


def helm(env: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([HELM, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


def template(env: dict, *values: str, namespace: str = "k3serve-system") -> list[dict]:
    args = ["template", "k3serve", CHART, "--namespace", namespace, "--include-crds"]
    for value in values:
        args += ["--set", value]
    return [d for d in yaml.safe_load_all(helm(env, *args).stdout) if d]


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


VALUE_SETS = {
    "defaults": (),
    "namespace-scope": ("rbac.scope=namespace", "rbac.watchNamespaces={team-a,team-b}"),
    "monitors": (
        "monitoring.serviceMonitor.enabled=true",
        "monitoring.podMonitor.enabled=true",
        "monitoring.serviceMonitor.labels.release=prom",
    ),
    "dashboards-elsewhere": ("dashboards.namespace=grafana", "operator.verbose=true", "image.tag=9.9.9"),
    "no-extras": (
        "dashboards.enabled=false",
        "metrics.service.enabled=false",
        "serviceAccount.create=false",
        "serviceAccount.name=existing",
    ),
}


@needs_helm
@pytest.mark.parametrize("values", list(VALUE_SETS.values()), ids=list(VALUE_SETS))
def test_lint_and_every_rendered_object_is_valid(helm_env, values):
    args = ["lint", "--strict", CHART]
    for value in values:
        args += ["--set", value]
    assert "0 chart(s) failed" in helm(helm_env, *args).stdout
    objs = template(helm_env, *values)
    assert objs
    for obj in objs:
        assert validate.errors(obj) == [], obj["kind"]


@needs_helm
def test_chart_crd_equals_the_generated_one_and_the_manifests_copy(helm_env):
    (chart_crd,) = by_kind(template(helm_env), "CustomResourceDefinition")
    assert chart_crd == crd.crd()
    with open(os.path.join(ROOT, "manifests", "crd", generate.CRD_FILE), encoding="utf-8") as f:
        assert yaml.safe_load(f) == chart_crd


@needs_helm
def test_cluster_scope_rbac_is_exactly_what_the_operator_needs(helm_env):
    objs = template(helm_env)
    (role,) = by_kind(objs, "ClusterRole")
    (binding,) = by_kind(objs, "ClusterRoleBinding")
    assert role["rules"] == generate.operator_rules()
    granted = {
        (g, r): set(rule["verbs"])
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
    for res in kube.CHILD_RESOURCES:  # every kind the renderer creates, and no more than CRUD on it
        assert granted[(res.group, res.plural)] == {"get", "list", "watch", "create", "patch", "delete"}
    assert granted[("k3serve.io", "kimik3deployments")] == {"get", "list", "watch", "patch", "update"}
    assert granted[("k3serve.io", "kimik3deployments/status")] == {"get", "patch", "update"}
    assert granted[("", "events")] == {"create", "patch"} and granted[("", "pods")] == {
        "get",
        "list",
        "watch",
    }
    assert not any(r in ("secrets", "nodes", "namespaces") for _, r in granted)
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "k3serve", "namespace": "k3serve-system"}
    ]
    (deployment,) = by_kind(objs, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:3] == ["operator", "run", "--all-namespaces"]


@needs_helm
def test_namespace_scope_grants_roles_only_in_the_watched_namespaces(helm_env):
    objs = template(helm_env, *VALUE_SETS["namespace-scope"])
    assert not by_kind(objs, "ClusterRole") and not by_kind(objs, "ClusterRoleBinding")
    roles = by_kind(objs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert all(r["rules"] == generate.operator_rules() for r in roles)
    for rb in by_kind(objs, "RoleBinding"):
        assert rb["subjects"][0]["namespace"] == "k3serve-system"
    (deployment,) = by_kind(objs, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--all-namespaces" not in args
    assert (
        helm(helm_env, "template", "x", CHART, "--set", "rbac.scope=everywhere", check=False).returncode != 0
    )


@needs_helm
def test_operator_deployment_is_hardened_and_probed(helm_env):
    (deployment,) = by_kind(template(helm_env, "image.tag=1.2.3"), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    assert (
        pod["securityContext"]["runAsNonRoot"]
        and pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    )
    (c,) = pod["containers"]
    assert c["image"] == "ghcr.io/k3serve/k3serve:1.2.3"
    assert "--default-image=ghcr.io/k3serve/k3serve:1.2.3" in c["args"]
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert "--liveness=http://$(POD_IP):8080/healthz" in c["args"] and "--metrics-host=$(POD_IP)" in c["args"]


@needs_helm
def test_monitors_and_dashboards(helm_env):
    objs = template(helm_env, *VALUE_SETS["monitors"])
    (sm,) = by_kind(objs, "ServiceMonitor")
    (svc,) = by_kind(objs, "Service")
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"] == "metrics"
    assert len(by_kind(objs, "PodMonitor")) == 1
    boards = [
        o for o in by_kind(objs, "ConfigMap") if o["metadata"]["labels"].get("grafana_dashboard") == "1"
    ]
    files = sorted(os.listdir(os.path.join(CHART, "dashboards")))
    assert sorted(k for b in boards for k in b["data"]) == files
    for board in boards:
        for key, text in board["data"].items():
            with open(os.path.join(CHART, "dashboards", key), encoding="utf-8") as f:
                assert text == f.read().rstrip("\n")
        assert board["metadata"]["annotations"]["grafana_folder"] == "k3serve"
    moved = template(helm_env, *VALUE_SETS["dashboards-elsewhere"])
    assert {o["metadata"]["namespace"] for o in by_kind(moved, "ConfigMap")} == {"grafana"}
    assert not by_kind(template(helm_env, "dashboards.enabled=false"), "ConfigMap")


@needs_helm
def test_notes_tell_how_to_get_the_gateway_url(helm_env):
    out = helm(
        helm_env, "install", "k3serve", CHART, "--dry-run=client", "--namespace", "k3serve-system"
    ).stdout
    notes = out[out.index("NOTES:") :]
    assert "{.status.gatewayURL}" in notes and "port-forward svc/NAME-router" in notes


@needs_helm
def test_generated_files_and_the_kustomize_base_are_current():
    assert generate.write(ROOT, check=True) == [], "run `k3serve operator generate`"


@needs_helm
@needs_kubectl
def test_kustomize_base_builds_and_every_object_is_valid(helm_env):
    out = subprocess.run(
        [KUBECTL, "kustomize", os.path.join(ROOT, "manifests", "base")],
        env=helm_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    objs = [d for d in yaml.safe_load_all(out.stdout) if d]
    for obj in objs:
        assert validate.errors(obj) == [], obj["kind"]
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == sorted(
        [
            "Namespace",
            "CustomResourceDefinition",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Service",
            "Deployment",
        ]
    )
    assert by_kind(objs, "CustomResourceDefinition")[0] == crd.crd()
    chart_objs = {
        (o["kind"], o["metadata"]["name"]): o
        for o in template(helm_env, "dashboards.enabled=false")
        if o["kind"] != "CustomResourceDefinition"
    }
    for obj in objs:
        if obj["kind"] not in ("Namespace", "CustomResourceDefinition"):
            assert obj == chart_objs[(obj["kind"], obj["metadata"]["name"])]
