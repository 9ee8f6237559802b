"""Pieces every rendered pod shares: hardening, probes, downward-API environment, writable volumes.

Pods run as UID 1000 (non-root) with a read-only root filesystem, no privilege escalation, every
capability dropped and the RuntimeDefault seccomp profile; the only writable paths are emptyDirs
(/tmp, the cache directory and, for workers, an in-memory /dev/shm).
"""

from __future__ import annotations

from k3serve.operator import names as n


def pod_security_context() -> dict:
    return {
        "runAsNonRoot": True,
        "runAsUser": n.RUN_AS_USER,
        "runAsGroup": n.RUN_AS_USER,
        "fsGroup": n.RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def health_probes(*, startup_failures: int) -> dict:
    """startup, readiness and liveness probes, all on GET /health of the metrics port."""

    def probe(period: int, failures: int, timeout: int = 3) -> dict:
        return {
            "httpGet": {"path": "/health", "port": "metrics"},
            "periodSeconds": period,
            "failureThreshold": failures,
            "timeoutSeconds": timeout,
        }

    return {
        "startupProbe": probe(10, startup_failures),
        "readinessProbe": probe(5, 3),
        "livenessProbe": probe(10, 6, timeout=5),
    }


def downward_env(name: str, component: str) -> list[dict]:
    """Identity of the pod; K3SERVE_POD_IP comes first so later values can use $(K3SERVE_POD_IP)."""

    def field(var: str, path: str) -> dict:
        return {"name": var, "valueFrom": {"fieldRef": {"fieldPath": path}}}

    return [
        field("K3SERVE_POD_IP", "status.podIP"),
        field("K3SERVE_POD_NAME", "metadata.name"),
        field("K3SERVE_NAMESPACE", "metadata.namespace"),
        {"name": "K3SERVE_DEPLOYMENT", "value": name},
        {"name": "K3SERVE_COMPONENT", "value": component},
        {"name": "K3SERVE_HOME", "value": n.CACHE_DIR},
    ]


def merge_env(base: list[dict], extra: list[dict] | None) -> list[dict]:
    """`base` with user variables appended; a user variable replaces a base one of the same name."""
    extra = extra or []
    names = {e["name"] for e in extra}
    return [e for e in base if e["name"] not in names] + [
        {"name": e["name"], "valueFrom": {"secretKeyRef": dict(e["valueFrom"]["secretKeyRef"])}}
        if e.get("valueFrom")
        else {"name": e["name"], "value": e.get("value", "")}
        for e in extra
    ]


def writable_volumes(*, shm_size: str | None = None) -> tuple[list[dict], list[dict]]:
    """(volumes, volumeMounts) for /tmp, the cache directory and optionally /dev/shm."""
    volumes = [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": n.CACHE_DIR}]
    if shm_size is not None:
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": str(shm_size)}})
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    return volumes, mounts


def config_volume(config_map: str, key: str) -> tuple[dict, dict]:
    """One key of the deployment's ConfigMap, read-only at CONFIG_DIR/KEY."""
    volume = {"name": "config", "configMap": {"name": config_map, "items": [{"key": key, "path": key}]}}
    return volume, {"name": "config", "mountPath": n.CONFIG_DIR, "readOnly": True}


def pod_spec(
    *,
    service_account: str,
    containers: list[dict],
    volumes: list[dict],
    image_pull_secrets: list[str],
    grace_seconds: int,
    automount_token: bool,
    node_selector: dict | None = None,
    tolerations: list | None = None,
) -> dict:
    spec: dict = {
        "serviceAccountName": service_account,
        "automountServiceAccountToken": automount_token,
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),
        "terminationGracePeriodSeconds": grace_seconds,
        "containers": containers,
        "volumes": volumes,
    }
    if image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in image_pull_secrets]
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    if tolerations:
        spec["tolerations"] = [dict(t) for t in tolerations]
    return spec
