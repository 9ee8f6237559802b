"""The pure renderer: a KimiK3Deployment (dict) -> the Kubernetes objects that serve it.

`render(cr, options)` never talks to a cluster. It validates the CR against the CRD schema, applies
the schema defaults, checks the layout rules, and returns either the objects (in apply order, each
with the owner reference when the CR has a uid) or the problems (and no objects).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3serve.operator import crd, layout, validation
from k3serve.operator import names as n
from k3serve.operator.render_common import (
    config_map,
    dashboards_config_map,
    disruption_budgets,
    network_policy,
    pod_monitor,
    worker_service_account,
)
from k3serve.operator.render_context import Context, RenderOptions, canonical_json, config_hash
from k3serve.operator.render_services import render_kvstore, render_router
from k3serve.operator.render_workers import leader_selector, render_pool
from k3serve.operator.schema_defaults import apply_defaults

KIND_ORDER = [
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "ConfigMap",
    "Service",
    "StatefulSet",
    "LeaderWorkerSet",
    "Deployment",
    "PodDisruptionBudget",
    "NetworkPolicy",
    "PodMonitor",
]


@dataclass
class Rendered:
    objects: list[dict]
    problems: list[str]
    notes: list[str] = field(default_factory=list)  # things users should know, e.g. a missing CRD
    spec: dict | None = None  # the defaulted spec (None when the schema rejected the CR)
    plan: layout.Plan | None = None
    config_hash: str = ""
    decode_selector: str = ""


def default_spec(spec: dict) -> dict:
    return apply_defaults(crd.spec_schema(), spec or {})


def owner_reference(cr: dict) -> dict:
    meta = cr["metadata"]
    return {
        "apiVersion": crd.API_VERSION,
        "kind": crd.KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def render(cr: dict, options: RenderOptions | None = None) -> Rendered:
    options = options or RenderOptions()
    meta = cr.get("metadata") or {}
    name = meta.get("name") or ""
    namespace = meta.get("namespace") or "default"
    schema_errors = validation.errors(cr)
    if schema_errors:
        return Rendered(objects=[], problems=[f"invalid spec: {e}" for e in schema_errors])
    spec = default_spec(cr["spec"])
    problems = layout.problems(name, spec)
    if problems:
        return Rendered(objects=[], problems=problems, spec=spec)

    plan = layout.plan(spec)
    ctx = Context(name=name, namespace=namespace, spec=spec, plan=plan, options=options)
    notes: list[str] = []
    objects: list[dict] = [worker_service_account(ctx)]
    for pool in plan.pools():
        objects += render_pool(ctx, pool)
    objects += render_router(ctx)
    objects += render_kvstore(ctx)
    objects.append(config_map(ctx))
    objects += disruption_budgets(ctx)
    objects.append(network_policy(ctx))
    if spec["monitoring"]["podMonitor"]:
        if options.podmonitor:
            objects.append(pod_monitor(ctx))
        else:
            notes.append(
                "monitoring.podMonitor is set but the PodMonitor CRD (monitoring.coreos.com/v1) is not "
                "installed; no PodMonitor was created"
            )
    if spec["monitoring"]["dashboards"]:
        objects.append(dashboards_config_map(ctx))

    if meta.get("uid"):
        ref = owner_reference(cr)
        for obj in objects:
            obj["metadata"]["ownerReferences"] = [dict(ref)]
    objects.sort(key=lambda o: (KIND_ORDER.index(o["kind"]), o["metadata"]["name"]))
    return Rendered(
        objects=objects,
        problems=[],
        notes=notes,
        spec=spec,
        plan=plan,
        config_hash=config_hash(canonical_json(ctx.config)),
        decode_selector=n.selector_string(leader_selector(ctx, plan.decode)),
    )
