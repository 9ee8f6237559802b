"""The store tier's counters (LLMEngine.stats() keys `kv_store_*`) as catalog metric series.

`series(stats)` yields `(metric name, labels, value, kind)` for k3serve/common/metrics_catalog.py's
`k3serve_kv_store_*` metrics; counters are cumulative values (the worker's EngineMetrics turns them
into increments), `kind` is "counter" or "gauge". Keys a worker without a store lacks yield nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

P = "kv_store_"


def series(stats: dict) -> Iterator[tuple[str, dict, float, str]]:
    if P + "lookups" not in stats:
        return
    g = {k[len(P):]: float(v) for k, v in stats.items() if k.startswith(P) and isinstance(v, (int, float))}
    hits, skipped = g.get("loads", 0.0), g.get("lookups_skipped", 0.0)
    yield "k3serve_kv_store_lookups", {"result": "hit"}, hits, "counter"
    yield "k3serve_kv_store_lookups", {"result": "skipped"}, skipped, "counter"
    yield "k3serve_kv_store_lookups", {"result": "miss"}, max(0.0, g.get("lookups", 0.0) - hits - skipped), "counter"
    yield "k3serve_kv_store_hits_tokens", {}, g.get("hit_tokens", 0.0), "counter"
    for kind in ("mla", "kda"):
        yield "k3serve_kv_store_group_hits_tokens", {"group": kind}, g.get(f"{kind}_hit_tokens", 0.0), "counter"
        yield "k3serve_kv_store_puts", {"kind": kind}, g.get(f"puts_{kind}", 0.0), "counter"
    yield "k3serve_kv_store_bytes", {"direction": "put"}, g.get("bytes_put", 0.0), "counter"
    yield "k3serve_kv_store_bytes", {"direction": "get"}, g.get("bytes_got", 0.0), "counter"
    for op in ("lookup", "load"):
        yield "k3serve_kv_store_deadline_misses", {"op": op}, g.get(f"deadline_misses_{op}", 0.0), "counter"
    yield "k3serve_kv_store_failures", {"op": "load", "code": "failed"}, g.get("loads_failed", 0.0), "counter"
    yield "k3serve_kv_store_failures", {"op": "put", "code": "unavailable"}, g.get("saves_dropped", 0.0), "counter"
    yield "k3serve_kv_store_failures", {"op": "put", "code": "staging"}, g.get("saves_dropped_staging", 0.0), \
        "counter"
    for k, v in g.items():
        if k.startswith("failures:"):
            _f, op, code = k.split(":", 2)
            yield "k3serve_kv_store_failures", {"op": op, "code": code}, v, "counter"
    yield "k3serve_kv_store_healthy", {}, g.get("healthy", 0.0), "gauge"
    yield "k3serve_kv_store_wait_max_seconds", {}, g.get("wait_max_s", 0.0), "gauge"
