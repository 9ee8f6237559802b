"""One reconcile of a KimiK3Deployment: render, apply, prune, compute status (kopf-independent).

`reconcile()` returns the status merge patch and the Events to post; the kopf handlers apply them.
Layouts that cannot be served create nothing: the deployment turns Degraded with the reasons and
whatever ran before keeps running.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from k3serve.operator import apply as applier
from k3serve.operator import kube
from k3serve.operator import names as n
from k3serve.operator.apply import merge_patch
from k3serve.operator.render import render
from k3serve.operator.settings import OperatorSettings
from k3serve.operator.status import degraded_status, healthy_status


@dataclass
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Outcome:
    status_patch: dict
    events: list[Event] = field(default_factory=list)
    result: str = "ok"  # ok | invalid | error
    phase: str = "Pending"
    error: str = ""


class ClusterFeatures:
    """Which optional CRDs the cluster serves, re-checked every `ttl` seconds."""

    def __init__(self, client: kube.KubeClient, ttl: float):
        self.client, self.ttl = client, ttl
        self._checked = -1e18
        self.lws = False
        self.podmonitor = False

    async def refresh(self) -> None:
        if time.monotonic() - self._checked < self.ttl:
            return
        self.lws = await self.client.serves(kube.BY_KIND["LeaderWorkerSet"])
        self.podmonitor = await self.client.serves(kube.BY_KIND["PodMonitor"])
        self._checked = time.monotonic()

    def resources(self) -> list[kube.Resource]:
        served = {"LeaderWorkerSet": self.lws, "PodMonitor": self.podmonitor}
        return [r for r in kube.CHILD_RESOURCES if served.get(r.kind, True)]


STATUS_KINDS = ("StatefulSet", "LeaderWorkerSet", "Deployment")


class Reconciler:
    """Full reconciles (render, apply, prune, status) for the change handlers and every
    `resync_interval`; status-only refreshes (read the workloads) for the periodic timer in between."""

    def __init__(self, client: kube.KubeClient, settings: OperatorSettings):
        self.client, self.settings = client, settings
        self.features = ClusterFeatures(client, settings.discovery_ttl)
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._last_full: dict[tuple[str, str], float] = {}

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self._locks.setdefault((namespace, name), asyncio.Lock())

    async def reconcile(self, body: dict) -> Outcome:
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        async with self.lock(namespace, name):
            return await self._reconcile(body, namespace, name)

    async def tick(self, body: dict) -> Outcome:
        """The periodic timer: a full reconcile when one is due (or a workload is missing, or the last
        apply failed), else a status refresh from the workloads."""
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        async with self.lock(namespace, name):
            due = (
                time.monotonic() - self._last_full.get((namespace, name), -1e18)
                >= self.settings.resync_interval
            )
            failed = any(
                c.get("reason") == "ApplyFailed" for c in (body.get("status") or {}).get("conditions") or []
            )
            if due or failed:
                return await self._reconcile(body, namespace, name)
            return await self._refresh(body, namespace, name)

    async def _render(self, body: dict):
        await self.features.refresh()
        options = self.settings.render_options(lws=self.features.lws, podmonitor=self.features.podmonitor)
        return render(body, options), options

    @staticmethod
    def _unservable(rendered, previous: dict, generation: int) -> Outcome:
        reason = "InvalidSpec" if rendered.spec is None else "InvalidLayout"
        message = "; ".join(rendered.problems)
        status = degraded_status(previous, generation, reason, message)
        old = next((c for c in previous.get("conditions") or [] if c.get("type") == "Degraded"), {})
        events = [] if old.get("message") == message else [Event("Warning", reason, message)]
        return Outcome(merge_patch(previous, status, None), events, "invalid", "Degraded")

    async def _refresh(self, body: dict, namespace: str, name: str) -> Outcome:
        previous = body.get("status") or {}
        generation = int(body["metadata"].get("generation") or 0)
        rendered, options = await self._render(body)
        if rendered.problems:
            return self._unservable(rendered, previous, generation)
        live: dict[tuple[str, str], dict] = {}
        for obj in rendered.objects:
            key = (obj["kind"], obj["metadata"]["name"])
            if obj["kind"] in STATUS_KINDS or key == ("Service", n.child(name, "router")):
                got = await self.client.get(kube.BY_KIND[obj["kind"]], namespace, key[1])
                if got is None:  # drift: repair now
                    return await self._reconcile(body, namespace, name)
                live[key] = got
        status = healthy_status(rendered, name, namespace, live, previous, generation, options)
        return Outcome(merge_patch(previous, status, None), [], "ok", status["phase"])

    async def _reconcile(self, body: dict, namespace: str, name: str) -> Outcome:
        meta = body["metadata"]
        previous = body.get("status") or {}
        generation = int(meta.get("generation") or 0)
        self._last_full[(namespace, name)] = time.monotonic()
        rendered, options = await self._render(body)
        if rendered.problems:
            return self._unservable(rendered, previous, generation)

        events = [
            Event("Warning", "PodMonitorUnavailable", note)
            for note in rendered.notes
            if previous.get("observedGeneration") != generation
        ]
        report = applier.ApplyReport()
        live: dict[tuple[str, str], dict] = {}
        try:
            for obj in rendered.objects:
                live[(obj["kind"], obj["metadata"]["name"])] = await applier.apply_one(
                    self.client, obj, report
                )
            keep = {(o["kind"], o["metadata"]["name"]) for o in rendered.objects}
            await applier.prune(
                self.client, self.features.resources(), namespace, name, meta["uid"], keep, report
            )
        except kube.KubeError as e:
            message = f"applying {report.summary()} then failed: {e}"
            status = degraded_status(previous, generation, "ApplyFailed", message)
            return Outcome(
                merge_patch(previous, status, None),
                [Event("Warning", "ApplyFailed", message)],
                "error",
                "Degraded",
                error=message,
            )

        if report.created or report.patched:
            events.append(Event("Normal", "Applied", report.summary()))
        if report.deleted:
            events.append(Event("Normal", "Pruned", "deleted " + ", ".join(report.deleted)))
        status = healthy_status(rendered, name, namespace, live, previous, generation, options)
        return Outcome(merge_patch(previous, status, None), events, "ok", status["phase"])

    async def cleanup(self, body: dict) -> list[str]:
        """On deletion: delete objects labelled for this deployment that it does not own (owned ones are
        garbage-collected by Kubernetes through their ownerReferences). Returns what was deleted."""
        meta = body["metadata"]
        namespace, name, uid = meta["namespace"], meta["name"], meta.get("uid", "")
        await self.features.refresh()
        deleted = []
        async with self.lock(namespace, name):
            for obj in await applier.list_children(self.client, self.features.resources(), namespace, name):
                if not applier.owned_by(obj, uid):
                    if await self.client.delete(
                        kube.BY_KIND[obj["kind"]], namespace, obj["metadata"]["name"]
                    ):
                        deleted.append(applier.ref(obj))
        self._locks.pop((namespace, name), None)
        self._last_full.pop((namespace, name), None)
        return deleted
