"""Transfer metrics (catalog: k3serve/common/metrics_catalog.py), fed by the NIXL connector's ledger.

* `k3serve_kv_transfers_total{outcome}`: decode-side P/D requests by outcome (pulled | cached | recomputed).
* `k3serve_kv_transfer_bytes_total{view}`: bytes pulled per view (mla | kda_conv | kda_ssm).
* `k3serve_kv_transfer_seconds`: latency of one request's pull (post to DONE, zero-fill excluded).
* `k3serve_kv_transfer_failures_total{reason}`: pulls that fell back to recompute, by reason.
"""

from __future__ import annotations

from k3serve.common.metrics_catalog import BY_NAME


class TransferMetrics:
    def __init__(self, registry, model_name: str):
        import prometheus_client as pc

        def make(name):
            m = BY_NAME[name]
            kw = dict(name=m.name, documentation=m.help, labelnames=m.labels, registry=registry)
            if m.type == "counter":
                return pc.Counter(**kw)
            return pc.Histogram(buckets=m.buckets, **kw)

        existing = getattr(registry, "_names_to_collectors", {})
        self.m = {}
        for name in ("k3serve_kv_transfers", "k3serve_kv_transfer_bytes", "k3serve_kv_transfer_seconds",
                     "k3serve_kv_transfer_failures"):
            found = existing.get(name) or existing.get(name + "_total")
            self.m[name] = found if found is not None else make(name)
        self.model = model_name

    def observe(self, out, seconds: float | None, bytes_by_view: dict) -> None:
        self.m["k3serve_kv_transfers"].labels(self.model, out.outcome).inc()
        if out.outcome == "recomputed":
            self.m["k3serve_kv_transfer_failures"].labels(self.model, out.reason or "unknown").inc()
        for view, n in bytes_by_view.items():
            self.m["k3serve_kv_transfer_bytes"].labels(self.model, view).inc(n)
        if seconds is not None:
            self.m["k3serve_kv_transfer_seconds"].labels(self.model).observe(seconds)
