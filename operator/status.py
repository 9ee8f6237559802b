"""The KimiK3Deployment status, computed from its children (pure functions).

A pool's `replicas` are groups (model instances). A group is ready when every pod of it is ready:
for a single-node pool, a ready StatefulSet pod; for StatefulSet-per-group pools, a StatefulSet whose
readyReplicas reach its replicas; for LeaderWorkerSets, the set's own readyReplicas (groups).
Conditions follow the Kubernetes convention: lastTransitionTime changes only when status does.
"""

from __future__ import annotations

import datetime

from k3serve.operator import names as n
from k3serve.operator.render import Rendered
from k3serve.operator.render_context import RenderOptions


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ready(obj: dict | None) -> int:
    return int(((obj or {}).get("status") or {}).get("readyReplicas") or 0)


def pool_ready_groups(
    children: dict[tuple[str, str], dict], rendered: Rendered, pool: str
) -> tuple[int, int]:
    """(desired groups, ready groups) of a worker pool."""
    objs = [
        o
        for o in rendered.objects
        if o["kind"] in ("StatefulSet", "LeaderWorkerSet")
        and o["metadata"]["labels"].get(n.LABEL_ROLE) == pool
    ]
    layout = next(p for p in rendered.plan.pools() if p.pool == pool)
    if not objs:
        return layout.replicas, 0
    if objs[0]["kind"] == "LeaderWorkerSet":
        return layout.replicas, min(
            layout.replicas, _ready(children.get(("LeaderWorkerSet", objs[0]["metadata"]["name"])))
        )
    if not layout.multi_node:
        return layout.replicas, min(
            layout.replicas, _ready(children.get(("StatefulSet", objs[0]["metadata"]["name"])))
        )
    ready = sum(
        1
        for o in objs
        if _ready(children.get(("StatefulSet", o["metadata"]["name"]))) >= layout.nodes_per_group
    )
    return layout.replicas, ready


def gateway_url(rendered: Rendered, name: str, namespace: str, children: dict, options: RenderOptions) -> str:
    router = rendered.spec["router"]
    service = children.get(("Service", n.child(name, "router"))) or {}
    port = router["port"]
    if router["serviceType"] == "LoadBalancer":
        for ingress in ((service.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []:
            host = ingress.get("hostname") or ingress.get("ip")
            if host:
                return f"http://{host}:{port}/v1"
    return f"http://{n.child(name, 'router')}.{namespace}.svc.{options.cluster_domain}:{port}/v1"


def condition(
    previous: list[dict], ctype: str, status: bool, reason: str, message: str, generation: int
) -> dict:
    value = "True" if status else "False"
    old = next((c for c in previous or [] if c.get("type") == ctype), None)
    changed = old is None or old.get("status") != value
    return {
        "type": ctype,
        "status": value,
        "reason": reason,
        "message": message,
        "lastTransitionTime": now() if changed else old.get("lastTransitionTime", now()),
        "observedGeneration": generation,
    }


def healthy_status(
    rendered: Rendered,
    name: str,
    namespace: str,
    children: dict[tuple[str, str], dict],
    previous: dict,
    generation: int,
    options: RenderOptions,
) -> dict:
    """Status after a successful apply; `children` maps (kind, name) to the live objects."""
    pools: dict[str, dict] = {}
    plan = rendered.plan
    for layout in plan.pools():
        desired, ready = pool_ready_groups(children, rendered, layout.pool)
        pools[layout.pool] = {"replicas": desired, "readyReplicas": ready}
    if plan.prefill is None:
        pools["prefill"] = {"replicas": 0, "readyReplicas": 0}
    pools["decode"]["selector"] = rendered.decode_selector
    router_replicas = rendered.spec["router"]["replicas"]
    pools["router"] = {
        "replicas": router_replicas,
        "readyReplicas": min(router_replicas, _ready(children.get(("Deployment", n.child(name, "router"))))),
    }
    if rendered.spec["kvStore"]["enabled"]:
        pools["kvStore"] = {
            "replicas": 1,
            "readyReplicas": min(1, _ready(children.get(("Deployment", n.child(name, "kvstore"))))),
        }
    else:
        pools["kvStore"] = {"replicas": 0, "readyReplicas": 0}
    counted = {k: v for k, v in pools.items() if v["replicas"] > 0}
    ready_pools = [k for k, v in counted.items() if v["readyReplicas"] >= v["replicas"]]
    waiting = [
        f"{k} {v['readyReplicas']}/{v['replicas']}" for k, v in counted.items() if k not in ready_pools
    ]
    all_ready = not waiting
    prev = previous.get("conditions") or []
    conditions = [
        condition(
            prev,
            "Ready",
            all_ready,
            "AllPoolsReady" if all_ready else "PoolsNotReady",
            "every pool is ready" if all_ready else "waiting for " + ", ".join(waiting),
            generation,
        ),
        condition(
            prev,
            "Progressing",
            not all_ready,
            "RolloutComplete" if all_ready else "RollingOut",
            "" if all_ready else "groups ready: " + ", ".join(waiting),
            generation,
        ),
        condition(prev, "Degraded", False, "AsExpected", "", generation),
    ]
    return {
        "observedGeneration": generation,
        "phase": "Ready" if all_ready else "Progressing",
        "conditions": conditions,
        **pools,
        "readyPools": f"{len(ready_pools)}/{len(counted)}",
        "gatewayURL": gateway_url(rendered, name, namespace, children, options),
        "configHash": rendered.config_hash,
    }


def degraded_status(previous: dict, generation: int, reason: str, message: str) -> dict:
    """Status when the spec cannot be served (nothing new is applied; existing children keep running)."""
    prev = previous.get("conditions") or []
    ready_before = any(c.get("type") == "Ready" and c.get("status") == "True" for c in prev)
    return {
        "observedGeneration": generation,
        "phase": "Degraded",
        "conditions": [
            condition(
                prev,
                "Ready",
                ready_before,
                reason if not ready_before else "PreviousSpecServing",
                message if not ready_before else "the previous configuration keeps serving",
                generation,
            ),
            condition(
                prev,
                "Progressing",
                False,
                reason,
                "nothing is rolled out until the spec is fixed",
                generation,
            ),
            condition(prev, "Degraded", True, reason, message, generation),
        ],
    }
