"""What `k3serve operator simulate` runs: the rendered pods as local processes (pure, no processes here).

From the objects a CR renders (operator/render.py) this computes, per pod of every StatefulSet,
LeaderWorkerSet and Deployment, the process Kubernetes would start in its container:

* pod IPs are loopback addresses (127.100.0.N, one per pod, so every pod keeps its contract ports),
  and a pod's network interface is `lo` (`--kv-transfer-devices` names it);
* Service names (`SVC.NS.svc.DOMAIN`, `SVC.NS.svc`, `SVC.NS`, headless `POD.SVC.NS.svc.DOMAIN`) in
  `args` and `env` become the IP of a ready pod behind them, and a Service port its target port;
* every volume mount is a folder of the pod's sandbox (`ROOT/pods/POD/<mountPath>`): emptyDirs empty,
  ConfigMap and Secret keys written as files, PersistentVolumeClaims a local directory given per claim;
  paths in `args` and `env` under a mount point are rewritten to the sandbox;
* `env` is resolved as the kubelet does (downward API `fieldRef`s, `secretKeyRef`/`configMapKeyRef`,
  `$(VAR)` references to earlier variables, `$$` escapes), then `args` are expanded with it;
* the image entrypoint (`k3serve`) is this Python's `-m k3serve.cli`, `command: [mooncake_master]` the
  executable next to this Python;
* the readiness probe is an HTTP GET of the pod IP at the probe's (named) port;
* a PodMonitor becomes Prometheus `static_configs` with the target labels the Prometheus operator
  would attach (`namespace`, `pod`, `container`, `endpoint`, `job` and the `podTargetLabels`).

A LeaderWorkerSet becomes the pods its controller would create (operator/render_lws.py controller_pods:
`NAME-G` leaders, `NAME-G-I` workers, its labels and LWS_* variables) and its headless Service `NAME`.

What is not simulated: scheduling, resources (a CPU request becomes OMP_NUM_THREADS), NetworkPolicies,
PodDisruptionBudgets, RBAC, the router's `--discovery kubernetes`
(replaced by static discovery of the pods its selectors match, which is what it would discover;
with `--operator` the router discovers the pods for real, from the API emulator).
"""

from __future__ import annotations

import ipaddress
import json
import math
import posixpath
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from k3serve.operator import names as n
from k3serve.operator import render_lws

IP_BASE = ipaddress.IPv4Address("127.100.0.1")
ENTRYPOINT = [sys.executable, "-m", "k3serve.cli"]


class SimulateError(Exception):
    """The rendered objects cannot be simulated as given; the message says why."""


@dataclass
class SimPod:
    name: str
    ip: str
    labels: dict[str, str]
    workload: str  # "StatefulSet/NAME", "LeaderWorkerSet/NAME" or "Deployment/NAME"
    template: dict
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)  # sandbox-relative path -> content
    dirs: list[str] = field(default_factory=list)  # sandbox-relative folders to create
    links: dict[str, str] = field(default_factory=dict)  # sandbox-relative path -> local directory
    ready_url: str = ""
    ports: dict[str, int] = field(default_factory=dict)  # container port name -> number

    @property
    def container(self) -> dict:
        return self.template["spec"]["containers"][0]

    @property
    def component(self) -> str:
        return self.labels.get(n.LABEL_ROLE, "")


def pods_of(objects: list[dict], ip_base: ipaddress.IPv4Address = IP_BASE) -> list[SimPod]:
    """One SimPod per pod the StatefulSets and Deployments would create, each with its own IP."""
    pods: list[SimPod] = []
    for obj in objects:
        kind, name = obj["kind"], obj["metadata"]["name"]
        if kind == render_lws.KIND:  # the LWS controller's pods, leader first, LWS_* env injected
            for pod in render_lws.controller_pods(obj):
                if len(pod["template"]["spec"]["containers"]) != 1:
                    raise SimulateError(f"{kind}/{name}: only one container per pod is simulated")
                pods.append(SimPod(name=pod["name"], ip=str(ip_base + len(pods)), labels=pod["labels"],
                                   workload=f"{kind}/{name}", template=pod["template"]))
            continue
        if kind not in ("StatefulSet", "Deployment"):
            continue
        tpl = obj["spec"]["template"]
        if len(tpl["spec"]["containers"]) != 1:
            raise SimulateError(f"{kind}/{name}: only one container per pod is simulated")
        for i in range(int(obj["spec"].get("replicas", 1))):
            labels = dict(tpl["metadata"].get("labels") or {})
            if kind == "StatefulSet":
                pod_name = f"{name}-{i}"
                labels[n.LABEL_STS_POD_INDEX] = str(i)
                labels["statefulset.kubernetes.io/pod-name"] = pod_name
            else:
                pod_name = f"{name}-sim{i}"
            ip = str(ip_base + len(pods))
            pods.append(SimPod(name=pod_name, ip=ip, labels=labels, workload=f"{kind}/{name}", template=tpl))
    return pods


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _selector_of(text: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in text.split(",") if part)


@dataclass
class ServiceRoute:
    ip: str
    ports: dict[int, int]  # service port -> the pod's container port


def service_routes(objects: list[dict], pods: list[SimPod], namespace: str, domain: str) -> dict[str, ServiceRoute]:
    """DNS name -> where it leads. ClusterIP Services lead to their first pod (no load balancing)."""
    routes: dict[str, ServiceRoute] = {}
    for svc in (o for o in objects if o["kind"] == "Service"):
        name = svc["metadata"]["name"]
        backends = [p for p in pods if _matches(svc["spec"].get("selector") or {}, p.labels)]
        if not backends:
            continue

        def port_map(pod: SimPod, svc=svc) -> dict[int, int]:
            out = {}
            for port in svc["spec"].get("ports") or []:
                target = port.get("targetPort", port["port"])
                out[port["port"]] = _container_port(pod, target)
            return out

        for dns in (f"{name}.{namespace}.svc.{domain}", f"{name}.{namespace}.svc", f"{name}.{namespace}"):
            routes[dns] = ServiceRoute(backends[0].ip, port_map(backends[0]))
        if svc["spec"].get("clusterIP") == "None":  # headless: every pod has its own name (short forms too)
            for pod in backends:
                for dns in (f"{pod.name}.{name}.{namespace}.svc.{domain}", f"{pod.name}.{name}.{namespace}.svc",
                            f"{pod.name}.{name}.{namespace}"):
                    routes[dns] = ServiceRoute(pod.ip, port_map(pod))
    return routes


def _container_port(pod: SimPod, target) -> int:
    if isinstance(target, int) or str(target).isdigit():
        return int(target)
    for port in pod.container.get("ports") or []:
        if port.get("name") == target:
            return int(port["containerPort"])
    raise SimulateError(f"pod {pod.name}: no container port named {target!r}")


def rewrite_hosts(value: str, routes: dict[str, ServiceRoute]) -> str:
    """Service DNS names (and `name:port`) in `value` replaced by pod IP (and target port)."""
    for dns in sorted(routes, key=len, reverse=True):
        route = routes[dns]
        pattern = re.compile(r"(?<![\w.-])" + re.escape(dns) + r"(?::(\d+))?(?![\w.-])")

        def sub(m: re.Match, route=route) -> str:
            if m.group(1) is None:
                return route.ip
            port = int(m.group(1))
            return f"{route.ip}:{route.ports.get(port, port)}"

        value = pattern.sub(sub, value)
    return value


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: defined variables are replaced, `$$` is a literal `$`."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", sub, value)


def _field_ref(pod: SimPod, namespace: str, path: str) -> str:
    simple = {"status.podIP": pod.ip, "status.hostIP": "127.0.0.1", "metadata.name": pod.name,
              "metadata.namespace": namespace, "spec.nodeName": "simulated",
              "spec.serviceAccountName": pod.template["spec"].get("serviceAccountName", "default")}
    if path in simple:
        return simple[path]
    m = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
    if m:
        return pod.labels.get(m.group(1), "")
    raise SimulateError(f"pod {pod.name}: fieldRef {path!r} is not simulated")


@dataclass
class Inputs:
    """What a cluster would hold besides the rendered objects."""

    namespace: str
    cluster_domain: str
    secrets: dict[str, dict[str, str]]  # Secret name -> key -> value
    claims: dict[str, str]  # PersistentVolumeClaim name -> local directory
    config_maps: dict[str, dict[str, str]] = field(default_factory=dict)  # from the rendered objects


def _mount_map(pod: SimPod) -> list[tuple[str, str]]:
    """(mountPath, sandbox-relative path), longest mount path first."""
    out = [(m["mountPath"], "fs" + m["mountPath"]) for m in pod.container.get("volumeMounts") or []]
    return sorted(out, key=lambda x: len(x[0]), reverse=True)


def rewrite_paths(value: str, mounts: list[tuple[str, str]], sandbox: Path) -> str:
    for mount, rel in mounts:
        if value == mount or value.startswith(mount.rstrip("/") + "/"):
            return str(sandbox / rel) + value[len(mount) :]
    return value


def plan(objects: list[dict], inputs: Inputs, root: Path, ip_base: ipaddress.IPv4Address = IP_BASE,
         kubeconfig: str | None = None) -> list[SimPod]:
    """Every pod with its argv, env, files and readiness URL (root: the simulation's folder).

    With `kubeconfig` (an API server that holds the simulated Pods: `simulate --operator`) the router
    keeps its `--discovery kubernetes` and reads the pods from there; otherwise its selectors become
    static discovery of the pods they match."""
    for obj in objects:
        if obj["kind"] == "ConfigMap":
            inputs.config_maps[obj["metadata"]["name"]] = dict(obj.get("data") or {})
    pods = pods_of(objects, ip_base)
    controller_made = [render_lws.controller_service(o) for o in objects if o["kind"] == render_lws.KIND]
    routes = service_routes(objects + controller_made, pods, inputs.namespace, inputs.cluster_domain)
    for pod in pods:
        _plan_pod(pod, inputs, routes, root / "pods" / pod.name)
    if kubeconfig is None:
        _static_discovery(pods)
    else:
        for pod in pods:
            if "--discovery" in pod.argv:
                pod.env["KUBECONFIG"] = kubeconfig
    return pods


def _plan_pod(pod: SimPod, inputs: Inputs, routes: dict[str, ServiceRoute], sandbox: Path) -> None:
    c = pod.container
    pod.ports = {p["name"]: int(p["containerPort"]) for p in c.get("ports") or [] if p.get("name")}
    mounts = _mount_map(pod)
    _volumes(pod, inputs)
    env: dict[str, str] = {}
    for var in c.get("env") or []:
        if "value" in var:
            value = expand(str(var["value"]), env)
        else:
            ref = var.get("valueFrom") or {}
            if "fieldRef" in ref:
                value = _field_ref(pod, inputs.namespace, ref["fieldRef"]["fieldPath"])
            elif "secretKeyRef" in ref:
                value = _lookup(inputs.secrets, ref["secretKeyRef"], "Secret", pod)
            elif "configMapKeyRef" in ref:
                value = _lookup(inputs.config_maps, ref["configMapKeyRef"], "ConfigMap", pod)
            else:
                raise SimulateError(f"pod {pod.name}: env {var['name']}: valueFrom {sorted(ref)} is not simulated")
        env[var["name"]] = rewrite_paths(rewrite_hosts(value, routes), mounts, sandbox)
    argv = list(c["command"]) if c.get("command") else list(ENTRYPOINT)
    if c.get("command"):
        argv[0] = str(Path(sys.executable).parent / argv[0]) if "/" not in argv[0] else argv[0]
    argv += [rewrite_paths(rewrite_hosts(expand(str(a), env), routes), mounts, sandbox) for a in c.get("args") or []]
    if "--kv-transfer-devices" in argv:  # a simulated pod's only network interface is loopback
        argv[argv.index("--kv-transfer-devices") + 1] = "lo"
    pod.argv, pod.env = argv, env
    probe = (c.get("readinessProbe") or {}).get("httpGet")
    if probe:
        port = _container_port(pod, probe["port"])
        pod.ready_url = f"http://{pod.ip}:{port}{probe.get('path', '/')}"
    cpu = ((c.get("resources") or {}).get("requests") or {}).get("cpu")
    if cpu is not None:
        milli = int(str(cpu)[:-1]) if str(cpu).endswith("m") else int(float(cpu) * 1000)
        pod.env.setdefault("OMP_NUM_THREADS", str(max(1, math.ceil(milli / 1000))))


def _lookup(store: dict[str, dict[str, str]], ref: dict, kind: str, pod: SimPod) -> str:
    try:
        return store[ref["name"]][ref["key"]]
    except KeyError:
        if ref.get("optional"):
            return ""
        raise SimulateError(f"pod {pod.name}: {kind} {ref['name']!r} has no key {ref['key']!r} "
                            f"(give it with --secret {ref['name']}/{ref['key']}=VALUE)") from None


def _volumes(pod: SimPod, inputs: Inputs) -> None:
    spec = pod.template["spec"]
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    for m in pod.container.get("volumeMounts") or []:
        vol = volumes[m["name"]]
        rel = "fs" + m["mountPath"]
        if "emptyDir" in vol:
            pod.dirs.append(rel)
        elif "configMap" in vol or "secret" in vol:
            kind = "configMap" if "configMap" in vol else "secret"
            src = vol[kind]
            name = src.get("name") or src.get("secretName")
            data = (inputs.config_maps if kind == "configMap" else inputs.secrets).get(name)
            if data is None:
                raise SimulateError(f"pod {pod.name}: {kind} {name!r} does not exist"
                                    + (f" (give it with --secret {name}/KEY=VALUE)" if kind == "secret" else ""))
            items = src.get("items") or [{"key": k, "path": k} for k in data]
            pod.dirs.append(rel)
            for item in items:
                if item["key"] not in data:
                    raise SimulateError(f"pod {pod.name}: {kind} {name!r} has no key {item['key']!r}"
                                        + (f" (give it with --secret {name}/{item['key']}=VALUE)"
                                           if kind == "secret" else ""))
                pod.files[posixpath.join(rel, item["path"])] = str(data[item["key"]]).encode()
        elif "persistentVolumeClaim" in vol:
            claim = vol["persistentVolumeClaim"]["claimName"]
            if claim not in inputs.claims:
                raise SimulateError(f"pod {pod.name}: PersistentVolumeClaim {claim!r}: give a local directory "
                                    f"with --pvc {claim}=DIR")
            pod.links[rel] = inputs.claims[claim]
        else:
            raise SimulateError(f"pod {pod.name}: volume {m['name']!r} of kind {sorted(vol)} is not simulated")


def _static_discovery(pods: list[SimPod]) -> None:
    """The router's `--discovery kubernetes --prefill-selector A --decode-selector B` becomes static
    discovery of the pods those selectors match (their container port `grpc`), as the router would
    find them through the Kubernetes API."""
    for pod in pods:
        argv = pod.argv
        if "--discovery" not in argv or argv[argv.index("--discovery") + 1] != "kubernetes":
            continue
        out, selectors, i = [], {}, 0
        while i < len(argv):
            if argv[i] in ("--discovery", "--prefill-selector", "--decode-selector"):
                selectors[argv[i]] = argv[i + 1]
                i += 2
                continue
            out.append(argv[i])
            i += 1

        def addresses(flag: str, selectors=selectors) -> str:
            sel = _selector_of(selectors.get(flag, ""))
            return ",".join(f"{p.ip}:{p.ports['grpc']}" for p in pods if "grpc" in p.ports and _matches(sel, p.labels))

        out += ["--discovery", "static"]
        decode = addresses("--decode-selector")
        if not decode:
            raise SimulateError(f"pod {pod.name}: no pod matches --decode-selector {selectors.get('--decode-selector')}")
        if "--prefill-selector" in selectors:
            prefill = addresses("--prefill-selector")
            if not prefill:
                raise SimulateError(f"pod {pod.name}: no pod matches --prefill-selector "
                                    f"{selectors['--prefill-selector']}")
            out += ["--prefill-workers", prefill, "--decode-workers", decode]
        else:
            out += ["--workers", decode]
        pod.argv = out


def prometheus_config(objects: list[dict], pods: list[SimPod], namespace: str, interval: str | None = None,
                      operator_targets: list[dict] | None = None) -> str:
    """prometheus.yml scraping what the rendered PodMonitor selects, as the Prometheus operator would
    (plus the operator's own /metrics, which the chart's PodMonitor/ServiceMonitor scrapes)."""
    jobs = []
    if operator_targets:
        jobs.append({"job_name": "k3serve-operator", "scrape_interval": interval or "15s",
                     "static_configs": operator_targets,
                     "relabel_configs": [{"target_label": "job", "replacement": "k3serve-system/k3serve-operator"}]})
    for pm in (o for o in objects if o["kind"] == "PodMonitor"):
        spec = pm["spec"]
        sel = (spec.get("selector") or {}).get("matchLabels") or {}
        for ep in spec["podMetricsEndpoints"]:
            targets = []
            for pod in pods:
                if not _matches(sel, pod.labels) or ep["port"] not in pod.ports:
                    continue
                labels = {"namespace": namespace, "pod": pod.name, "container": pod.container["name"],
                          "endpoint": ep["port"]}
                for label in spec.get("podTargetLabels") or []:
                    if label in pod.labels:
                        labels[re.sub(r"[^a-zA-Z0-9_]", "_", label)] = pod.labels[label]
                targets.append({"targets": [f"{pod.ip}:{pod.ports[ep['port']]}"], "labels": labels})
            jobs.append({
                "job_name": f"podMonitor/{namespace}/{pm['metadata']['name']}/{len(jobs)}",
                "metrics_path": ep.get("path", "/metrics"),
                "scrape_interval": interval or ep.get("interval", "30s"),
                "static_configs": targets,
                # the operator's job label is NAMESPACE/PODMONITOR
                "relabel_configs": [{"target_label": "job", "replacement": f"{namespace}/{pm['metadata']['name']}"}],
            })
    if not any(j["job_name"].startswith("podMonitor/") for j in jobs):
        raise SimulateError("no PodMonitor was rendered (spec.monitoring.podMonitor is false)")
    return json.dumps({"global": {"scrape_interval": interval or "15s"}, "scrape_configs": jobs}, indent=1)
