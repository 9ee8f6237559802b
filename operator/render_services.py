"""The router (gateway) and the Mooncake master: Deployments, Services and the router's RBAC."""

from __future__ import annotations

from k3serve.operator import names as n
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
from k3serve.operator.render_workers import leader_selector, model_arg, model_volume


def _meta(ctx: Context, name: str, component: str) -> dict:
    return {"name": name, "namespace": ctx.namespace, "labels": n.labels(ctx.name, component)}


def router_args(ctx: Context) -> list[str]:
    plan = ctx.plan
    args = [
        "router",
        "--host",
        "$(K3SERVE_POD_IP)",
        "--port",
        str(n.ROUTER_PORT),
        "--metrics-port",
        str(n.METRICS_PORT),
        "--discovery",
        "kubernetes",
    ]
    if plan.prefill is not None:
        args += ["--prefill-selector", n.selector_string(leader_selector(ctx, plan.prefill))]
    args += [
        "--decode-selector",
        n.selector_string(leader_selector(ctx, plan.decode)),
        "--policy",
        ctx.spec["router"]["policy"],
    ]
    ref = ctx.spec["router"].get("apiKeySecretRef")
    if ref:
        args += ["--api-key-file", f"{n.API_KEY_DIR}/{ref.get('key', 'api-key')}"]
    # the tokenizer, config and weight fingerprint: the router hashes prompts exactly as the workers do
    args += ["--model", model_arg(ctx.spec)]
    return args


def render_router(ctx: Context) -> list[dict]:
    spec, router = ctx.spec, ctx.spec["router"]
    name = n.child(ctx.name, "router")
    chash = ctx.add_config(
        "router.json",
        {
            "deployment": ctx.name,
            "namespace": ctx.namespace,
            "policy": router["policy"],
            "servedModelName": spec["model"]["name"],
            "args": router_args(ctx),
        },
    )
    volumes, mounts = writable_volumes()
    cfg_volume, cfg_mount = config_volume(ctx.config_map, "router.json")
    volumes.append(cfg_volume)
    mounts.append(cfg_mount)
    if spec["model"].get("pvc"):
        volume, mount = model_volume(spec)
        volumes.append(volume)
        mounts.append(mount)
    ref = router.get("apiKeySecretRef")
    if ref:
        key = ref.get("key", "api-key")
        volumes.append(
            {
                "name": "api-key",
                "secret": {
                    "secretName": ref["name"],
                    "defaultMode": 0o440,
                    "items": [{"key": key, "path": key}],
                },
            }
        )
        mounts.append({"name": "api-key", "mountPath": n.API_KEY_DIR, "readOnly": True})
    env = downward_env(ctx.name, "router") + [
        {"name": "K3SERVE_CONFIG", "value": f"{n.CONFIG_DIR}/router.json"},
        {"name": "K3SERVE_SERVED_MODEL_NAME", "value": spec["model"]["name"]},
    ]
    container = {
        "name": "router",
        "image": ctx.image,
        "imagePullPolicy": spec["imagePullPolicy"],
        "args": router_args(ctx),
        "ports": [
            {"name": "http", "containerPort": n.ROUTER_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": n.METRICS_PORT, "protocol": "TCP"},
        ],
        "env": merge_env(env, router.get("env")),
        "resources": {k: dict(v) for k, v in (router.get("resources") or {}).items() if v},
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
        **health_probes(startup_failures=30),
    }
    sel = n.selector(ctx.name, "router")
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(ctx, name, "router"),
        "spec": {
            "replicas": router["replicas"],
            "selector": {"matchLabels": sel},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {
                    "labels": n.labels(ctx.name, "router"),
                    "annotations": {n.ANN_CONFIG_HASH: chash},
                },
                "spec": pod_spec(
                    service_account=name,
                    containers=[container],
                    volumes=volumes,
                    image_pull_secrets=spec.get("imagePullSecrets") or [],
                    grace_seconds=30,
                    automount_token=True,
                ),
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(ctx, name, "router"),
        "spec": {
            "type": router["serviceType"],
            "selector": sel,
            "ports": [{"name": "http", "port": router["port"], "targetPort": "http", "protocol": "TCP"}],
        },
    }
    return [*router_rbac(ctx, name), deployment, service]


def router_rbac(ctx: Context, name: str) -> list[dict]:
    """The router discovers workers by label selector: it may read pods in its namespace, nothing else."""
    meta = _meta(ctx, name, "router")
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": meta,
            "automountServiceAccountToken": True,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ctx.namespace}],
        },
    ]


def kvstore_args() -> list[str]:
    """The master's flags from their one definition (k3serve/kvstore/master.py), on the pod IP."""
    from k3serve.kvstore.master import master_args

    return master_args("$(K3SERVE_POD_IP)", n.STORE_RPC_PORT, "$(K3SERVE_POD_IP)", n.METRICS_PORT)


def render_kvstore(ctx: Context) -> list[dict]:
    if not ctx.spec["kvStore"]["enabled"]:
        return []
    name = n.child(ctx.name, "kvstore")
    chash = ctx.add_config(
        "kvstore.json", {"deployment": ctx.name, "command": ["mooncake_master"], "args": kvstore_args()}
    )
    volumes, mounts = writable_volumes()
    cfg_volume, cfg_mount = config_volume(ctx.config_map, "kvstore.json")
    volumes.append(cfg_volume)
    mounts.append(cfg_mount)
    container = {
        "name": "mooncake-master",
        "image": ctx.image,
        "imagePullPolicy": ctx.spec["imagePullPolicy"],
        "command": ["mooncake_master"],
        "args": kvstore_args(),
        "ports": [
            {"name": "rpc", "containerPort": n.STORE_RPC_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": n.METRICS_PORT, "protocol": "TCP"},
        ],
        "env": downward_env(ctx.name, "kvstore"),
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
        **health_probes(startup_failures=30),
    }
    sel = n.selector(ctx.name, "kvstore")
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(ctx, name, "kvstore"),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": sel},
            "strategy": {"type": "Recreate"},
            "template": {
                "metadata": {
                    "labels": n.labels(ctx.name, "kvstore"),
                    "annotations": {n.ANN_CONFIG_HASH: chash},
                },
                "spec": pod_spec(
                    service_account=n.child(ctx.name, "worker"),
                    containers=[container],
                    volumes=volumes,
                    image_pull_secrets=ctx.spec.get("imagePullSecrets") or [],
                    grace_seconds=30,
                    automount_token=False,
                ),
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(ctx, name, "kvstore"),
        "spec": {
            "selector": sel,
            "ports": [{"name": "rpc", "port": n.STORE_RPC_PORT, "targetPort": "rpc", "protocol": "TCP"}],
        },
    }
    return [deployment, service]
