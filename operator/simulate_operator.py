"""`k3serve operator simulate --operator`: the real operator reconciles the CR while its pods run.

Starts the Kubernetes API emulator (operator/testing/emulator.py; needs the test extras: kmock), runs
`k3serve operator run` against it (kopf, for real), applies the CR, and plays the controllers and the
kubelet: every simulated pod is a Pod object (labels, ports, podIP, the Ready condition from its
readiness probe) — the router's `--discovery kubernetes` reads them — and every StatefulSet's and
Deployment's `status.readyReplicas` is the number of its pods whose readiness probe passes now. The deployment's status (phase, readyPools, gatewayURL,
configHash) is then the operator's own answer, read back from the API. The operator's /metrics is a
Prometheus target like the pods (namespace k3serve-system, as the chart installs it).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from k3serve.operator import crd
from k3serve.operator.simulate_plan import SimPod, SimulateError

OPERATOR_NAMESPACE = "k3serve-system"
WORKLOADS = {"StatefulSet": "apps/v1/statefulsets", "Deployment": "apps/v1/deployments",
             "LeaderWorkerSet": "leaderworkerset.x-k8s.io/v1/leaderworkersets"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SimulatedCluster:
    def __init__(self, cr: dict, pods: list[SimPod], root: Path, lws: bool = False):
        self.cr, self.pods, self.root, self.lws = cr, pods, root, lws
        self.namespace = cr["metadata"]["namespace"]
        self.name = cr["metadata"]["name"]
        self.emulator = None
        self.proc: subprocess.Popen | None = None
        self.metrics_port = 0
        self._published: dict[str, str] = {}

    # --- API calls ---------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict | None = None, ctype: str = "application/json"):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.emulator.url + path, data=data, method=method,
                                     headers={"Content-Type": ctype})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read() or b"{}")

    def _cr_path(self) -> str:
        return f"/apis/{crd.GROUP}/{crd.VERSION}/namespaces/{self.namespace}/{crd.PLURAL}/{self.name}"

    def start(self) -> None:
        try:
            from k3serve.operator.testing.emulator import EmulatorThread
        except ImportError as e:
            raise SimulateError(f"--operator needs the API emulator's packages (kmock: the test extras): {e}") from None
        self.emulator = EmulatorThread(lws=self.lws, podmonitor=True).__enter__()
        kubeconfig = self.emulator.kubeconfig(str(self.root / "kubeconfig"))
        self.metrics_port = _free_port()
        env = dict(os.environ, KUBECONFIG=kubeconfig, PYTHONSAFEPATH="1", PYTHONUNBUFFERED="1")
        log = open(self.root / "operator.log", "wb")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "k3serve.cli", "operator", "run", "-A", "--metrics-host", "127.0.0.1",
             "--metrics-port", str(self.metrics_port), "--status-interval", "1", "--resync-interval", "30"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        body = {k: v for k, v in self.cr.items() if k != "status"}
        body.setdefault("apiVersion", crd.API_VERSION)
        body.setdefault("kind", crd.KIND)
        self._request("POST", self._cr_path().rsplit("/", 1)[0], body)

    def _publish_pods(self, ready: dict[str, bool]) -> None:
        """The kubelet's part: each simulated pod as a Pod object (labels, ports, podIP, Ready)."""
        base = f"/api/v1/namespaces/{self.namespace}/pods"
        for pod in self.pods:
            cond = "True" if ready[pod.name] else "False"
            if self._published.get(pod.name) == cond:
                continue
            status = {"phase": "Running", "podIP": pod.ip, "hostIP": "127.0.0.1",
                      "conditions": [{"type": "Ready", "status": cond}]}
            if pod.name not in self._published:
                c = pod.container
                body = {"apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": pod.name, "namespace": self.namespace, "labels": pod.labels},
                        "spec": {"containers": [{"name": c["name"], "image": c.get("image", ""),
                                                 "ports": c.get("ports") or []}]},
                        "status": status}
                self._request("POST", base, body)
            else:
                self._request("PATCH", f"{base}/{pod.name}/status", {"status": status},
                              "application/merge-patch+json")
            self._published[pod.name] = cond

    def sync(self) -> None:
        """The kubelet's and the controllers' part: Pods and workload status from the simulated pods'
        readiness probes."""
        ready = {p.name: _probe(p) for p in self.pods}
        self._publish_pods(ready)
        for kind, resource in WORKLOADS.items():
            for obj in self.emulator.objects(resource, self.namespace):
                name = obj["metadata"]["name"]
                mine = [p for p in self.pods if p.workload == f"{kind}/{name}"]
                if kind == "LeaderWorkerSet":  # its replicas are groups: ready when every pod of the group is
                    groups: dict[str, bool] = {}
                    for p in mine:
                        g = p.labels.get("leaderworkerset.sigs.k8s.io/group-index", "")
                        groups[g] = groups.get(g, True) and ready[p.name]
                    units, n_ready = len(groups), sum(groups.values())
                else:
                    units, n_ready = len(mine), sum(ready[p.name] for p in mine)
                status = {"replicas": units, "readyReplicas": n_ready, "availableReplicas": n_ready,
                          "observedGeneration": obj["metadata"].get("generation", 1)}
                if (obj.get("status") or {}).get("readyReplicas") != n_ready:
                    group_version, plural = resource.rsplit("/", 1)
                    self._request("PATCH", f"/apis/{group_version}/namespaces/{self.namespace}/{plural}"
                                  f"/{name}/status", {"status": status}, "application/merge-patch+json")

    def status(self) -> dict:
        try:
            return self._request("GET", self._cr_path()).get("status") or {}
        except (urllib.error.URLError, OSError):
            return {}

    def wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise SimulateError(f"the operator exited with {self.proc.returncode}:\n" + self.log_tail())
            self.sync()
            status = self.status()
            if status.get("phase") == "Ready" and status.get("gatewayURL"):
                return status
            if status.get("phase") == "Degraded":
                raise SimulateError(f"the operator marked the deployment Degraded: {status.get('conditions')}")
            if time.monotonic() > deadline:
                raise SimulateError(f"the operator did not report Ready after {timeout:.0f} s: {status}\n"
                                    + self.log_tail())
            time.sleep(0.5)

    def prometheus_targets(self) -> list[dict]:
        return [{"targets": [f"127.0.0.1:{self.metrics_port}"],
                 "labels": {"namespace": OPERATOR_NAMESPACE, "pod": "k3serve-operator-sim0",
                            "container": "operator", "endpoint": "metrics"}}]

    def log_tail(self, lines: int = 30) -> str:
        path = self.root / "operator.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.emulator is not None:
            self.emulator.__exit__(None, None, None)
            self.emulator = None


def _probe(pod: SimPod) -> bool:
    if not pod.ready_url:
        return True
    try:
        with urllib.request.urlopen(pod.ready_url, timeout=1) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False
