"""Kubernetes discovery: the deployment's worker pods, found by label selector (`--discovery kubernetes`).

    d = KubernetesDiscovery(registry, namespace="ns", prefill_selector="k3serve.io/role=prefill,...",
                            decode_selector="k3serve.io/role=decode,...")
    await d.start()      # first listing done; then re-lists every `interval` seconds
    await d.stop()

Only what the Role the operator renders allows (operator/render_services.py `router_rbac`: get, list, watch
pods in the namespace): pods are listed with the selector; a worker is the pod IP at the container port
named `grpc` (50051 when none is named so); only Running pods whose Ready condition is True take
requests. With a prefill selector the decode pods are `decode` workers, without one they are colocated
(`--role both`). Labels are also checked here, so an API server that ignores the selector cannot add
foreign pods. Credentials: the in-cluster service account, else the kubeconfig (`$KUBECONFIG`).
A listing that fails keeps the last known set (the health checks still eject dead workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

log = logging.getLogger("k3serve.router.kube")

GRPC_PORT_NAME = "grpc"
DEFAULT_GRPC_PORT = 50051


def parse_selector(s: str) -> dict[str, str]:
    out = {}
    for part in s.split(","):
        part = part.strip()
        if not part:
            continue
        k, sep, v = part.partition("=")
        if not sep or not k:
            raise ValueError(f"label selector: expected key=value[,key=value], got {s!r}")
        out[k.strip()] = v.strip().removeprefix("=")
    return out


def _ready(pod) -> bool:
    st = pod.status
    if st is None or st.phase != "Running" or not st.pod_ip or pod.metadata.deletion_timestamp:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in (st.conditions or []))


def _grpc_port(pod) -> int:
    for c in pod.spec.containers or []:
        for p in c.ports or []:
            if p.name == GRPC_PORT_NAME:
                return int(p.container_port)
    return DEFAULT_GRPC_PORT


def workers_from_pods(pods, selector: dict[str, str], role: str) -> dict[str, str]:
    out = {}
    for pod in pods:
        labels = pod.metadata.labels or {}
        if any(labels.get(k) != v for k, v in selector.items()) or not _ready(pod):
            continue
        ip = pod.status.pod_ip
        host = f"[{ip}]" if ":" in ip else ip
        out[f"{host}:{_grpc_port(pod)}"] = role
    return out


class KubernetesDiscovery:
    def __init__(self, registry, *, namespace: str, decode_selector: str, prefill_selector: str | None = None,
                 interval: float = 2.0, api=None):
        self.registry, self.namespace, self.interval = registry, namespace, interval
        self.selectors: list[tuple[str, str, dict]] = []
        if prefill_selector:
            self.selectors.append(("prefill", prefill_selector, parse_selector(prefill_selector)))
        self.selectors.append(("decode" if prefill_selector else "both", decode_selector,
                               parse_selector(decode_selector)))
        self._api = api
        self._task: asyncio.Task | None = None
        self.listings = 0
        self.last_error: str | None = None

    def _client(self):
        if self._api is None:
            from kubernetes import client, config

            if os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config()
            else:
                config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
            self._api = client.CoreV1Api()
        return self._api

    def list_once(self) -> dict[str, str]:
        api = self._client()
        wanted: dict[str, str] = {}
        for role, raw, sel in self.selectors:
            pods = api.list_namespaced_pod(self.namespace, label_selector=raw, _request_timeout=10).items
            for addr, r in workers_from_pods(pods, sel, role).items():
                wanted.setdefault(addr, r)
        return wanted

    async def refresh(self) -> None:
        try:
            wanted = await asyncio.to_thread(self.list_once)
        except Exception as e:  # noqa: BLE001 - keep the last known set
            self.last_error = f"{type(e).__name__}: {e}"
            log.warning("listing worker pods failed: %s", self.last_error)
            return
        self.listings += 1
        self.last_error = None
        await self.registry.set_workers(wanted)

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.ensure_future(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.refresh()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
