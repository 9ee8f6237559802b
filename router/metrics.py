"""The gateway's Prometheus metrics (names and help from k3serve/common/metrics_catalog.py, component "router").

Gateway-side latencies keep vLLM's names (`vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`,
`vllm:e2e_request_latency_seconds`): measured at the gateway, so they include routing and the network.
"""

from __future__ import annotations

import prometheus_client

from k3serve.common.metrics_catalog import build


class RouterMetrics:
    def __init__(self, model_name: str, registry=None):
        self.registry = registry or prometheus_client.CollectorRegistry()
        self.m = build(self.registry, "router")
        self.model = model_name

    def _c(self, name: str, **labels):
        return self.m[name].labels(model_name=self.model, **labels)

    def request(self, endpoint: str, status: int) -> None:
        self._c("k3serve_router_requests", endpoint=endpoint, status=str(status)).inc()

    def decision(self, policy: str, reason: str, seconds: float) -> None:
        self._c("k3serve_router_decisions", policy=policy, reason=reason).inc()
        self.m["k3serve_router_decision_seconds"].labels(model_name=self.model).observe(seconds)

    def hit(self, predicted_tokens: int) -> None:
        self.m["k3serve_router_prefix_hit_tokens"].labels(model_name=self.model).observe(predicted_tokens)

    def cached(self, tokens: int, source: str = "worker") -> None:
        if tokens:
            self._c("k3serve_router_hit_tokens", source=source).inc(tokens)

    def retry(self, reason: str) -> None:
        self._c("k3serve_router_retries", reason=reason).inc()
        if reason == "resume":
            self.m["k3serve_router_resumptions"].labels(model_name=self.model).inc()

    def error(self, cls: str) -> None:
        self.m["k3serve_router_errors"].labels(**{"model_name": self.model, "class": cls}).inc()

    def workers(self, counts: dict[str, int]) -> None:
        for role, n in counts.items():
            self.m["k3serve_router_workers"].labels(role=role).set(n)

    def ttft(self, s: float) -> None:
        self.m["vllm:time_to_first_token_seconds"].labels(model_name=self.model).observe(s)

    def itl(self, s: float) -> None:
        self.m["vllm:inter_token_latency_seconds"].labels(model_name=self.model).observe(s)

    def e2e(self, s: float) -> None:
        self.m["vllm:e2e_request_latency_seconds"].labels(model_name=self.model).observe(s)

    def text(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)
