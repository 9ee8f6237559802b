"""Deployment-wide objects: the ConfigMap, the workers' ServiceAccount, PodDisruptionBudgets, the
NetworkPolicy, the PodMonitor and (optionally) the Grafana dashboards ConfigMap."""

from __future__ import annotations

import json

from k3serve.operator import names as n
from k3serve.operator.render_context import Context


def _meta(ctx: Context, name: str, component: str, extra_labels: dict | None = None) -> dict:
    return {
        "name": name,
        "namespace": ctx.namespace,
        "labels": {**n.labels(ctx.name, component), **(extra_labels or {})},
    }


def config_map(ctx: Context) -> dict:
    """One key per component (prefill.json, decode.json, router.json, kvstore.json); each pod mounts
    only its key and carries that key's hash, so a change rolls only the pods it concerns."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(ctx, ctx.config_map, "config"),
        "data": {
            key: json.dumps(doc, sort_keys=True, indent=2) + "\n" for key, doc in sorted(ctx.config.items())
        },
    }


def worker_service_account(ctx: Context) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(ctx, n.child(ctx.name, "worker"), "worker"),
        "automountServiceAccountToken": False,
    }


def disruption_budgets(ctx: Context) -> list[dict]:
    """At most one pod of each pool (so at most one group) and one router pod down by choice at a time."""
    out = []
    components = [p.pool for p in ctx.plan.pools() if p.replicas > 0] + ["router"]
    for component in components:
        out.append(
            {
                "apiVersion": "policy/v1",
                "kind": "PodDisruptionBudget",
                "metadata": _meta(ctx, n.child(ctx.name, component), component),
                "spec": {"maxUnavailable": 1, "selector": {"matchLabels": n.selector(ctx.name, component)}},
            }
        )
    return out


def network_policy(ctx: Context) -> dict:
    """Worker and store pods accept traffic on any port (gRPC, NIXL/UCX, Mooncake transfer ports) only
    from this deployment's own pods; the metrics port (/metrics, /health) stays open for Prometheus."""
    protected = [p.pool for p in ctx.plan.pools()] + (["kvstore"] if ctx.spec["kvStore"]["enabled"] else [])
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(ctx, n.child(ctx.name, "internal"), "network"),
        "spec": {
            "podSelector": {
                "matchLabels": {n.LABEL_DEPLOYMENT: ctx.name},
                "matchExpressions": [{"key": n.LABEL_ROLE, "operator": "In", "values": sorted(protected)}],
            },
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": {n.LABEL_DEPLOYMENT: ctx.name}}}]},
                {"ports": [{"port": n.METRICS_PORT, "protocol": "TCP"}]},
            ],
        },
    }


def pod_monitor(ctx: Context) -> dict:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _meta(ctx, ctx.name, "monitoring"),
        "spec": {
            "selector": {"matchLabels": {n.LABEL_DEPLOYMENT: ctx.name}},
            "namespaceSelector": {"matchNames": [ctx.namespace]},
            "podTargetLabels": [n.LABEL_DEPLOYMENT, n.LABEL_ROLE],
            "podMetricsEndpoints": [
                {"port": "metrics", "path": "/metrics", "interval": ctx.spec["monitoring"]["interval"]}
            ],
        },
    }


def dashboards_config_map(ctx: Context) -> dict:
    from k3serve.operator import dashboards

    data = {
        fname: json.dumps(board, sort_keys=True, indent=1) + "\n"
        for fname, board in dashboards.build_all(uid_suffix=f"{ctx.namespace}-{ctx.name}").items()
    }
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(ctx, n.child(ctx.name, "dashboards"), "monitoring", {"grafana_dashboard": "1"}),
        "data": data,
    }
