"""A small async Kubernetes client for the kinds the operator manages.

It rides on the official `kubernetes` package for configuration and authentication (in-cluster
service account, else kubeconfig: the same login kopf uses) and speaks plain JSON over the REST
paths, running the blocking calls in worker threads. Objects are plain dicts.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from k3serve.operator import crd


@dataclass(frozen=True)
class Resource:
    api_version: str
    kind: str
    plural: str
    namespaced: bool = True

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    def path(
        self, namespace: str | None = None, name: str | None = None, subresource: str | None = None
    ) -> str:
        base = f"/apis/{self.api_version}" if "/" in self.api_version else f"/api/{self.api_version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name:
            base += f"/{name}"
        if subresource:
            base += f"/{subresource}"
        return base


# Every kind the renderer may create (the prune and cleanup sets, and the operator's RBAC).
CHILD_RESOURCES: tuple[Resource, ...] = (
    Resource("v1", "ServiceAccount", "serviceaccounts"),
    Resource("rbac.authorization.k8s.io/v1", "Role", "roles"),
    Resource("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
    Resource("v1", "ConfigMap", "configmaps"),
    Resource("v1", "Service", "services"),
    Resource("apps/v1", "StatefulSet", "statefulsets"),
    Resource("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "leaderworkersets"),
    Resource("apps/v1", "Deployment", "deployments"),
    Resource("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
    Resource("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
    Resource("monitoring.coreos.com/v1", "PodMonitor", "podmonitors"),
)
BY_KIND: dict[str, Resource] = {r.kind: r for r in CHILD_RESOURCES}
DEPLOYMENTS = Resource(crd.API_VERSION, crd.KIND, crd.PLURAL)
OPTIONAL_KINDS = ("LeaderWorkerSet", "PodMonitor")  # CRDs that may be missing from a cluster


class KubeError(Exception):
    def __init__(self, status: int, reason: str, message: str):
        super().__init__(f"HTTP {status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


class KubeClient:
    """CRUD on plain-dict objects. Methods raise KubeError for any non-2xx answer except where noted."""

    def __init__(self, api_client=None):
        if api_client is None:
            api_client = self.load_config()
        self.api = api_client

    @staticmethod
    def load_config():
        import kubernetes

        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config()
        return kubernetes.client.ApiClient()

    def _call(self, method: str, path: str, body=None, content_type: str = "application/json") -> dict | None:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        method_, url, headers, body, _ = self.api.param_serialize(
            method=method, resource_path=path, header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        response = self.api.call_api(method_, url, header_params=headers, body=body, _request_timeout=30)
        data = response.read()
        text = data.decode() if data else ""
        payload = json.loads(text) if text.strip().startswith(("{", "[")) else {}
        if not 200 <= response.status < 300:
            raise KubeError(
                response.status,
                str(payload.get("reason") or response.reason),
                str(payload.get("message") or text[:500]),
            )
        return payload

    async def _acall(self, method: str, path: str, body=None, content_type: str = "application/json"):
        return await asyncio.to_thread(self._call, method, path, body, content_type)

    async def get(self, res: Resource, namespace: str, name: str) -> dict | None:
        """The object, or None when it does not exist."""
        try:
            return await self._acall("GET", res.path(namespace, name))
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, res: Resource, namespace: str) -> list[dict]:
        """Objects in the namespace ([] when the kind is not served)."""
        try:
            payload = await self._acall("GET", res.path(namespace))
        except KubeError as e:
            if e.status == 404:
                return []
            raise
        items = payload.get("items") or []
        for item in items:  # list items omit apiVersion/kind on real servers
            item.setdefault("apiVersion", res.api_version)
            item.setdefault("kind", res.kind)
        return items

    async def create(self, obj: dict) -> dict:
        res = BY_KIND[obj["kind"]] if obj["kind"] in BY_KIND else DEPLOYMENTS
        return await self._acall("POST", res.path(obj["metadata"].get("namespace")), obj)

    async def patch(
        self, res: Resource, namespace: str, name: str, patch: dict | list, subresource: str | None = None
    ) -> dict:
        content_type = (
            "application/json-patch+json" if isinstance(patch, list) else "application/merge-patch+json"
        )
        return await self._acall("PATCH", res.path(namespace, name, subresource), patch, content_type)

    async def delete(self, res: Resource, namespace: str, name: str) -> bool:
        """True when deleted, False when it was already gone. Dependents are deleted in the background."""
        try:
            await self._acall(
                "DELETE",
                res.path(namespace, name),
                {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
            )
            return True
        except KubeError as e:
            if e.status == 404:
                return False
            raise

    async def serves(self, res: Resource) -> bool:
        """Whether the API server serves this kind (discovery); used for optional CRDs."""
        try:
            payload = await self._acall(
                "GET", f"/apis/{res.api_version}" if res.group else f"/api/{res.api_version}"
            )
        except KubeError as e:
            if e.status in (404, 503):
                return False
            raise
        return any(r.get("name") == res.plural for r in payload.get("resources") or [])
