"""kopf for real: `k3serve operator run` as a subprocess against a Kubernetes API emulator (kmock,
subclassed as the design notes prescribe), driven through HTTP like kubectl would.

The emulator has no controllers, admission or garbage collector: tests play the controllers by
writing children's status, and assert owner references instead of cascading deletion.
Set K3SERVE_TEST_OPERATOR_VERBOSE=1 to get kopf's debug log in the operator log file.
"""

from __future__ import annotations

import copy
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import httpx
import pytest
import yaml

from k3serve.common.metrics_catalog import all_scraped_names
from k3serve.operator import generate
from k3serve.operator import names as n
from k3serve.operator.kube import CHILD_RESOURCES
from k3serve.operator.render import render
from k3serve.operator.render_context import RenderOptions
from k3serve.operator.testing import validate
from k3serve.operator.testing.emulator import EmulatorThread

ROOT = generate.repo_root()
CRS = "k3serve.io/v1alpha1/kimik3deployments"
CHILDREN = [r.api_version + "/" + r.plural for r in CHILD_RESOURCES]
pytestmark = pytest.mark.timeout(300)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sample(name: str) -> dict:
    with open(os.path.join(ROOT, "manifests", "samples", name), encoding="utf-8") as f:
        return yaml.safe_load(f)


def wait_for(what: str, fn: Callable[[], object], timeout: float = 90.0, log: str | None = None):
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            tail = open(log, encoding="utf-8").read()[-3000:] if log else ""
            raise AssertionError(f"timed out waiting for {what}\n--- operator log tail ---\n{tail}")
        time.sleep(0.2)


class Cluster:
    """The emulator plus a running `k3serve operator run`."""

    def __init__(
        self, emu: EmulatorThread, proc: subprocess.Popen, log: str, metrics_port: int, liveness: str
    ):
        self.emu, self.proc, self.log, self.metrics_port, self.liveness = (
            emu,
            proc,
            log,
            metrics_port,
            liveness,
        )
        self.http = httpx.Client(base_url=emu.url, timeout=10)

    def create(self, namespace: str, cr: dict) -> dict:
        cr = copy.deepcopy(cr)
        cr["metadata"]["namespace"] = namespace
        resp = self.http.post(
            f"/apis/{CRS}".replace("/kimik3deployments", f"/namespaces/{namespace}/kimik3deployments"),
            json=cr,
        )
        assert resp.status_code in (200, 201), resp.text
        return resp.json()

    def path(self, resource: str, namespace: str, name: str = "") -> str:
        api, _, plural = resource.rpartition("/")
        prefix = "/api" if api == "v1" else "/apis"
        return f"{prefix}/{api}/namespaces/{namespace}/{plural}" + (f"/{name}" if name else "")

    def patch(self, resource: str, namespace: str, name: str, body: dict, status: bool = False) -> None:
        url = self.path(resource, namespace, name) + ("/status" if status else "")
        resp = self.http.patch(url, json=body, headers={"Content-Type": "application/merge-patch+json"})
        assert resp.status_code == 200, resp.text

    def delete(self, resource: str, namespace: str, name: str) -> None:
        resp = self.http.delete(self.path(resource, namespace, name))
        assert resp.status_code == 200, resp.text

    def cr(self, namespace: str, name: str) -> dict | None:
        return self.emu.get(CRS, namespace, name)

    def status(self, namespace: str, name: str) -> dict:
        return (self.cr(namespace, name) or {}).get("status") or {}

    def condition(self, namespace: str, name: str, ctype: str) -> dict:
        return next(
            (c for c in self.status(namespace, name).get("conditions") or [] if c["type"] == ctype), {}
        )

    def children(self, namespace: str) -> dict[tuple[str, str], dict]:
        return self.emu.resources_of(namespace, CHILDREN)

    def events(self, namespace: str) -> list[dict]:
        return self.emu.objects("v1/events", namespace)

    def wait_status(
        self, namespace: str, name: str, pred: Callable[[dict], bool], what: str, timeout: float = 90
    ):
        return wait_for(
            what,
            lambda: (lambda s: s if s and pred(s) else None)(self.status(namespace, name)),
            timeout,
            self.log,
        )


def start_cluster(
    tmp_dir, *, lws: bool, scope: tuple[str, ...] = ("--all-namespaces",)
) -> tuple[EmulatorThread, Cluster]:
    emu = EmulatorThread(lws=lws, podmonitor=True).__enter__()
    kubeconfig = emu.kubeconfig(str(tmp_dir / "kubeconfig"))
    log = str(tmp_dir / "operator.log")
    metrics_port, liveness = free_port(), f"http://127.0.0.1:{free_port()}/healthz"
    env = dict(os.environ, KUBECONFIG=kubeconfig, PYTHONSAFEPATH="1", PYTHONUNBUFFERED="1")
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "k3serve",
                "operator",
                "run",
                *scope,
                "--liveness",
                liveness,
                "--metrics-host",
                "127.0.0.1",
                "--metrics-port",
                str(metrics_port),
                "--status-interval",
                "1",
                "--resync-interval",
                "3",
                "--default-image",
                "registry.test/k3serve:test",
                *(["-v"] if os.environ.get("K3SERVE_TEST_OPERATOR_VERBOSE") else []),
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=str(tmp_dir),
        )
    cluster = Cluster(emu, proc, log, metrics_port, liveness)

    def alive():
        assert proc.poll() is None, open(log, encoding="utf-8").read()[-3000:]
        try:
            return httpx.get(liveness, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for("the operator's liveness endpoint", alive, timeout=60, log=log)
    return emu, cluster


def stop_cluster(emu: EmulatorThread, cluster: Cluster) -> None:
    cluster.http.close()
    if cluster.proc.poll() is None:
        cluster.proc.send_signal(signal.SIGTERM)
        try:
            cluster.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            cluster.proc.kill()
            cluster.proc.wait(timeout=10)
    emu.__exit__(None, None, None)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    emu, c = start_cluster(tmp_path_factory.mktemp("operator"), lws=False)
    try:
        yield c
    finally:
        stop_cluster(emu, c)


_counter = iter(range(1000))


@pytest.fixture
def ns(cluster):
    """A fresh namespace; afterwards its deployments are deleted through the operator and the
    namespace is purged from the emulator (standing in for namespace deletion and garbage collection),
    which keeps the operator's periodic work small for the next tests."""
    namespace = f"t{next(_counter)}"
    yield namespace
    for cr in cluster.emu.objects(CRS, namespace):
        cluster.http.delete(cluster.path(CRS, namespace, cr["metadata"]["name"]))
    wait_for(
        "deployments to be deleted",
        lambda: not cluster.emu.objects(CRS, namespace),
        timeout=60,
        log=cluster.log,
    )
    cluster.emu.purge(namespace)


def expected_objects(
    cluster: Cluster, namespace: str, name: str, lws: bool = False
) -> dict[tuple[str, str], dict]:
    """What the renderer says the live CR should have (with the default image the operator was given)."""
    cr = cluster.cr(namespace, name)
    result = render(cr, RenderOptions(lws=lws, podmonitor=True, default_image="registry.test/k3serve:test"))
    return {(o["kind"], o["metadata"]["name"]): o for o in result.objects}


def assert_children_match(cluster: Cluster, namespace: str, name: str, lws: bool = False) -> dict:
    cr = cluster.cr(namespace, name)
    want = expected_objects(cluster, namespace, name, lws)
    live = wait_for(
        f"children of {namespace}/{name}",
        lambda: (lambda c: c if set(c) == set(want) else None)(cluster.children(namespace)),
        log=cluster.log,
    )
    for key, obj in live.items():
        assert validate.errors(obj) == [], key
        refs = obj["metadata"]["ownerReferences"]
        assert refs == [
            {
                "apiVersion": "k3serve.io/v1alpha1",
                "kind": "KimiK3Deployment",
                "name": name,
                "uid": cr["metadata"]["uid"],
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ], key
        for field in ("spec", "data", "rules", "roleRef", "subjects"):
            if field in want[key]:
                assert obj[field] == want[key][field], (key, field)
    return live


def test_tiny_cpu_sample_creates_every_child_and_a_status(cluster, ns):
    cluster.create(ns, sample("tiny-cpu.yaml"))
    status = cluster.wait_status(ns, "tiny", lambda s: s.get("observedGeneration") == 1, "status")
    live = assert_children_match(cluster, ns, "tiny")
    assert ("StatefulSet", "tiny-decode") in live and ("PodMonitor", "tiny") not in live  # podMonitor: false
    assert status["phase"] == "Progressing" and status["readyPools"] == "0/4"
    assert status["gatewayURL"] == f"http://tiny-router.{ns}.svc.cluster.local:8000/v1"
    assert status["decode"] == {
        "replicas": 1,
        "readyReplicas": 0,
        "selector": "k3serve.io/deployment=tiny,k3serve.io/role=decode",
    }
    assert cluster.condition(ns, "tiny", "Ready")["status"] == "False"
    assert cluster.condition(ns, "tiny", "Progressing")["status"] == "True"
    assert cluster.condition(ns, "tiny", "Degraded")["status"] == "False"
    image = live[("StatefulSet", "tiny-prefill")]["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == "registry.test/k3serve:test"  # the operator's --default-image
    cr = cluster.cr(ns, "tiny")
    assert cr["metadata"]["finalizers"] == ["k3serve.io/finalizer"]
    applied = wait_for(
        "an Applied event", lambda: [e for e in cluster.events(ns) if e["reason"] == "Applied"]
    )
    assert applied[0]["type"] == "Normal" and "17 created" in applied[0]["message"]
    assert applied[0]["involvedObject"]["uid"] == cr["metadata"]["uid"]


def test_status_turns_ready_when_the_children_are_ready(cluster, ns):
    cluster.create(ns, sample("tiny-cpu.yaml"))
    live = assert_children_match(cluster, ns, "tiny")
    for (kind, name), obj in live.items():
        if kind in ("StatefulSet", "Deployment"):  # play the controllers
            replicas = obj["spec"]["replicas"]
            cluster.patch(
                ("apps/v1/statefulsets" if kind == "StatefulSet" else "apps/v1/deployments"),
                ns,
                name,
                {"status": {"replicas": replicas, "readyReplicas": replicas}},
                status=True,
            )
    status = cluster.wait_status(ns, "tiny", lambda s: s.get("phase") == "Ready", "phase Ready")
    assert status["readyPools"] == "4/4"
    ready = cluster.condition(ns, "tiny", "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "AllPoolsReady")
    assert cluster.condition(ns, "tiny", "Progressing")["status"] == "False"


def test_production_sample_renders_a_statefulset_per_decode_group(cluster, ns):
    cluster.create(ns, sample("k3-tep8-dep16.yaml"))
    cluster.wait_status(ns, "k3", lambda s: s.get("observedGeneration") == 1, "status")
    live = assert_children_match(cluster, ns, "k3")
    assert live[("StatefulSet", "k3-decode-0")]["spec"]["replicas"] == 2
    assert ("PodMonitor", "k3") in live and ("LeaderWorkerSet", "k3-decode") not in live


def test_spec_changes_patch_the_children_and_prune_what_is_gone(cluster, ns):
    cluster.create(ns, sample("k3-tep8-dep16.yaml"))
    cluster.wait_status(ns, "k3", lambda s: s.get("observedGeneration") == 1, "first status")
    before = assert_children_match(cluster, ns, "k3")
    router_hash = before[("Deployment", "k3-router")]["spec"]["template"]["metadata"]["annotations"][
        n.ANN_CONFIG_HASH
    ]
    # scale decode to 3 groups (what `kubectl scale` does through the scale subresource) and change policy
    cluster.patch(CRS, ns, "k3", {"spec": {"decode": {"replicas": 3}, "router": {"policy": "least-loaded"}}})
    status = cluster.wait_status(ns, "k3", lambda s: s.get("observedGeneration") == 2, "generation 2")
    after = assert_children_match(cluster, ns, "k3")
    assert ("StatefulSet", "k3-decode-2") in after and ("Service", "k3-decode-2") in after
    assert status["decode"]["replicas"] == 3
    router = after[("Deployment", "k3-router")]["spec"]["template"]
    assert "least-loaded" in router["spec"]["containers"][0]["args"]
    assert router["metadata"]["annotations"][n.ANN_CONFIG_HASH] != router_hash
    # the untouched prefill pool was not rewritten
    assert (
        after[("StatefulSet", "k3-prefill")]["metadata"]["resourceVersion"]
        == before[("StatefulSet", "k3-prefill")]["metadata"]["resourceVersion"]
    )
    # scale down to one group: groups 1 and 2 are deleted
    cluster.patch(CRS, ns, "k3", {"spec": {"decode": {"replicas": 1}}})
    cluster.wait_status(ns, "k3", lambda s: s.get("observedGeneration") == 3, "generation 3")
    final = assert_children_match(cluster, ns, "k3")
    assert not {("StatefulSet", "k3-decode-1"), ("StatefulSet", "k3-decode-2")} & set(final)
    assert wait_for("a Pruned event", lambda: [e for e in cluster.events(ns) if e["reason"] == "Pruned"])


def test_unservable_layout_is_degraded_before_anything_is_created(cluster, ns):
    bad = sample("k3-tep8-dep16.yaml")
    bad["spec"]["decode"]["dataParallelSize"] = 12
    cluster.create(ns, bad)
    status = cluster.wait_status(ns, "k3", lambda s: s.get("phase") == "Degraded", "phase Degraded")
    degraded = cluster.condition(ns, "k3", "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidLayout")
    assert "12 ranks per group" in degraded["message"] and "8-GPU nodes" in degraded["message"]
    assert cluster.condition(ns, "k3", "Ready")["status"] == "False"
    assert status["observedGeneration"] == 1
    warning = wait_for(
        "an InvalidLayout event", lambda: [e for e in cluster.events(ns) if e["reason"] == "InvalidLayout"]
    )
    assert warning[0]["type"] == "Warning" and "12 ranks per group" in warning[0]["message"]
    time.sleep(1.5)  # a status-refresh tick later: still nothing created
    assert cluster.children(ns) == {}
    # fixing the spec creates everything and clears Degraded
    cluster.patch(CRS, ns, "k3", {"spec": {"decode": {"dataParallelSize": 16}}})
    cluster.wait_status(ns, "k3", lambda s: s.get("phase") == "Progressing", "recovery")
    assert cluster.condition(ns, "k3", "Degraded")["status"] == "False"
    assert_children_match(cluster, ns, "k3")


def test_schema_invalid_cr_is_degraded_with_the_field_named(cluster, ns):
    # a real API server rejects this at admission; the emulator has none, so the operator's own check acts
    bad = sample("tiny-cpu.yaml")
    bad["spec"]["router"]["policy"] = "fastest"
    cluster.create(ns, bad)
    cluster.wait_status(ns, "tiny", lambda s: s.get("phase") == "Degraded", "phase Degraded")
    degraded = cluster.condition(ns, "tiny", "Degraded")
    assert degraded["reason"] == "InvalidSpec"
    assert "spec.router.policy: 'fastest' is not one of" in degraded["message"]
    assert cluster.children(ns) == {}


def test_a_foreign_object_in_the_way_is_reported_and_never_taken_over(cluster, ns):
    foreign = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "tiny-router", "namespace": ns},
        "spec": {"ports": [{"port": 80}]},
    }
    assert cluster.http.post(cluster.path("v1/services", ns), json=foreign).status_code in (200, 201)
    cluster.create(ns, sample("tiny-cpu.yaml"))
    cluster.wait_status(ns, "tiny", lambda s: s.get("phase") == "Degraded", "phase Degraded")
    degraded = cluster.condition(ns, "tiny", "Degraded")
    assert degraded["reason"] == "ApplyFailed"
    assert (
        "Service/tiny-router already exists and is not managed by this KimiK3Deployment"
        in degraded["message"]
    )
    assert wait_for(
        "an ApplyFailed event", lambda: [e for e in cluster.events(ns) if e["reason"] == "ApplyFailed"]
    )
    service = cluster.emu.get("v1/services", ns, "tiny-router")
    assert "ownerReferences" not in service["metadata"] and service["spec"] == foreign["spec"]
    cluster.delete("v1/services", ns, "tiny-router")  # the user clears the way: the operator recovers
    cluster.wait_status(ns, "tiny", lambda s: s.get("phase") == "Progressing", "recovery")
    assert cluster.condition(ns, "tiny", "Degraded")["status"] == "False"
    assert_children_match(cluster, ns, "tiny")


def test_a_deleted_child_is_recreated(cluster, ns):
    cluster.create(ns, sample("tiny-cpu.yaml"))
    assert_children_match(cluster, ns, "tiny")
    cluster.delete("apps/v1/deployments", ns, "tiny-router")
    wait_for(
        "the router Deployment to come back",
        lambda: cluster.emu.get("apps/v1/deployments", ns, "tiny-router"),
        log=cluster.log,
    )
    assert_children_match(cluster, ns, "tiny")


def test_delete_leaves_owned_children_to_the_garbage_collector_and_removes_the_rest(cluster, ns):
    cr = cluster.create(ns, sample("tiny-cpu.yaml"))
    owned = assert_children_match(cluster, ns, "tiny")
    leftover = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "tiny-leftover",
            "namespace": ns,
            "labels": {n.LABEL_DEPLOYMENT: "tiny", n.LABEL_MANAGED_BY: n.MANAGED_BY},
        },
        "data": {"k": "v"},
    }
    unrelated = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "users-own", "namespace": ns}}
    for obj in (leftover, unrelated):
        assert cluster.http.post(cluster.path("v1/configmaps", ns), json=obj).status_code in (200, 201)
    cluster.delete(CRS, ns, "tiny")
    wait_for(
        "the CR to be gone (finalizer released)", lambda: cluster.cr(ns, "tiny") is None, log=cluster.log
    )
    wait_for(
        "the unowned leftover to be deleted",
        lambda: cluster.emu.get("v1/configmaps", ns, "tiny-leftover") is None,
        log=cluster.log,
    )
    assert cluster.emu.get("v1/configmaps", ns, "users-own") is not None
    remaining = cluster.children(ns)
    assert set(remaining) - {("ConfigMap", "users-own")} == set(owned)  # no garbage collector here ...
    for key in owned:  # ... Kubernetes deletes these through their owner reference
        assert remaining[key]["metadata"]["ownerReferences"][0]["uid"] == cr["metadata"]["uid"]


def test_operator_metrics_are_exported_and_catalogued(cluster, ns):
    """Standalone: it makes the create/ok, create/invalid and update/ok reconciles it asserts."""
    cluster.create(ns, sample("tiny-cpu.yaml"))
    cluster.wait_status(ns, "tiny", lambda s: s.get("observedGeneration") == 1, "status")
    cluster.patch(CRS, ns, "tiny", {"spec": {"router": {"policy": "least-loaded"}}})
    cluster.wait_status(ns, "tiny", lambda s: s.get("observedGeneration") == 2, "generation 2")
    bad = sample("tiny-cpu.yaml")
    bad["metadata"]["name"] = "tiny-bad"
    bad["spec"]["router"]["policy"] = "fastest"
    cluster.create(ns, bad)
    cluster.wait_status(ns, "tiny-bad", lambda s: s.get("phase") == "Degraded", "phase Degraded")

    def scrape():
        text = httpx.get(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=5).text
        return text if 'handler="update",result="ok"' in text and 'result="invalid"' in text else None

    text = wait_for("the reconcile counters", scrape, timeout=30, log=cluster.log)
    names = {
        line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("k3serve_operator")
    }
    assert {
        "k3serve_operator_reconciles_total",
        "k3serve_operator_deployments",
        "k3serve_operator_reconcile_seconds_bucket",
    } <= names
    assert names <= all_scraped_names()
    assert 'k3serve_operator_reconciles_total{handler="create",result="ok"}' in text
    assert 'k3serve_operator_reconciles_total{handler="create",result="invalid"}' in text
    assert 'k3serve_operator_reconciles_total{handler="update",result="ok"}' in text


def test_operator_log_has_no_tracebacks(cluster, ns):
    cluster.create(ns, sample("tiny-cpu.yaml"))  # standalone: at least one reconcile is in the log
    cluster.wait_status(ns, "tiny", lambda s: s.get("observedGeneration") == 1, "status")
    with open(cluster.log, encoding="utf-8") as f:
        log = f.read()
    assert "Traceback" not in log, log[-3000:]
    assert cluster.proc.poll() is None


def test_leaderworkerset_groups_when_the_crd_is_installed(tmp_path):
    emu, c = start_cluster(tmp_path, lws=True)
    try:
        c.create("lws", sample("k3-tep8-dep16.yaml"))
        c.wait_status("lws", "k3", lambda s: s.get("observedGeneration") == 1, "status")
        live = assert_children_match(c, "lws", "k3", lws=True)
        lws = live[("LeaderWorkerSet", "k3-decode")]
        assert lws["spec"]["replicas"] == 2 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
        assert not [k for k in live if k[0] == "StatefulSet" and k[1].startswith("k3-decode")]
        c.patch(
            "leaderworkerset.x-k8s.io/v1/leaderworkersets",
            "lws",
            "k3-decode",
            {"status": {"readyReplicas": 1}},
            status=True,
        )
        status = c.wait_status(
            "lws", "k3", lambda s: s.get("decode", {}).get("readyReplicas") == 1, "decode 1/2"
        )
        assert status["decode"]["selector"].startswith("k3serve.io/deployment=k3,k3serve.io/role=decode,")
        assert "leaderworkerset.sigs.k8s.io/worker-index=0" in status["decode"]["selector"]
    finally:
        stop_cluster(emu, c)


def test_namespace_scoped_operator_ignores_other_namespaces(tmp_path):
    emu, c = start_cluster(tmp_path, lws=False, scope=("--namespace", "watched"))
    try:
        c.create("other", sample("tiny-cpu.yaml"))
        c.create("watched", sample("tiny-cpu.yaml"))
        c.wait_status(
            "watched", "tiny", lambda s: s.get("observedGeneration") == 1, "status in the watched namespace"
        )
        assert_children_match(c, "watched", "tiny")
        time.sleep(1.5)  # more than a status interval: the other namespace stays untouched
        assert c.status("other", "tiny") == {} and c.children("other") == {}
        assert "finalizers" not in c.cr("other", "tiny")["metadata"]
    finally:
        stop_cluster(emu, c)
