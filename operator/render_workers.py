"""Worker pools: `k3serve worker` pods as StatefulSets or LeaderWorkerSets.

* single-node groups: one StatefulSet NAME-POOL with `replicas` pods (one group each) and a headless
  Service of the same name;
* multi-node groups with the LeaderWorkerSet CRD: one LeaderWorkerSet NAME-POOL, size = nodes per group,
  a leader and a worker template (operator/render_lws.py);
* multi-node groups without it: one StatefulSet NAME-POOL-I per group I (pods = nodes per group), each
  with its headless Service (ranks find their leader as NAME-POOL-I-0.NAME-POOL-I).

Every pod learns its place from K3SERVE_NUM_NODES, K3SERVE_NODE_RANK and K3SERVE_LEADER_ADDR
(docs/components.md). The router sends requests to group leaders only (`leader_selector`).
"""

from __future__ import annotations

import posixpath

from k3serve.operator import names as n
from k3serve.operator import quantity, render_lws
from k3serve.operator.layout import PoolLayout
from k3serve.operator.render_context import Context
from k3serve.operator.render_pod import (
    config_volume,
    container_security_context,
    downward_env,
    health_probes,
    merge_env,
    pod_spec,
    writable_volumes,
)

GPU_RESOURCE = "nvidia.com/gpu"


def model_arg(spec: dict) -> str:
    model = spec["model"]
    if model.get("pvc"):
        return posixpath.normpath(posixpath.join(n.MODEL_DIR, model["pvc"].get("path", "/").lstrip("/")))
    return model["uri"]


def model_volume(spec: dict) -> tuple[dict, dict]:
    """The checkpoint PersistentVolumeClaim, read-only at MODEL_DIR (workers and routers)."""
    volume = {
        "name": "model",
        "persistentVolumeClaim": {"claimName": spec["model"]["pvc"]["claimName"], "readOnly": True},
    }
    return volume, {"name": "model", "mountPath": n.MODEL_DIR, "readOnly": True}


def cache_args(cache: dict) -> list[str]:
    """The worker's cache flags for a defaulted spec.cache."""
    args: list[str] = []
    if cache["prefixCaching"]:
        args.append("--enable-prefix-caching")
        if cache.get("prefixMatchUnit"):
            args += ["--prefix-match-unit", str(cache["prefixMatchUnit"])]
        args += ["--prefix-cache-retention-interval", str(cache["retentionInterval"])]
        if cache["selectiveRetention"]:
            args.append("--prefix-cache-selective-retention")
        args += ["--prefix-cache-eviction", cache["eviction"]]
    if cache.get("blockSize"):
        args += ["--block-size", str(cache["blockSize"])]
    memory = str(cache["kvCacheMemory"])
    args += ["--kv-cache-memory", memory if "." in memory else str(quantity.to_bytes(memory))]
    if cache.get("maxModelLen"):
        args += ["--max-model-len", str(cache["maxModelLen"])]
    if cache.get("offloadMemory"):
        args += ["--kv-offload-memory", str(quantity.to_bytes(cache["offloadMemory"]))]
    return args


def worker_args(ctx: Context, pool: PoolLayout) -> list[str]:
    args = [
        "worker",
        "--role",
        pool.role,
        "--model",
        model_arg(ctx.spec),
        "--host",
        "$(K3SERVE_POD_IP)",
        "--grpc-port",
        str(n.GRPC_PORT),
        "--metrics-port",
        str(n.METRICS_PORT),
        "--tensor-parallel-size",
        str(pool.tensor_parallel),
        "--data-parallel-size",
        str(pool.data_parallel),
    ]
    if pool.expert_parallel:
        args.append("--enable-expert-parallel")
    if pool.sequence_parallel:  # operator/layout.py: only with expert parallelism and TP > 1
        args.append("--enable-sequence-parallel")
    if ctx.kv_store_address:
        args += ["--kv-store", ctx.kv_store_address]
        if ctx.spec["kvStore"].get("deadlineMs"):
            args += ["--kv-store-deadline-ms", str(ctx.spec["kvStore"]["deadlineMs"])]
    devices = ctx.spec[pool.pool].get("transferDevices")
    if devices and pool.role in ("prefill", "decode"):  # P/D transfers only; colocated pods have none
        args += ["--kv-transfer-devices", devices]
    return args + cache_args(ctx.spec["cache"])


def uses_lws(ctx: Context, pool: PoolLayout) -> bool:
    return pool.multi_node and ctx.options.lws


def leader_selector(ctx: Context, pool: PoolLayout) -> dict[str, str]:
    """Labels of the pods that take requests: one per group."""
    sel = n.selector(ctx.name, pool.pool)
    if pool.multi_node:
        sel[n.LABEL_LWS_WORKER_INDEX if uses_lws(ctx, pool) else n.LABEL_STS_POD_INDEX] = "0"
    return sel


def _placement_env(ctx: Context, pool: PoolLayout, group_object: str | None) -> list[dict]:
    """K3SERVE_NUM_NODES / NODE_RANK / LEADER_ADDR for one pod template."""
    domain = ctx.options.cluster_domain
    env = [{"name": "K3SERVE_NUM_NODES", "value": str(pool.nodes_per_group)}]
    if not pool.multi_node:
        return env + [
            {"name": "K3SERVE_NODE_RANK", "value": "0"},
            {"name": "K3SERVE_LEADER_ADDR", "value": "$(K3SERVE_POD_IP)"},
        ]
    if uses_lws(ctx, pool):  # from the LWS controller's own variables (operator/render_lws.py)
        return render_lws.placement_env(pool.nodes_per_group)
    assert group_object is not None
    return env + [
        {
            "name": "K3SERVE_NODE_RANK",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{n.LABEL_STS_POD_INDEX}']"}},
        },
        {
            "name": "K3SERVE_LEADER_ADDR",
            "value": f"{group_object}-0.{group_object}.{ctx.namespace}.svc.{domain}",
        },
    ]


def _resources(pool_spec: dict, pool: PoolLayout) -> dict:
    res = {k: dict(v) for k, v in (pool_spec.get("resources") or {}).items() if v}
    if pool.gpus_per_pod:
        for part in ("requests", "limits"):
            res.setdefault(part, {})[GPU_RESOURCE] = pool.gpus_per_pod
    return res


def _pod_template(
    ctx: Context, pool: PoolLayout, group_labels: dict[str, str], group_object: str | None, config_hash: str
) -> dict:
    spec = ctx.spec
    pool_spec = spec[pool.pool]
    env = downward_env(ctx.name, pool.pool) + [
        {"name": "K3SERVE_CONFIG", "value": f"{n.CONFIG_DIR}/{pool.pool}.json"},
        {"name": "K3SERVE_SERVED_MODEL_NAME", "value": spec["model"]["name"]},
        {"name": "K3SERVE_MODEL_REVISION", "value": spec["model"]["revision"]},
        *_placement_env(ctx, pool, group_object),
        {"name": "UCX_MEM_EVENTS", "value": "no"},
    ]
    if ctx.kv_store_address:
        env += [
            {
                "name": "K3SERVE_KV_STORE_SEGMENT_BYTES",
                "value": str(quantity.to_bytes(spec["kvStore"]["memory"])),
            },
            {"name": "MC_TCP_BIND_ADDRESS", "value": "$(K3SERVE_POD_IP)"},
        ]
    volumes, mounts = writable_volumes(shm_size=str(pool_spec["shmSize"]))
    cfg_volume, cfg_mount = config_volume(ctx.config_map, f"{pool.pool}.json")
    volumes.append(cfg_volume)
    mounts.append(cfg_mount)
    if spec["model"].get("pvc"):
        volume, mount = model_volume(spec)
        volumes.append(volume)
        mounts.append(mount)
    container = {
        "name": "worker",
        "image": ctx.image,
        "imagePullPolicy": spec["imagePullPolicy"],
        "args": worker_args(ctx, pool),
        "ports": [
            {"name": "grpc", "containerPort": n.GRPC_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": n.METRICS_PORT, "protocol": "TCP"},
        ],
        "env": merge_env(env, pool_spec.get("env")),
        "resources": _resources(pool_spec, pool),
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
        **health_probes(startup_failures=360),
    }
    return {
        "metadata": {
            "labels": {**n.labels(ctx.name, pool.pool), **group_labels},
            "annotations": {n.ANN_CONFIG_HASH: config_hash},
        },
        "spec": pod_spec(
            service_account=n.child(ctx.name, "worker"),
            containers=[container],
            volumes=volumes,
            image_pull_secrets=spec.get("imagePullSecrets") or [],
            grace_seconds=120,
            automount_token=False,
            node_selector=pool_spec.get("nodeSelector"),
            tolerations=pool_spec.get("tolerations"),
        ),
    }


def _headless_service(ctx: Context, name: str, pool: PoolLayout, sel: dict[str, str]) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": ctx.namespace, "labels": n.labels(ctx.name, pool.pool)},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": sel,
            "ports": [
                {"name": "grpc", "port": n.GRPC_PORT, "targetPort": "grpc", "protocol": "TCP"},
                {"name": "metrics", "port": n.METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
            ],
        },
    }


def _statefulset(
    ctx: Context, name: str, pool: PoolLayout, replicas: int, sel: dict[str, str], template: dict
) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": ctx.namespace, "labels": n.labels(ctx.name, pool.pool)},
        "spec": {
            "serviceName": name,
            "replicas": replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": sel},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": template,
        },
    }


def worker_config(ctx: Context, pool: PoolLayout) -> dict:
    """The ConfigMap document of a pool (mounted at K3SERVE_CONFIG; informational for the worker)."""
    return {
        "deployment": ctx.name,
        "namespace": ctx.namespace,
        "pool": pool.pool,
        "role": pool.role,
        "model": ctx.spec["model"],
        "layout": {
            "replicas": pool.replicas,
            "tensorParallelSize": pool.tensor_parallel,
            "dataParallelSize": pool.data_parallel,
            "expertParallel": pool.expert_parallel,
            "sequenceParallel": pool.sequence_parallel,
            "ranksPerGroup": pool.world,
            "nodesPerGroup": pool.nodes_per_group,
            "gpusPerPod": pool.gpus_per_pod,
        },
        "cache": ctx.spec["cache"],
        "kvStore": (
            {
                "address": ctx.kv_store_address,
                "segmentBytes": quantity.to_bytes(ctx.spec["kvStore"]["memory"]),
            }
            if ctx.kv_store_address
            else None
        ),
        "args": worker_args(ctx, pool),
    }


def render_pool(ctx: Context, pool: PoolLayout) -> list[dict]:
    """Objects of one worker pool (none when it has no replicas and is single-node)."""
    chash = ctx.add_config(f"{pool.pool}.json", worker_config(ctx, pool))
    base = n.child(ctx.name, pool.pool)
    sel = n.selector(ctx.name, pool.pool)
    if not pool.multi_node:
        template = _pod_template(ctx, pool, {}, None, chash)
        return [
            _headless_service(ctx, base, pool, sel),
            _statefulset(ctx, base, pool, pool.replicas, sel, template),
        ]
    if uses_lws(ctx, pool):
        leader = _pod_template(ctx, pool, {}, None, chash)
        return [render_lws.leaderworkerset(ctx.namespace, base, n.labels(ctx.name, pool.pool), pool.replicas,
                                           pool.nodes_per_group, leader)]
    out: list[dict] = []
    for group in range(pool.replicas):
        name = n.child(base, group)
        group_sel = {**sel, n.LABEL_GROUP: str(group)}
        template = _pod_template(ctx, pool, {n.LABEL_GROUP: str(group)}, name, chash)
        out += [
            _headless_service(ctx, name, pool, group_sel),
            _statefulset(ctx, name, pool, pool.nodes_per_group, group_sel, template),
        ]
    return out
