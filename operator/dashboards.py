"""Grafana dashboards, generated from this definition and the project's metrics catalog.

`build_all()` returns {file name: dashboard JSON model}. Queries name metrics only through `_m`,
which refuses anything not in `k3serve.common.metrics_catalog`; `k3serve operator generate` writes
the result to charts/k3serve/dashboards/ and manifests/dashboards/ (a test checks both, and checks
every query of the written files against the catalog independently).

Series carry the Prometheus target labels the PodMonitor adds: namespace, pod, and the pod labels
k3serve.io/deployment and k3serve.io/role as k3serve_io_deployment and k3serve_io_role.
"""

from __future__ import annotations

import hashlib

from k3serve.common.metrics_catalog import BY_NAME

TARGET_LABELS = (
    "namespace",
    "pod",
    "container",
    "job",
    "instance",
    "k3serve_io_deployment",
    "k3serve_io_role",
)
SCOPE = 'namespace=~"$namespace",k3serve_io_deployment=~"$deployment"'
OPERATOR_SCOPE = 'namespace=~"$namespace"'
RATE = "[$__rate_interval]"


def _m(name: str, suffix: str = "", scope: str = SCOPE, extra: str = "") -> str:
    """A series selector for a catalog metric; `suffix` must be one of its scraped suffixes."""
    spec = BY_NAME[name]  # KeyError: not in the catalog
    if suffix and name + suffix not in spec.scraped_names():
        raise KeyError(f"{name}{suffix} is not scraped for a {spec.type}")
    selector = ",".join(s for s in (scope, extra) if s)
    return f"{name}{suffix}{{{selector}}}"


def _rate(name: str, by: str = "", scope: str = SCOPE, extra: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({_m(name, '_total', scope, extra)}{RATE}))"


def _quantile(q: float, name: str, scope: str = SCOPE, extra: str = "", by: str = "") -> str:
    keys = ", ".join(k for k in ("le", by) if k)
    return f"histogram_quantile({q}, sum by ({keys}) (rate({_m(name, '_bucket', scope, extra)}{RATE})))"


def _target(expr: str, legend: str) -> dict:
    return {"expr": expr, "legendFormat": legend}


def _panel(title: str, unit: str, targets: list[dict], description: str = "") -> dict:
    return {"title": title, "unit": unit, "targets": targets, "description": description}


def _latency(title: str, metric: str, extra: str = "", scope: str = SCOPE) -> dict:
    return _panel(
        title,
        "s",
        [
            _target(_quantile(0.5, metric, scope, extra), "p50"),
            _target(_quantile(0.99, metric, scope, extra), "p99"),
        ],
    )


ROUTER = 'k3serve_io_role="router"'
WORKERS = 'k3serve_io_role=~"prefill|decode"'


def _platform() -> list[dict]:
    requests = _rate("k3serve_router_requests")
    errors = _rate("k3serve_router_requests", extra='status=~"5.."')
    return [
        _latency("Time to first token (gateway)", "vllm:time_to_first_token_seconds", ROUTER),
        _latency("Inter-token latency (gateway)", "vllm:inter_token_latency_seconds", ROUTER),
        _latency("End-to-end latency (gateway)", "vllm:e2e_request_latency_seconds", ROUTER),
        _panel(
            "Token throughput",
            "short",
            [
                _target(_rate("vllm:generation_tokens"), "generated tokens/s"),
                _target(_rate("vllm:prompt_tokens"), "prompt tokens/s"),
            ],
        ),
        _panel(
            "Requests by status", "reqps", [_target(_rate("k3serve_router_requests", "status"), "{{status}}")]
        ),
        _panel("Error ratio (5xx)", "percentunit", [_target(f"{errors} / {requests}", "errors")]),
        _panel(
            "Healthy workers",
            "short",
            [_target(f"sum by (role) ({_m('k3serve_router_workers')})", "{{role}}")],
        ),
        _panel("Retries", "reqps", [_target(_rate("k3serve_router_retries", "reason"), "{{reason}}")]),
    ]


def _cache() -> list[dict]:
    hits = _rate("k3serve_prefix_cache_group_hits_tokens", "group")
    queries = _rate("k3serve_prefix_cache_group_queries_tokens", "group")
    return [
        _panel(
            "Prefix hit ratio per cache group (MLA vs KDA)",
            "percentunit",
            [_target(f"{hits} / {queries}", "{{group}}")],
            "Tokens hit / tokens queried, per cache group kind.",
        ),
        _panel(
            "Prefix hit ratio (all groups)",
            "percentunit",
            [
                _target(
                    f"{_rate('vllm:prefix_cache_hits')} / {_rate('vllm:prefix_cache_queries')}", "hit ratio"
                )
            ],
        ),
        _panel(
            "Prefill tokens computed vs skipped",
            "short",
            [
                _target(_rate("k3serve_prefill_tokens_computed"), "computed/s"),
                _target(_rate("k3serve_prefill_tokens_skipped"), "skipped/s"),
            ],
        ),
        _panel(
            "Mooncake store hits",
            "short",
            [
                _target(_rate("k3serve_kv_store_hits_tokens"), "tokens/s"),
                _target(_rate("k3serve_kv_store_group_hits_tokens", "group"), "{{group}} tokens/s"),
                _target(_rate("k3serve_kv_store_lookups", "result"), "lookups {{result}}/s"),
                _target(f"sum ({_m('k3serve_kv_store_healthy')})", "workers with a healthy store"),
            ],
            "Tokens loaded from the store (joint MLA + KDA hits), lookups by result, store health.",
        ),
        _panel(
            "Mooncake store puts",
            "ops",
            [
                _target(_rate("k3serve_kv_store_puts", "kind"), "{{kind}}"),
                _target(_rate("k3serve_kv_store_bytes", "direction"), "bytes {{direction}}/s"),
                _target(_rate("k3serve_kv_store_failures", "op, code"), "failed {{op}} {{code}}/s"),
                _target(_rate("k3serve_kv_store_deadline_misses", "op"), "deadline missed {{op}}/s"),
            ],
            "Objects put per kind, bytes moved, failures by operation and code, calls past the deadline.",
        ),
        _panel(
            "KDA snapshots",
            "ops",
            [
                _target(_rate("k3serve_kda_snapshots_stored"), "stored/s"),
                _target(_rate("k3serve_kda_snapshots_evicted"), "evicted/s"),
            ],
        ),
        _panel(
            "Reusable prefix of the chosen worker (router)",
            "short",
            [
                _target(_quantile(0.5, "k3serve_router_prefix_hit_tokens"), "p50"),
                _target(_quantile(0.9, "k3serve_router_prefix_hit_tokens"), "p90"),
            ],
        ),
    ]


def _transfers() -> list[dict]:
    return [
        _panel(
            "KV transfer bytes per view",
            "Bps",
            [_target(_rate("k3serve_kv_transfer_bytes", "view"), "{{view}}")],
            "mla pages, kda_conv and kda_ssm state.",
        ),
        _latency("KV transfer latency", "k3serve_kv_transfer_seconds"),
        _panel(
            "Transfer fallbacks to recompute",
            "ops",
            [_target(_rate("k3serve_kv_transfer_failures", "reason"), "{{reason}}")],
        ),
        _panel(
            "P/D requests by outcome",
            "ops",
            [_target(_rate("k3serve_kv_transfers", "outcome"), "{{outcome}}")],
            "pulled over NIXL, cached (the decode worker had it all), recomputed (fallback).",
        ),
    ]


def _workers() -> list[dict]:
    def per_pod(metric: str, agg: str = "sum") -> str:
        return f"{agg} by (pod) ({_m(metric, extra=WORKERS)})"

    used, total = _m("k3serve_kda_state_slots_used"), _m("k3serve_kda_state_slots_total")
    return [
        _panel("Running requests", "short", [_target(per_pod("vllm:num_requests_running"), "{{pod}}")]),
        _panel("Waiting requests", "short", [_target(per_pod("vllm:num_requests_waiting"), "{{pod}}")]),
        _panel(
            "KV cache usage", "percentunit", [_target(per_pod("vllm:kv_cache_usage_perc", "max"), "{{pod}}")]
        ),
        _panel(
            "KDA state slots in use",
            "percentunit",
            [_target(f"sum by (pod) ({used}) / sum by (pod) ({total})", "{{pod}}")],
        ),
        _panel("Free pages", "short", [_target(per_pod("k3serve_kv_pages_free"), "{{pod}}")]),
        _panel("Preemptions", "ops", [_target(_rate("vllm:num_preemptions", "pod"), "{{pod}}")]),
        _latency("Engine step time", "k3serve_engine_step_seconds"),
        _latency("Queue time", "vllm:request_queue_time_seconds"),
    ]


def _operator() -> list[dict]:
    s = OPERATOR_SCOPE
    return [
        _panel(
            "Reconciles",
            "ops",
            [_target(_rate("k3serve_operator_reconciles", "handler, result", s), "{{handler}} {{result}}")],
        ),
        _panel(
            "Reconcile errors",
            "ops",
            [_target(_rate("k3serve_operator_reconcile_errors", "handler", s), "{{handler}}")],
        ),
        _panel(
            "Deployments by condition",
            "short",
            [_target(f"sum by (condition) ({_m('k3serve_operator_deployments', scope=s)})", "{{condition}}")],
        ),
        _latency("Reconcile time", "k3serve_operator_reconcile_seconds", scope=s),
    ]


DASHBOARDS = {
    "k3serve-platform.json": ("k3serve-platform", "k3serve / Platform", _platform, True),
    "k3serve-cache.json": ("k3serve-cache", "k3serve / Prefix cache", _cache, True),
    "k3serve-pd-transfers.json": ("k3serve-pd", "k3serve / P/D transfers", _transfers, True),
    "k3serve-workers.json": ("k3serve-workers", "k3serve / Workers", _workers, True),
    "k3serve-operator.json": ("k3serve-operator", "k3serve / Operator", _operator, False),
}

_DS = {"type": "prometheus", "uid": "${datasource}"}


def _variable(name: str, label: str, query: str, all_value: str = ".*") -> dict:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": _DS,
        "query": {"query": query, "refId": name},
        "definition": query,
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "allValue": all_value,
        "sort": 1,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
    }


def _templating(per_deployment: bool) -> dict:
    variables = [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
        }
    ]
    if per_deployment:
        variables.append(
            _variable("namespace", "Namespace", "label_values(vllm:num_requests_running{}, namespace)")
        )
        variables.append(
            _variable(
                "deployment",
                "Deployment",
                'label_values(vllm:num_requests_running{namespace=~"$namespace"}, k3serve_io_deployment)',
            )
        )
    else:
        variables.append(
            _variable(
                "namespace",
                "Operator namespace",
                "label_values(k3serve_operator_reconciles_total{}, namespace)",
            )
        )
    return {"list": variables}


def _grafana_panel(index: int, panel: dict) -> dict:
    targets = [{"refId": chr(ord("A") + i), "datasource": _DS, **t} for i, t in enumerate(panel["targets"])]
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": panel["title"],
        "description": panel["description"],
        "datasource": _DS,
        "gridPos": {"x": (index % 2) * 12, "y": (index // 2) * 8, "w": 12, "h": 8},
        "fieldConfig": {"defaults": {"unit": panel["unit"]}, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": targets,
    }


def build(file_name: str, uid_suffix: str = "") -> dict:
    uid, title, panels_fn, per_deployment = DASHBOARDS[file_name]
    if uid_suffix:
        uid = f"{uid}-{hashlib.sha256(uid_suffix.encode()).hexdigest()[:8]}"
        title = f"{title} ({uid_suffix})"
    return {
        "uid": uid,
        "title": title,
        "tags": ["k3serve"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "timezone": "browser",
        "graphTooltip": 1,
        "templating": _templating(per_deployment),
        "annotations": {"list": []},
        "panels": [_grafana_panel(i, p) for i, p in enumerate(panels_fn())],
    }


def build_all(uid_suffix: str = "") -> dict[str, dict]:
    return {name: build(name, uid_suffix) for name in DASHBOARDS}
