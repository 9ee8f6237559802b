"""Engine metrics: the worker's catalog metrics (k3serve.common.metrics_catalog) fed from engine events.

`EngineMetrics` is driven by AsyncEngine from its engine thread only (it keeps per-request timing
state without locks); prometheus-client objects themselves are thread-safe for scraping.

Events and what they update (all labelled with `model_name`):

* `on_arrival(rid, prompt_len, t)`: starts the request's clock.
* `on_step(outputs, t_start, t_end)`: `k3serve_engine_step_seconds`; per request output with new
  tokens: `vllm:generation_tokens`, on its first tokens `vllm:time_to_first_token_seconds`,
  `vllm:request_queue_time_seconds`, `vllm:prompt_tokens`, afterwards
  `vllm:inter_token_latency_seconds` (once per step, time since the previous tokens); on finish
  `vllm:e2e_request_latency_seconds` and `vllm:request_success{finished_reason}`.
* `on_abort(rid, t)`: a request aborted before the engine finished it (counted as finished_reason
  "abort").
* `on_stats(stats)`: the gauges from `LLMEngine.stats()` (running, waiting, kv_usage, free_pages,
  kda_slots_used/total) and the counters that follow its cumulative keys (preemptions, prefix-cache
  queries/hits overall and per group kind, KDA snapshots stored/evicted, prefill tokens
  computed/skipped; the host offload tier's `kv_offload_*` hits, pages, bytes, evictions, failed loads
  and usage); keys it lacks are left alone.
* `on_layout(layout)`: `k3serve_parallel_layout{tp, dp, ep, sp, nnodes} 1`, once at start (what the engine runs:
  workers/engine/parallel/launcher.py parallel_layout).
"""

from __future__ import annotations

from dataclasses import dataclass

from k3serve.common.metrics_catalog import build


@dataclass
class _ReqTiming:
    arrival: float
    prompt_len: int
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0


# per-DP-rank gauge -> its key in each of DPEngine.stats()["dp_ranks"] (workers/engine/parallel/dp_front.py)
_PER_DP_RANK = {"k3serve_dp_rank_num_requests_running": "running", "k3serve_dp_rank_num_requests_waiting": "waiting",
                "k3serve_dp_rank_kv_cache_usage_perc": "kv_usage"}

# (catalog counter, extra labels) -> the cumulative key of LLMEngine.stats() it follows.
_CUMULATIVE: dict[tuple[str, tuple], str] = {
    ("vllm:num_preemptions", ()): "num_preemptions",
    ("vllm:prefix_cache_queries", ()): "prefix_cache_queries",
    ("vllm:prefix_cache_hits", ()): "prefix_cache_hits",
    # every lookup queries both group kinds with the same tokens
    ("k3serve_prefix_cache_group_queries_tokens", (("group", "mla"),)): "prefix_cache_queries",
    ("k3serve_prefix_cache_group_queries_tokens", (("group", "kda"),)): "prefix_cache_queries",
    ("k3serve_prefix_cache_group_hits_tokens", (("group", "mla"),)): "prefix_cache_mla_hits",
    ("k3serve_prefix_cache_group_hits_tokens", (("group", "kda"),)): "prefix_cache_kda_hits",
    ("k3serve_kda_snapshots_stored", ()): "kda_snapshots_stored",
    ("k3serve_kda_snapshots_evicted", ()): "kda_snapshots_evicted",
    ("k3serve_prefill_tokens_computed", ()): "prefill_tokens_computed",
    ("k3serve_prefill_tokens_skipped", ()): "prefill_tokens_skipped",
    # speculative decoding (present only with speculative_config)
    ("vllm:spec_decode_num_drafts", ()): "spec_decode_num_drafts",
    ("vllm:spec_decode_num_draft_tokens", ()): "spec_decode_num_draft_tokens",
    ("vllm:spec_decode_num_accepted_tokens", ()): "spec_decode_num_accepted_tokens",
    # the host-memory offload tier (present only with --kv-offload-memory)
    ("k3serve_kv_offload_hit_tokens", ()): "kv_offload_hit_tokens",
    ("k3serve_kv_offload_stored_pages", ()): "kv_offload_stored_blocks",
    ("k3serve_kv_offload_stored_bytes", ()): "kv_offload_stored_bytes",
    ("k3serve_kv_offload_loaded_bytes", ()): "kv_offload_loaded_bytes",
    ("k3serve_kv_offload_evictions", ()): "kv_offload_evictions",
    ("k3serve_kv_offload_failed_loads", ()): "kv_offload_failed_loads",
}


def _queue_time(out, st: _ReqTiming, t_start: float) -> float:
    """Seconds from arrival to first schedule: the engine's own timestamps when it reports them
    (`metrics["first_scheduled_time"] - metrics["arrival_time"]`, or `metrics["queue_time"]`), else the
    start of the step that produced the first tokens."""
    m = out.metrics if isinstance(out.metrics, dict) else {}
    if m.get("queue_time") is not None:
        return float(m["queue_time"])
    if m.get("first_scheduled_time") is not None and m.get("arrival_time") is not None:
        return float(m["first_scheduled_time"]) - float(m["arrival_time"])
    return t_start - st.arrival


class EngineMetrics:
    """Catalog metrics of one engine, registered in `registry` (a prometheus CollectorRegistry)."""

    def __init__(self, registry, model_name: str):
        self.registry = registry
        self.model_name = model_name
        self.m = build(registry, "worker")
        self._reqs: dict[str, _ReqTiming] = {}
        self._cumulative: dict[tuple, float] = {}

    def _metric(self, name: str):
        return self.m[name].labels(model_name=self.model_name)

    # --- events -------------------------------------------------------------------------------
    def on_arrival(self, rid: str, prompt_len: int, t: float) -> None:
        self._reqs[rid] = _ReqTiming(arrival=t, prompt_len=prompt_len)

    def on_step(self, outputs, t_start: float, t_end: float) -> None:
        """`outputs`: the RequestOutputs of one engine step; timestamps from the same monotonic clock."""
        self._metric("k3serve_engine_step_seconds").observe(max(0.0, t_end - t_start))
        for out in outputs:
            st = self._reqs.get(out.request_id)
            if st is None:
                continue
            total = sum(len(c.token_ids) for c in out.outputs)
            new = total - st.num_tokens
            if new > 0:
                self._metric("vllm:generation_tokens").inc(new)
                if st.first_token is None:
                    self._first_tokens(out, st, t_start)
                    st.first_token = t_end
                    self._metric("vllm:time_to_first_token_seconds").observe(max(0.0, t_end - st.arrival))
                else:
                    self._metric("vllm:inter_token_latency_seconds").observe(max(0.0, t_end - st.last_token))
                st.last_token = t_end
                st.num_tokens = total
            if out.finished:
                reason = next((c.finish_reason for c in out.outputs if c.finish_reason), None) or "stop"
                self._finish(out.request_id, reason, t_end)

    def _first_tokens(self, out, st: _ReqTiming, t_start: float) -> None:
        self._metric("vllm:request_queue_time_seconds").observe(max(0.0, _queue_time(out, st, t_start)))
        self._metric("vllm:prompt_tokens").inc(st.prompt_len)

    def on_abort(self, rid: str, t: float) -> None:
        if rid in self._reqs:
            self._finish(rid, "abort", t)

    def _finish(self, rid: str, reason: str, t: float) -> None:
        st = self._reqs.pop(rid, None)
        if st is None:
            return
        self._metric("vllm:e2e_request_latency_seconds").observe(max(0.0, t - st.arrival))
        self.m["vllm:request_success"].labels(model_name=self.model_name, finished_reason=reason).inc()

    def on_layout(self, layout: dict) -> None:
        """k3serve_parallel_layout = 1 with the engine's layout as labels (parallel/launcher.py parallel_layout)."""
        self.m["k3serve_parallel_layout"].labels(model_name=self.model_name,
                                                 **{k: str(int(v)) for k, v in layout.items()}).set(1)

    def on_stats(self, stats: dict) -> None:
        gauges = {
            "vllm:num_requests_running": "running",
            "vllm:num_requests_waiting": "waiting",
            "vllm:kv_cache_usage_perc": "kv_usage",
            "k3serve_kv_pages_free": "free_pages",
            "k3serve_kda_state_slots_used": "kda_slots_used",
            "k3serve_kda_state_slots_total": "kda_slots_total",
            "k3serve_kv_offload_usage_perc": "kv_offload_usage",
        }
        for metric, key in gauges.items():
            if stats.get(key) is not None:
                self._metric(metric).set(float(stats[key]))
        for rank, per in enumerate(stats.get("dp_ranks") or ()):  # a DEP worker's ranks (parallel/dp_front.py)
            for metric, key in _PER_DP_RANK.items():
                self.m[metric].labels(model_name=self.model_name, engine=str(rank)).set(float(per[key]))
        for (metric, labels), key in _CUMULATIVE.items():
            if stats.get(key) is None:
                continue
            value = float(stats[key])
            delta = value - self._cumulative.get((metric, labels, key), 0.0)
            child = self.m[metric].labels(model_name=self.model_name, **dict(labels))  # exported from 0 on
            if delta > 0:
                child.inc(delta)
            self._cumulative[(metric, labels, key)] = value
        for pos, value in enumerate(stats.get("spec_decode_num_accepted_tokens_per_pos") or ()):
            key = ("vllm:spec_decode_num_accepted_tokens_per_pos", pos)
            child = self.m[key[0]].labels(model_name=self.model_name, position=str(pos))
            if value > self._cumulative.get(key, 0.0):
                child.inc(value - self._cumulative.get(key, 0.0))
            self._cumulative[key] = float(value)
        self._store_series(stats)

    def _store_series(self, stats: dict) -> None:
        """The Mooncake store tier's `kv_store_*` stats (k3serve/kvstore/metrics.py maps them)."""
        from k3serve.kvstore.metrics import series

        for metric, labels, value, kind in series(stats):
            child = self.m[metric].labels(model_name=self.model_name, **labels)
            if kind == "gauge":
                child.set(value)
                continue
            key = (metric, tuple(sorted(labels.items())), "kv_store")
            delta = value - self._cumulative.get(key, 0.0)
            if delta > 0:
                child.inc(delta)
            self._cumulative[key] = value

    @property
    def in_flight(self) -> int:
        return len(self._reqs)
