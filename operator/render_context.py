"""Inputs of one render: the defaulted spec, its plan, and what the cluster offers."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from k3serve.operator import names as n
from k3serve.operator.layout import Plan

DEFAULT_IMAGE = "ghcr.io/k3serve/k3serve:0.1.0"


@dataclass(frozen=True)
class RenderOptions:
    """What the target cluster has. `lws`: the LeaderWorkerSet CRD is installed (multi-node groups
    become LeaderWorkerSets, else one StatefulSet per group). `podmonitor`: the Prometheus operator's
    PodMonitor CRD is installed."""

    lws: bool = False
    podmonitor: bool = True
    default_image: str = DEFAULT_IMAGE
    cluster_domain: str = "cluster.local"


@dataclass
class Context:
    name: str
    namespace: str
    spec: dict  # defaulted
    plan: Plan
    options: RenderOptions
    config: dict[str, dict] = field(default_factory=dict)  # ConfigMap key -> document

    @property
    def image(self) -> str:
        return self.spec.get("image") or self.options.default_image

    @property
    def config_map(self) -> str:
        return n.child(self.name, "config")

    @property
    def kv_store_address(self) -> str | None:
        if not self.spec["kvStore"]["enabled"]:
            return None
        host = self.service_host(n.child(self.name, "kvstore"))
        return f"{host}:{n.STORE_RPC_PORT}"

    def service_host(self, service: str) -> str:
        return f"{service}.{self.namespace}.svc.{self.options.cluster_domain}"

    def add_config(self, key: str, document: dict) -> str:
        """Register a ConfigMap document; returns its hash (the pod template's config-hash)."""
        self.config[key] = document
        return config_hash(document)


def canonical_json(document: object) -> str:
    return json.dumps(document, sort_keys=True, separators=(",", ":"))


def config_hash(document: object) -> str:
    return hashlib.sha256(canonical_json(document).encode()).hexdigest()[:16]
