"""A Kubernetes API emulator for operator tests: kmock's KubernetesEmulator plus what kopf needs.

Plain kmock 0.8 never sets metadata.resourceVersion / uid / creationTimestamp / generation and
ignores generateName; kopf's finalizer JSON patch tests resourceVersion and its Events use
generateName. `K3Emulator` fills those in, answers a failed JSON-patch `test` with HTTP 422 as a real
API server does, and bounds kmock's request history (matching cost grows with it).
`EmulatorThread` runs it on 127.0.0.1 in a background event loop so synchronous tests and a
`k3serve operator run` subprocess can both talk to it.

Still not emulated (see shared design notes): garbage collection of owned objects, label selectors,
admission/validation/defaulting, controllers (no Pods, no status on children), strategic merge.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import threading
import uuid
from collections.abc import Iterable

import aiohttp.web
import kmock
import yaml

from k3serve.operator import crd


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class K3Emulator(kmock.KubernetesEmulator):
    """kmock's emulator that stamps resourceVersion, uid, creationTimestamp and generation, fills
    generateName, and defaults metadata.namespace from the URL."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._versions = itertools.count(1)

    # kmock matches each request against every reaction by scanning its whole request history, so the
    # cost of a request grows with the number served; long operator tests keep only recent history.
    HISTORY = 32

    async def _handle(self, request):  # type: ignore[override]
        if len(self._requests) > 2 * self.HISTORY:
            del self._requests[: -self.HISTORY]
        if (
            request.resource is not None
            and request.action == kmock.action.DELETE
            and request.name is not None
        ):
            response = await self._soft_delete(request)
            if response is not None:
                return response
        if request.resource is not None and request.data is not None:
            if request.action == kmock.action.CREATE and isinstance(request.data, dict):
                self._stamp_create(request)
            elif request.action == kmock.action.UPDATE and request.name is not None:
                self._stamp_update(request)
        return await super()._handle(request)

    async def _soft_delete(self, request):
        """DELETE of an object with finalizers: set deletionTimestamp with a new resourceVersion (plain
        kmock keeps the old one, so a kopf JSON patch racing another change could never be retried)."""
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            obj = self._objects[key] if key in self._objects else None
            if obj is None or obj.deleted:
                return None
            meta = obj.get("metadata", {})
            if not meta.get("finalizers") or meta.get("deletionTimestamp"):
                return None
            obj.patch(
                {"metadata": {"deletionTimestamp": _now(), "resourceVersion": str(next(self._versions))}}
            )
            raw = copy.deepcopy(dict(obj.raw))
            await self._buses[request.resource].put({"type": "MODIFIED", "object": raw})
        return aiohttp.web.json_response(raw)

    def _stamp_create(self, request) -> None:
        meta = request.data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if request.namespace and not meta.get("namespace"):
            meta["namespace"] = request.namespace
        meta.update(
            uid=str(uuid.uuid4()),
            resourceVersion=str(next(self._versions)),
            creationTimestamp=_now(),
            generation=1,
        )

    def _stamp_update(self, request) -> None:
        key = (request.resource, request.namespace, request.name)
        current = self._objects[key] if key in self._objects else None
        if current is None or current.deleted:
            return  # the emulator answers 404 itself
        version = str(next(self._versions))
        generation = int(current.get("metadata", {}).get("generation") or 1)
        if isinstance(request.data, dict):
            touches_spec = "spec" in request.data and request.subresource is None
            request.data.setdefault("metadata", {})["resourceVersion"] = version
            if touches_spec:
                request.data["metadata"]["generation"] = generation + 1
        elif isinstance(request.data, list):
            self._check_json_patch_tests(current, request.data)
            touches_spec = request.subresource is None and any(
                str(op.get("path", "")).startswith("/spec") for op in request.data if isinstance(op, dict)
            )
            request.data.append({"op": "add", "path": "/metadata/resourceVersion", "value": version})
            if touches_spec:
                request.data.append({"op": "add", "path": "/metadata/generation", "value": generation + 1})

    @staticmethod
    def _check_json_patch_tests(current, ops: list) -> None:
        """A failed JSON-patch `test` is HTTP 422 on a real API server (kopf relies on it), not 500."""
        import jsonpatch

        tests = [op for op in ops if isinstance(op, dict) and op.get("op") == "test"]
        if not tests:
            return
        try:
            jsonpatch.apply_patch(copy.deepcopy(dict(current.raw)), tests)
        except (jsonpatch.JsonPatchTestFailed, jsonpatch.JsonPointerException) as e:
            raise kmock.KubernetesError(
                status=422, reason="Invalid", message=f"the JSON patch test failed: {e}"
            ) from e


def declare_resources(
    emulator: kmock.KubernetesEmulator, *, lws: bool = False, podmonitor: bool = False
) -> None:
    """Built-in kinds, the KimiK3Deployment CRD, and optionally the LeaderWorkerSet/PodMonitor CRDs."""
    emulator.resources.load_bundled()
    emulator.resources[f"{crd.GROUP}/{crd.VERSION}/{crd.PLURAL}"] = kmock.ResourceInfo(
        kind=crd.KIND,
        singular=crd.SINGULAR,
        namespaced=True,
        shortnames=crd.SHORT_NAMES,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
        subresources={"status", "scale"},
    )
    if lws:
        emulator.resources["leaderworkerset.x-k8s.io/v1/leaderworkersets"] = kmock.ResourceInfo(
            kind="LeaderWorkerSet",
            singular="leaderworkerset",
            namespaced=True,
            verbs={"get", "list", "watch", "create", "patch", "delete"},
            subresources={"status", "scale"},
        )
    if podmonitor:
        emulator.resources["monitoring.coreos.com/v1/podmonitors"] = kmock.ResourceInfo(
            kind="PodMonitor",
            singular="podmonitor",
            namespaced=True,
            verbs={"get", "list", "watch", "create", "patch", "delete"},
        )


class EmulatorThread:
    """Runs a K3Emulator on 127.0.0.1 (random port) in a daemon thread with its own event loop.

    with EmulatorThread(lws=False, podmonitor=True) as emu:
        emu.url, emu.kubeconfig(path), emu.objects("apps/v1/statefulsets", namespace="ns")
    """

    def __init__(self, *, lws: bool = False, podmonitor: bool = False):
        self.lws, self.podmonitor = lws, podmonitor
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="k8s-emulator", daemon=True)
        self.emulator: K3Emulator | None = None
        self.server: kmock.Server | None = None

    def __enter__(self) -> EmulatorThread:
        self.thread.start()
        self._call(self._start(), timeout=30)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._call(self._stop(), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            self.loop.close()

    async def _start(self) -> None:
        self.emulator = K3Emulator()
        declare_resources(self.emulator, lws=self.lws, podmonitor=self.podmonitor)
        await self.emulator.__aenter__()
        self.server = kmock.Server(self.emulator, host="127.0.0.1")
        await self.server.__aenter__()

    async def _stop(self) -> None:
        await self.server.__aexit__(None, None, None)
        await self.emulator.__aexit__(None, None, None)

    def _call(self, coro, timeout: float = 10):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def url(self) -> str:
        return str(self.server.url).rstrip("/")

    def kubeconfig(self, path: str, namespace: str = "default") -> str:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "emulator", "user": {"token": "emulator-token"}}],
            "contexts": [
                {
                    "name": "emulator",
                    "context": {"cluster": "emulator", "user": "emulator", "namespace": namespace},
                }
            ],
        }
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump(config, f)
        return path

    def objects(self, resource: str, namespace: str | None = None) -> list[dict]:
        """Deep copies of the live (not deleted) objects of `resource` ('group/version/plural' or
        'v1/plural'), optionally in one namespace."""
        return [obj for _, obj in self._select([resource], namespace)]

    def get(self, resource: str, namespace: str, name: str) -> dict | None:
        found = [o for o in self.objects(resource, namespace) if o["metadata"]["name"] == name]
        return found[0] if found else None

    def resources_of(self, namespace: str, resources: Iterable[str]) -> dict[tuple[str, str], dict]:
        """{(kind, name): object} over several resources in one namespace."""
        return {
            (obj.get("kind") or res, obj["metadata"]["name"]): obj
            for res, obj in self._select(resources, namespace)
        }

    def purge(self, namespace: str) -> int:
        """Forget every object of a namespace at once (what deleting the namespace and garbage
        collection would do); emits no watch events. Returns how many objects were dropped."""

        async def drop() -> int:
            keys = [key for key in list(self.emulator.objects.keys()) if key[1] == namespace]
            for key in keys:
                del self.emulator.objects[key]
            return len(keys)

        return self._call(drop())

    def _select(self, resources: Iterable[str], namespace: str | None) -> list[tuple[str, dict]]:
        targets = {kmock.resource(r): r for r in resources}

        async def snapshot() -> list[tuple[str, dict]]:
            out = []
            for (res, ns, _name), obj in list(self.emulator.objects.items()):
                if res in targets and not obj.deleted and (namespace is None or ns == namespace):
                    out.append((targets[res], copy.deepcopy(dict(obj.raw))))
            return out

        return self._call(snapshot())
