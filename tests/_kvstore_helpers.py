"""Helpers for the store-tier tests: an engine in another process, and metric values as scraped.

`EngineProcess` runs `python tests/_kvstore_helpers.py` as a child (it inherits the test's private
network namespace) that builds `LLM` engines on request and answers one JSON line per command:
`engine(**llm_kwargs)`, `generate(prompts, max_tokens, salt)` -> outputs, `metrics(names)`,
`snapshots()` (cached KDA snapshot lengths), `close()` (shuts the engine's connectors down).

`metrics_of(engine)` renders an engine's stats through the worker's catalog metrics
(workers/metrics.py EngineMetrics) and parses the Prometheus text back: assertions read what a
scrape of `/metrics` would show.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.abspath(__file__)


def metrics_of(engine) -> dict[str, float]:
    """{'name{label="v",...}' or 'name': value} of every sample a scrape would show."""
    import prometheus_client
    from prometheus_client.parser import text_string_to_metric_families

    from k3serve.workers.metrics import EngineMetrics

    reg = prometheus_client.CollectorRegistry()
    m = EngineMetrics(reg, "m")
    m.on_stats(engine.stats())
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(prometheus_client.generate_latest(reg).decode()):
        for s in fam.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            key = s.name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
            out[key] = s.value
    return out


def shutdown_engine(engine) -> None:
    """Shut the engine's connectors down (the store client is closed, its segment unmounted)."""
    conn = getattr(engine, "connector", None)
    if conn is not None:
        conn.worker.shutdown()


class EngineProcess:
    def __init__(self, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, HERE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True,
                                     env={**os.environ, "PYTHONSAFEPATH": "1", **(env or {})})

    def call(self, op: str, **kw):
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine process died (exit {self.proc.poll()})")
        ans = json.loads(line)
        if "error" in ans:
            raise RuntimeError(f"engine process: {ans['error']}")
        return ans["result"]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit")
            except (RuntimeError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _serve() -> None:
    from k3serve.sampling_params import SamplingParams
    from k3serve.workers.llm import LLM

    llm = None
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "quit":
                if llm is not None:
                    shutdown_engine(llm.engine)
                print(json.dumps({"result": None}), flush=True)
                return
            if op == "engine":
                if llm is not None:
                    shutdown_engine(llm.engine)
                llm = LLM(**cmd["kwargs"])
                res = None
            elif op == "generate":
                sp = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], ignore_eos=True)
                outs = llm.generate(cmd["prompts"], sp, cache_salt=cmd.get("salt"))
                res = [o.outputs[0].token_ids for o in outs]
            elif op == "metrics":
                res = metrics_of(llm.engine)
            elif op == "snapshots":
                per_group = llm.engine.kv_manager.cached_snapshot_lengths()
                res = sorted(set().union(*[set(v) for v in per_group.values()])) if per_group else []
            elif op == "close":
                shutdown_engine(llm.engine)
                llm, res = None, None
            else:
                raise ValueError(f"unknown op {op}")
            print(json.dumps({"result": res}), flush=True)
        except Exception as e:  # noqa: BLE001 - reported to the test
            print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)


if __name__ == "__main__":
    _serve()
