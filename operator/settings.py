"""Runtime settings of the operator process, read from the environment.

`k3serve operator run` turns its flags into these variables before importing the kopf handlers
(kopf fixes a timer's interval when the handler is declared), so flags and environment agree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from k3serve.operator.render_context import DEFAULT_IMAGE, RenderOptions


@dataclass(frozen=True)
class OperatorSettings:
    status_interval: float = 10.0  # seconds between status refreshes (reads the workloads only)
    resync_interval: float = 60.0  # seconds between full reconciles (repairs drift in any child)
    default_image: str = DEFAULT_IMAGE
    cluster_domain: str = "cluster.local"
    discovery_ttl: float = 60.0  # seconds a LeaderWorkerSet / PodMonitor CRD check stays valid

    @classmethod
    def from_env(cls) -> OperatorSettings:
        env = os.environ
        return cls(
            status_interval=float(env.get("K3SERVE_OPERATOR_STATUS_INTERVAL", cls.status_interval)),
            resync_interval=float(env.get("K3SERVE_OPERATOR_RESYNC_INTERVAL", cls.resync_interval)),
            default_image=env.get("K3SERVE_OPERATOR_DEFAULT_IMAGE") or DEFAULT_IMAGE,
            cluster_domain=env.get("K3SERVE_OPERATOR_CLUSTER_DOMAIN") or "cluster.local",
            discovery_ttl=float(env.get("K3SERVE_OPERATOR_DISCOVERY_TTL", cls.discovery_ttl)),
        )

    def render_options(self, *, lws: bool, podmonitor: bool) -> RenderOptions:
        return RenderOptions(
            lws=lws,
            podmonitor=podmonitor,
            default_image=self.default_image,
            cluster_domain=self.cluster_domain,
        )
