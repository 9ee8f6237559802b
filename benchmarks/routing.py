"""Routing policies side by side on a multi-turn agentic workload (4 colocated workers, one run).

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/routing.py [--workers 4] [--sessions 8] [--turns 4]
        [--policies hybrid-prefix,prefix,round-robin,least-loaded] [--vllm-router]

Starts `--workers` real `k3serve worker` processes (tiny model, prefix caching on) once, then for each policy
a `k3serve router` in front of them and the same `k3serve bench` agentic load: sessions with a short shared
system prompt and a long task of their own; every later turn extends the conversation and is sent as
`--branches` parallel requests (an agent trying tool calls at once) that share everything but the last
message. The branches are where attention-only scoring goes wrong on a hybrid model: a worker that served
one branch holds the MLA pages of the shared conversation but no KDA state at its end. Every policy's run uses its own `cache_salt`, so no run
reuses another's cache. Reported per policy: TTFT p50/p90, prefill tokens the workers computed (their
`k3serve_prefill_tokens_computed_total`), cached prompt tokens, output throughput, router CPU per request
(the router process's user+system time / requests), and the ratios of hybrid-prefix against each.

`--vllm-router` also runs the peer router (`pip install vllm-router==0.1.17`, benchmark-only) with
`round_robin` and `cache_aware` in front of `k3serve serve` instances of the same model (HTTP engines
publishing `--kv-events-zmq`), when its binary is installed; otherwise it says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import httpx  # noqa: E402

from k3serve.bench import agentic_dataset, run_load, summarize  # noqa: E402

PY = [sys.executable, "-m", "k3serve.cli"]


def _start(cmd, log, pattern, timeout=180):
    f = open(log, "w")  # noqa: SIM115
    p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONSAFEPATH="1"),
                         start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, open(log).read())
        if m:
            return p, m
        if p.poll() is not None:
            raise RuntimeError(f"{cmd[3]} exited:\n{open(log).read()[-2000:]}")
        time.sleep(0.2)
    p.kill()
    raise RuntimeError(f"{cmd[3]} did not start in {timeout}s:\n{open(log).read()[-2000:]}")


def _stop(p):
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def _prefill_computed(metrics_urls) -> float:
    total = 0.0
    for u in metrics_urls:
        text = httpx.get(u + "/metrics", timeout=10).text
        for m in re.finditer(r"^k3serve_prefill_tokens_computed_total\{[^}]*\} (\S+)$", text, re.M):
            total += float(m.group(1))
    return total


def _load(url, model, args, salt):
    data = agentic_dataset(args.sessions, args.turns, args.shared_prefix_len, args.task_len, args.turn_len,
                           args.output_len, args.seed, args.branches)
    results, wall = asyncio.run(run_load(url, model, data, concurrency=args.concurrency, seed=args.seed,
                                         progress=False, extra_body={"cache_salt": salt} if salt else None))
    return summarize(results, wall)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--policies", default="hybrid-prefix,prefix,round-robin,least-loaded")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--shared-prefix-len", type=int, default=60)
    ap.add_argument("--task-len", type=int, default=200)
    ap.add_argument("--turn-len", type=int, default=12)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--branches", type=int, default=3, help="parallel requests per later turn")
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None)
    ap.add_argument("--worker-arg", action="append", default=[],
                    help="extra worker flag (repeatable), e.g. --worker-arg=--prefix-cache-selective-retention")
    ap.add_argument("--vllm-router", action="store_true")
    ap.add_argument("--vllm-policies", default="round_robin,cache_aware,kv_aware")
    ap.add_argument("--vllm-router-bin", default=os.environ.get("VLLM_ROUTER_BIN"))
    ap.add_argument("--kv-event-block-size", type=int, default=240, help="the engines' block size (tiny: 240)")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args()
    from k3serve.workers.model.paths import ensure_tiny_model

    model = a.model or str(ensure_tiny_model())
    tmp = tempfile.mkdtemp(prefix="k3-routing-")
    procs, addrs, murls = [], [], []
    out = {}
    try:
        for i in range(a.workers):
            p, m = _start([*PY, "worker", "--model", model, "--grpc-port", "0", "--metrics-port", "0",
                           "--enable-prefix-caching", "--num-threads", "1", "--max-model-len", "4096",
                           "--served-model-name", "m", "--log-level", "warning", *a.worker_arg],
                          f"{tmp}/worker-{i}.log", r"ready grpc=(\S+) metrics=(\S+)")
            procs.append(p)
            addrs.append(m.group(1))
            murls.append(m.group(2))
        print(f"{a.workers} workers up; workload: {a.sessions} sessions x {a.turns} turns, concurrency "
              f"{a.concurrency}, shared prefix {a.shared_prefix_len} words", flush=True)
        for policy in [p for p in a.policies.split(",") if p]:
            r, m = _start([*PY, "router", "--model", model, "--workers", ",".join(addrs), "--port", "0",
                           "--metrics-port", "0", "--policy", policy, "--served-model-name", "m",
                           "--log-level", "warning"], f"{tmp}/router-{policy}.log", r"listening on (http://\S+)")
            url = m.group(1)
            deadline = time.monotonic() + 30
            while httpx.get(url + "/health").json()["workers"]["both"] < a.workers and time.monotonic() < deadline:
                time.sleep(0.2)
            pre0, cpu0 = _prefill_computed(murls), _cpu_seconds(r.pid)
            s = _load(url, "m", a, salt=f"routing-{policy}-{time.time()}")
            s["prefill_tokens_computed"] = _prefill_computed(murls) - pre0
            s["router_cpu_ms_per_request"] = (_cpu_seconds(r.pid) - cpu0) * 1000 / max(1, s["completed"])
            _stop(r)
            out[policy] = s
            print(f"  {policy:14s} TTFT p50 {s['ttft_ms']['p50']:8.1f} ms  p90 {s['ttft_ms']['p90']:8.1f} ms  "
                  f"prefill computed {s['prefill_tokens_computed']:8.0f}  cached {s['cached_prompt_tokens']:7d}/"
                  f"{s['prompt_tokens']:7d}  {s['output_throughput']:6.1f} tok/s  router CPU "
                  f"{s['router_cpu_ms_per_request']:.2f} ms/req  failed {s['failed']}", flush=True)
        if a.vllm_router:
            out.update(_vllm_router(a, model, tmp))
    finally:
        for p in procs:
            _stop(p)
    ours = out.get("hybrid-prefix")
    if ours:
        print("hybrid-prefix vs:")
        for name, s in out.items():
            if name == "hybrid-prefix" or not s.get("completed"):
                continue
            t = s["ttft_ms"]["p50"] / ours["ttft_ms"]["p50"] if ours["ttft_ms"]["p50"] else float("nan")
            pf = s["prefill_tokens_computed"] / ours["prefill_tokens_computed"] if ours["prefill_tokens_computed"] \
                else float("nan")
            print(f"  {name:24s} p50 TTFT {t:5.2f}x ours   prefill tokens {pf:5.2f}x ours")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _vllm_router(a, model, tmp) -> dict:
    exe = a.vllm_router_bin or shutil.which("vllm-router") or os.path.join(os.path.dirname(sys.executable),
                                                                           "vllm-router")
    if not os.path.exists(exe):
        print("vllm-router: not installed (pip install vllm-router==0.1.17, e.g. into its own venv, and pass "
              "--vllm-router-bin); peer comparison skipped")
        return {}
    out = {}
    servers, urls, murls, zmqs = [], [], [], []
    import socket

    def free():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    try:
        for i in range(a.workers):
            zmq_ep = f"tcp://127.0.0.1:{free()}"
            p, m = _start([*PY, "serve", model, "--port", "0", "--enable-prefix-caching", "--num-threads", "1",
                           "--max-model-len", "4096", "--served-model-name", "m", "--log-level", "warning",
                           "--kv-events-zmq", zmq_ep, "--kv-events-zmq-format", "map"], f"{tmp}/serve-{i}.log",
                          r"listening on (http://\S+)")
            servers.append(p)
            urls.append(m.group(1))
            murls.append(m.group(1))
            zmqs.append(zmq_ep)
        block = a.kv_event_block_size
        for policy in a.vllm_policies.split(","):
            port, prom = free(), free()
            cmd = [exe, "--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--worker-urls", *urls,
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom)]
            if policy == "kv_aware":
                for u, z in zip(urls, zmqs):
                    cmd += ["--kv-event-source", f"{u}={z}"]
                cmd += ["--kv-event-block-size", str(block), "--kv-event-model", "m"]
            log = f"{tmp}/vllm-router-{policy}.log"
            try:
                r, _ = _start(cmd, log, r"(?i)(listening|started|running|serving)", timeout=60)
            except RuntimeError as e:
                print(f"vllm-router {policy}: could not start: {str(e)[-400:]}")
                continue
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            pre0, cpu0 = _prefill_computed(murls), _cpu_seconds(r.pid)
            s = _load(url, "m", a, salt=f"vllm-router-{policy}-{time.time()}")
            s["prefill_tokens_computed"] = _prefill_computed(murls) - pre0
            s["router_cpu_ms_per_request"] = (_cpu_seconds(r.pid) - cpu0) * 1000 / max(1, s["completed"])
            try:  # its own metrics: did kv_aware consume our events?
                text = httpx.get(f"http://127.0.0.1:{prom}/metrics", timeout=5).text
                s["vllm_router_kv_metrics"] = [ln for ln in text.splitlines()
                                               if ("kv" in ln.lower() or "cache" in ln.lower()) and not ln.startswith("#")][:20]
            except httpx.HTTPError as e:
                s["vllm_router_kv_metrics"] = [f"metrics unavailable: {e}"]
            for ln in s["vllm_router_kv_metrics"][:8]:
                print(f"    vllm-router metric: {ln}")
            _stop(r)
            out[f"vllm-router {policy}"] = s
            print(f"  vllm-router {policy:11s} TTFT p50 {s['ttft_ms']['p50']:8.1f} ms  p90 "
                  f"{s['ttft_ms']['p90']:8.1f} ms  prefill computed {s['prefill_tokens_computed']:8.0f}  "
                  f"failed {s['failed']} {s['errors'][:1]}", flush=True)
    finally:
        for p in servers:
            _stop(p)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
