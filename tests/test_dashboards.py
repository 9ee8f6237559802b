"""Grafana dashboards: generated from operator/dashboards.py, identical in the chart and manifests/,
and every query names only metrics (and labels) of the project's metrics catalog. The queries are
parsed from the written JSON files, independently of the generator."""

from __future__ import annotations

import json
import os
import re

import pytest

from k3serve.common.metrics_catalog import BY_NAME, CATALOG
from k3serve.operator import dashboards, generate

ROOT = generate.repo_root()
DIRS = [os.path.join(ROOT, "charts", "k3serve", "dashboards"), os.path.join(ROOT, "manifests", "dashboards")]
TARGET_LABELS = {
    "namespace",
    "pod",
    "container",
    "job",
    "instance",
    "k3serve_io_deployment",
    "k3serve_io_role",
}
FUNCTIONS = {"sum", "rate", "histogram_quantile", "max", "label_values", "avg", "increase"}
KEYWORDS = {"by", "without"}


def load(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def all_boards() -> dict[str, dict]:
    return {name: load(os.path.join(DIRS[0], name)) for name in sorted(os.listdir(DIRS[0]))}


def queries(board: dict) -> list[str]:
    out = [t["expr"] for p in board["panels"] for t in p["targets"]]
    out += [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return out


def _scraped_to_spec() -> dict[str, object]:
    return {scraped: spec for spec in CATALOG for scraped in (spec.name, *spec.scraped_names())}


SCRAPED = _scraped_to_spec()


def parse(expr: str) -> tuple[list[tuple[str, list[str]]], list[str], list[str], list[str]]:
    """(selectors [(metric, [label names])], grouping labels, functions, leftover identifiers)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values and legend strings
    text = re.sub(r"\[\$__rate_interval\]", "", text)
    selectors = []
    for metric, body in re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}", text):
        selectors.append((metric, re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", body)))
    text = re.sub(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{[^}]*\}", " ", text)
    grouping = []
    for body in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", text):
        grouping += [g.strip() for g in body.split(",") if g.strip()]
    text = re.sub(r"\b(?:by|without)\s*\([^)]*\)", " ", text)
    m = re.match(r"^\s*label_values\(\s*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)\s*$", text)
    if m:  # label_values(selector, label): the label is a grouping label
        grouping.append(m.group(1))
        text = "label_values( , )"
    functions = re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*\(", text)
    text = re.sub(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*\(", "(", text)
    leftover = [t for t in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text) if t not in KEYWORDS]
    return selectors, grouping, functions, leftover


def test_files_are_generated_and_identical_in_chart_and_manifests():
    built = dashboards.build_all()
    for directory in DIRS:
        assert sorted(os.listdir(directory)) == sorted(built)
        for name, board in built.items():
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                assert f.read() == generate.dashboard_json(board), f"{directory}/{name} is stale"


@pytest.mark.parametrize("name", sorted(dashboards.DASHBOARDS))
def test_every_query_uses_only_catalogued_metrics_and_labels(name):
    board = all_boards()[name]
    assert queries(board)
    for expr in queries(board):
        selectors, grouping, functions, leftover = parse(expr)
        assert selectors, expr
        assert leftover == [], f"bare identifiers (uncatalogued metric names?) in {expr!r}: {leftover}"
        assert set(functions) <= FUNCTIONS, expr
        labels_here = set(TARGET_LABELS) | {"le"}
        for metric, labels in selectors:
            assert metric in SCRAPED, f"{metric} is not in k3serve/common/metrics_catalog.py ({expr!r})"
            spec = SCRAPED[metric]
            allowed = set(spec.labels) | TARGET_LABELS | ({"le"} if metric.endswith("_bucket") else set())
            assert set(labels) <= allowed, (metric, labels)
            labels_here |= set(spec.labels)
        assert set(grouping) <= labels_here, (expr, grouping)


def test_dashboards_cover_what_operators_watch():
    boards = all_boards()

    def used(name: str) -> set[str]:
        return {metric for expr in queries(boards[name]) for metric, _ in parse(expr)[0]}

    platform = boards["k3serve-platform.json"]
    for histogram in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        exprs = [e for e in queries(platform) if histogram in e]
        assert any("histogram_quantile(0.5," in e for e in exprs) and any(
            "histogram_quantile(0.99," in e for e in exprs
        )
        assert all('k3serve_io_role="router"' in e for e in exprs)  # the gateway's view
    assert {"vllm:generation_tokens_total", "k3serve_router_requests_total"} <= used("k3serve-platform.json")
    assert any('status=~"5.."' in e for e in queries(platform))
    cache = used("k3serve-cache.json")
    assert {
        "k3serve_prefix_cache_group_hits_tokens_total",
        "k3serve_prefix_cache_group_queries_tokens_total",
        "k3serve_kv_store_hits_tokens_total",
        "k3serve_prefill_tokens_skipped_total",
    } <= cache
    assert any("by (group)" in e for e in queries(boards["k3serve-cache.json"]))  # MLA vs KDA
    pd = queries(boards["k3serve-pd-transfers.json"])
    assert any("k3serve_kv_transfer_bytes_total" in e and "by (view)" in e for e in pd)
    assert {"k3serve_kv_transfer_seconds_bucket", "k3serve_kv_transfer_failures_total"} <= used(
        "k3serve-pd-transfers.json"
    )
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"} <= used(
        "k3serve-workers.json"
    )
    assert {"k3serve_operator_reconciles_total", "k3serve_operator_reconcile_errors_total"} <= used(
        "k3serve-operator.json"
    )


def test_dashboard_structure():
    uids = set()
    for board in all_boards().values():
        assert board["uid"] not in uids and len(board["uid"]) <= 40
        uids.add(board["uid"])
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids))
        variables = {v["name"] for v in board["templating"]["list"]}
        assert {"datasource", "namespace"} <= variables
        for panel in board["panels"]:
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"] and panel["fieldConfig"]["defaults"]["unit"]
            assert all(t["refId"] for t in panel["targets"])


def test_generator_refuses_uncatalogued_metrics():
    with pytest.raises(KeyError):
        dashboards._m("vllm:made_up_metric")
    with pytest.raises(KeyError):
        dashboards._m("vllm:num_requests_running", "_bucket")  # a gauge has no buckets
    assert "k3serve_kv_transfer_bytes" in BY_NAME


def test_parser_catches_bare_metric_names():
    assert parse("sum(rate(vllm:prompt_tokens_total[$__rate_interval]))")[3] == ["vllm:prompt_tokens_total"]
    assert parse('sum by (pod) (x{namespace="a"})')[:2] == ([("x", ["namespace"])], ["pod"])
