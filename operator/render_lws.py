"""Multi-node worker groups as one LeaderWorkerSet (leaderworkerset.x-k8s.io/v1), and what its controller
makes of it.

When: the cluster serves the LeaderWorkerSet CRD (operator/reconcile.py asks the API's discovery;
`k3serve operator render --lws` / `simulate --lws` say so by hand); otherwise a multi-node pool is one
StatefulSet per group (operator/render_workers.py). A single-node pool is a StatefulSet either way.

The object: `replicas` = groups, `leaderWorkerTemplate.size` = nodes per group, a leader template (node 0:
the engine, the group's gRPC endpoint and rendezvous) and a worker template (nodes 1..size-1: ranks only,
no gRPC port), `restartPolicy: RecreateGroupOnPodRestart` (a lost node breaks its group: all its pods
start again together), `startupPolicy: LeaderCreated`, `networkConfig.subdomainPolicy: Shared` (one
headless Service named like the set, created by the controller).

The pod contract from LWS's own variables: the controller puts LWS_LEADER_ADDRESS
(`NAME-G.NAME.NAMESPACE`, the group's leader pod), LWS_GROUP_SIZE and LWS_WORKER_INDEX at the front of
every container's env (lws pkg/utils/pod/pod_utils.go AddLWSVariables), so the templates' later
`$(LWS_...)` references expand: K3SERVE_NODE_RANK = $(LWS_WORKER_INDEX), K3SERVE_LEADER_ADDR =
$(LWS_LEADER_ADDRESS) (docs/components.md). `controller_pods` is that controller's part (pod names,
labels, annotations, injected env) as plain data, for `k3serve operator simulate` and the tests.
"""

from __future__ import annotations

import copy

from k3serve.operator import names as n

API_VERSION = "leaderworkerset.x-k8s.io/v1"
KIND = "LeaderWorkerSet"
# set by the LWS controller on every pod of a set (lws api/leaderworkerset/v1/leaderworkerset_types.go)
LABEL_SET_NAME = "leaderworkerset.sigs.k8s.io/name"
LABEL_GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
LABEL_WORKER_INDEX = n.LABEL_LWS_WORKER_INDEX
ANN_SIZE = "leaderworkerset.sigs.k8s.io/size"
ANN_LEADER_NAME = "leaderworkerset.sigs.k8s.io/leader-name"
ENV_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
ENV_GROUP_SIZE = "LWS_GROUP_SIZE"
ENV_WORKER_INDEX = "LWS_WORKER_INDEX"


def placement_env(nodes_per_group: int) -> list[dict]:
    """K3SERVE_NUM_NODES / NODE_RANK / LEADER_ADDR of a LeaderWorkerSet pod, from the controller's env."""
    return [
        {"name": "K3SERVE_NUM_NODES", "value": str(nodes_per_group)},
        {"name": "K3SERVE_NODE_RANK", "value": f"$({ENV_WORKER_INDEX})"},
        {"name": "K3SERVE_LEADER_ADDR", "value": f"$({ENV_LEADER_ADDRESS})"},
    ]


def worker_template(leader: dict) -> dict:
    """The non-leader nodes' pod template: the leader's without the gRPC port (they run ranks only and
    serve /health on the metrics port, workers/engine/parallel/node_process.py)."""
    worker = copy.deepcopy(leader)
    for c in worker["spec"]["containers"]:
        c["ports"] = [p for p in c.get("ports") or [] if p.get("name") != "grpc"]
    return worker


def leaderworkerset(namespace: str, name: str, labels: dict[str, str], replicas: int, size: int,
                    leader: dict) -> dict:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": size,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker_template(leader),
            },
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0},
            },
            "networkConfig": {"subdomainPolicy": "Shared"},
        },
    }


def leader_address(name: str, group: int, namespace: str) -> str:
    """LWS_LEADER_ADDRESS of group `group` (subdomainPolicy Shared: the Service is named like the set)."""
    return f"{name}-{group}.{name}.{namespace}"


def controller_pods(lws: dict) -> list[dict]:
    """The pods the LWS controller and its pod webhook create for `lws`, group by group, leader first:
    {"name", "group", "index", "labels", "annotations", "template"} with the LWS_* variables at the front
    of every container's env, as the webhook puts them."""
    name, namespace = lws["metadata"]["name"], lws["metadata"].get("namespace", "default")
    spec = lws["spec"]
    lwt = spec["leaderWorkerTemplate"]
    size = int(lwt.get("size", 1))
    pods = []
    for group in range(int(spec.get("replicas", 1))):
        for index in range(size):
            part = "leaderTemplate" if index == 0 and "leaderTemplate" in lwt else "workerTemplate"
            template = copy.deepcopy(lwt[part])
            labels = {**(template["metadata"].get("labels") or {}), LABEL_SET_NAME: name,
                      LABEL_GROUP_INDEX: str(group), LABEL_WORKER_INDEX: str(index)}
            annotations = {**(template["metadata"].get("annotations") or {}), ANN_SIZE: str(size)}
            if index:
                annotations[ANN_LEADER_NAME] = f"{name}-{group}"
            injected = [
                {"name": ENV_LEADER_ADDRESS, "value": leader_address(name, group, namespace)},
                {"name": ENV_GROUP_SIZE, "value": str(size)},
                {"name": ENV_WORKER_INDEX, "value": str(index)},
            ]
            for c in template["spec"]["containers"] + template["spec"].get("initContainers", []):
                own = [e for e in c.get("env") or [] if e["name"] not in {v["name"] for v in injected}]
                c["env"] = injected + own
            template["metadata"] = {**template["metadata"], "labels": labels, "annotations": annotations}
            pods.append({"name": f"{name}-{group}" if index == 0 else f"{name}-{group}-{index}", "group": group,
                         "index": index, "labels": labels, "annotations": annotations, "template": template})
    return pods


def controller_service(lws: dict) -> dict:
    """The headless Service the LWS controller creates for a set (subdomainPolicy Shared): named like
    the set, selecting its pods, publishing not-ready addresses (lws pkg/utils/controller)."""
    name = lws["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": lws["metadata"].get("namespace", "default"),
                     "labels": {LABEL_SET_NAME: name}},
        "spec": {"clusterIP": "None", "selector": {LABEL_SET_NAME: name}, "publishNotReadyAddresses": True},
    }
