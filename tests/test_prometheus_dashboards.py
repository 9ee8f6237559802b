"""Every query of every generated Grafana dashboard returns data from a real Prometheus.

A real Prometheus (Debian's /usr/bin/prometheus, on 127.0.0.1 inside the simulation's private network)
scrapes the simulated tiny-cpu deployment (tests/_k8s_sim.py) at the targets its rendered PodMonitor
selects, with the labels the Prometheus operator would attach; the test sends traffic through the
gateway, then runs each panel query of the chart's dashboard files (Grafana variables filled in as
"All" would) as an instant query and asserts that it returns at least one finite sample. The operator
dashboard is scraped from a real `k3serve operator run` reconciling the same CR against the API
emulator (`simulate --operator`). Traffic covers what the panels show: a shared prefix (cache hits),
streams, P/D requests (transfers), more concurrent context than the KV cache holds (preemptions,
KDA snapshot evictions) and the decode pod killed mid-stream (5xx and retries while it restarts).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from ._k8s_sim import shared_simulation
from .test_k8s_simulate import MSGS, NAME, pd_cr

ROOT = Path(__file__).resolve().parents[1]
BOARDS = sorted((ROOT / "charts/k3serve/dashboards").glob("*.json"))
# $__rate_interval: Grafana's is max(4 x scrape interval, the step of the time range shown); 5m is its
# value for a range of a few hours, and it spans all of this module's traffic, restarts included
WINDOW = "5m"

# Panels whose metrics no running component exports yet, and why. The test asserts they are still
# empty, so each entry must go the moment its data appears (and every other query must have data).
PENDING: dict[str, str] = {}

pytestmark = pytest.mark.skipif(not shutil.which("prometheus"), reason="needs the Debian prometheus package")


def queries(board: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]


def fill(expr: str) -> str:
    """The query as Grafana sends it with every variable at "All" (allValue .*)."""
    return (expr.replace("$__rate_interval", WINDOW).replace('"$namespace"', '".*"')
            .replace('"$deployment"', '".*"'))


def _pressure(client) -> None:
    """More concurrent context than the 4Mi KV cache (27 pages of 64 tokens) of the decode pod holds:
    8 requests growing to ~4 pages each: preemptions and KDA snapshot evictions."""
    def one(i):
        return client.completions.create(model=NAME, prompt=f"load {i} " * 40, max_tokens=160, temperature=0,
                                         extra_body={"ignore_eos": True}).usage.completion_tokens

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, range(8))) == [160] * 8


def _pid(sim, pod: str) -> int:
    return int((sim.root / f"pods/{pod}/pid").read_text())


def _until_served(client, seen: list, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            client.completions.create(model=NAME, prompt="back?", max_tokens=2, temperature=0)
            seen.append(200)
            return
        except openai.APIStatusError as e:
            seen.append(e.status_code)
        except openai.APIConnectionError:
            seen.append("connection")
        time.sleep(0.5)


def _faults(sim, client) -> dict:
    """Pods killed (SIGKILL) as a node failure would: the simulation restarts them (restartPolicy
    Always). The prefill pod first: the next request's prefill hop fails, the router retries it and the
    decode pod computes the prompt itself. Then the decode pod mid-stream: the gateway answers 5xx
    while it is gone, and serves again once it is back."""
    seen: dict = {"after_prefill_kill": None, "statuses": []}
    os.kill(_pid(sim, "tiny-prefill-0"), signal.SIGKILL)
    r = client.completions.create(model=NAME, prompt="the prefill pod is gone " * 10, max_tokens=3, temperature=0)
    seen["after_prefill_kill"] = r.usage.completion_tokens
    stream = client.completions.create(model=NAME, prompt="long", max_tokens=400, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    got = 0
    try:
        for _chunk in stream:
            got += 1
            if got == 5:
                os.kill(_pid(sim, "tiny-decode-0"), signal.SIGKILL)
    except openai.APIError as e:
        seen["stream_error"] = type(e).__name__
    seen["chunks"] = got
    _until_served(client, seen["statuses"])
    return seen


@pytest.fixture(scope="module")
def loaded(request, tiny_model_dir):
    sim = shared_simulation(request, "pd", pd_cr, tiny_model_dir, prometheus=True)
    assert sim.prometheus, sim.output()
    client = openai.OpenAI(base_url=sim.gateway, api_key="none", max_retries=0, timeout=120)
    kw = {"extra_body": {"chat_template_kwargs": {"thinking": False}}}
    shared = [{"role": "system", "content": "You are a terse assistant. " * 30}]
    for i in range(4):  # a shared long prefix: prefix-cache hits; streams: inter-token latency
        client.chat.completions.create(model=NAME, messages=shared + [{"role": "user", "content": f"q{i}"}],
                                       max_tokens=4, temperature=0, **kw)
        list(client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=6, stream=True, **kw))
    _pressure(client)
    sim.fault = _faults(sim, client)
    time.sleep(2.5)  # the restarted pods' fresh counters are scraped before the traffic that follows
    # traffic after the restarts, a scrape apart: a counter the restarted pods create at their first
    # cache hit needs a second sample within the rate window
    for i in range(4):
        client.chat.completions.create(model=NAME, messages=shared + [{"role": "user", "content": f"r{i}"}],
                                       max_tokens=4, temperature=0, **kw)
        time.sleep(1.2)
    time.sleep(3)  # two more scrapes (1 s interval) see the counters after the traffic
    return sim


def test_killed_pods_cost_retries_and_errors_then_serve_again(loaded):
    fault = loaded.fault
    assert fault["after_prefill_kill"] == 3, fault  # served without its prefill pod (decode recomputed)
    assert fault["chunks"] < 400  # the stream was cut when its decode pod died
    assert fault["statuses"][-1] == 200, fault  # served again after the restart
    assert any(s != 200 for s in fault["statuses"]), fault  # 5xx (or refused) while the pod was gone
    out = loaded.output()
    assert "pod tiny-prefill-0 exited with code -9; restart 1" in out
    assert "pod tiny-decode-0 exited with code -9; restart 1" in out


def instant(prom: str, expr: str) -> list[dict]:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def test_prometheus_scrapes_every_rendered_pod(loaded):
    targets = httpx.get(f"{loaded.prometheus}/api/v1/targets", timeout=30).json()["data"]["activeTargets"]
    pods = {t["labels"]["pod"]: t["health"] for t in targets}
    want = {p: "up" for p in ("tiny-prefill-0", "tiny-decode-0", "tiny-router-sim0", "tiny-kvstore-sim0",
                                "k3serve-operator-sim0")}
    assert pods == want, targets
    roles = {t["labels"].get("k3serve_io_role") for t in targets}
    assert roles == {"prefill", "decode", "router", "kvstore", None}  # the operator has no deployment role


@pytest.mark.parametrize("board", BOARDS, ids=[b.stem for b in BOARDS])
def test_every_dashboard_query_returns_data(loaded, board):
    dash = json.loads(board.read_text())
    empty, landed = [], []
    for title, expr in queries(dash):
        result = instant(loaded.prometheus, fill(expr))
        values = [float(s["value"][1]) for s in result]
        has_data = any(math.isfinite(v) for v in values)
        if title in PENDING and has_data:
            landed.append(f"{title}: has data now: remove it from PENDING")
        elif title not in PENDING and not has_data:
            empty.append(f"{title}: {expr}  -> {values or 'no series'}")
    assert not empty, "queries without data:\n  " + "\n  ".join(empty)
    assert not landed, "\n".join(landed)
