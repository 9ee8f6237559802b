"""Names, labels, annotations and ports shared by the renderer, the handlers and the tests.

Every object the operator creates for a KimiK3Deployment NAME lives in NAME's namespace, is named
NAME-<suffix>, and carries `k3serve.io/deployment: NAME` and `app.kubernetes.io/managed-by:
k3serve-operator`. Ports are the component contract of docs/components.md.
"""

from __future__ import annotations

PART_OF = "k3serve"
MANAGED_BY = "k3serve-operator"

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_DEPLOYMENT = "k3serve.io/deployment"
LABEL_ROLE = "k3serve.io/role"
LABEL_GROUP = "k3serve.io/group"
# Set by Kubernetes itself (1.28+) on StatefulSet pods, and by LeaderWorkerSet on its pods.
LABEL_STS_POD_INDEX = "apps.kubernetes.io/pod-index"
LABEL_LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"

ANN_CONFIG_HASH = "k3serve.io/config-hash"
ANN_APPLIED_HASH = "k3serve.io/applied-hash"
ANN_LAST_APPLIED = "k3serve.io/last-applied"

GRPC_PORT = 50051
METRICS_PORT = 9100
ROUTER_PORT = 8000
STORE_RPC_PORT = 50051

RUN_AS_USER = 1000
CACHE_DIR = "/var/cache/k3serve"
CONFIG_DIR = "/etc/k3serve/config"
API_KEY_DIR = "/etc/k3serve/api-key"
MODEL_DIR = "/models"


def child(name: str, *parts: str | int) -> str:
    return "-".join([name, *(str(p) for p in parts)])


def selector(name: str, component: str) -> dict[str, str]:
    """Labels that select one component's pods; stable for the object's lifetime (selectors are immutable)."""
    return {LABEL_DEPLOYMENT: name, LABEL_ROLE: component}


def labels(name: str, component: str, version: str | None = None) -> dict[str, str]:
    out = {
        LABEL_NAME: "k3serve",
        LABEL_INSTANCE: name,
        LABEL_COMPONENT: component,
        LABEL_PART_OF: PART_OF,
        LABEL_MANAGED_BY: MANAGED_BY,
        **selector(name, component),
    }
    if version:
        out["app.kubernetes.io/version"] = version
    return out


def selector_string(sel: dict[str, str]) -> str:
    """`a=b,c=d` form of a label selector (sorted, as kubectl -l takes it)."""
    return ",".join(f"{k}={v}" for k, v in sorted(sel.items()))
