"""The operator's Prometheus metrics (names from k3serve.common.metrics_catalog, component "operator")."""

from __future__ import annotations

from k3serve.common import metrics_catalog

PHASES = ("Pending", "Progressing", "Ready", "Degraded")
# the `handler` label values of operator/handlers.py: kopf's cause of a reconcile, the timer, delete
HANDLERS = ("create", "update", "resume", "timer", "delete")


class OperatorMetrics:
    """reconciles{handler,result}, reconcile_errors{handler}, reconcile_seconds{handler}, and
    deployments{condition} (the number of KimiK3Deployments per phase)."""

    def __init__(self, registry=None):
        import prometheus_client

        self.registry = registry if registry is not None else prometheus_client.CollectorRegistry()
        self._m = metrics_catalog.build(self.registry, "operator")
        self._phases: dict[tuple[str, str], str] = {}
        for phase in PHASES:
            self._m["k3serve_operator_deployments"].labels(condition=phase).set(0)
        # every handler's error series exists from the start (0 until an error), so a dashboard shows
        # "no errors" instead of "no data"
        for handler in HANDLERS:
            self._m["k3serve_operator_reconcile_errors"].labels(handler=handler)

    def observe(self, handler: str, result: str, seconds: float) -> None:
        self._m["k3serve_operator_reconciles"].labels(handler=handler, result=result).inc()
        self._m["k3serve_operator_reconcile_seconds"].labels(handler=handler).observe(seconds)
        if result == "error":
            self._m["k3serve_operator_reconcile_errors"].labels(handler=handler).inc()

    def set_phase(self, namespace: str, name: str, phase: str | None) -> None:
        if phase is None:
            self._phases.pop((namespace, name), None)
        else:
            self._phases[(namespace, name)] = phase
        for p in PHASES:
            count = sum(1 for v in self._phases.values() if v == p)
            self._m["k3serve_operator_deployments"].labels(condition=p).set(count)

    def serve(self, host: str, port: int):
        """Expose /metrics on host:port (a daemon thread); returns the server."""
        import prometheus_client

        server, _thread = prometheus_client.start_http_server(port, addr=host, registry=self.registry)
        return server
