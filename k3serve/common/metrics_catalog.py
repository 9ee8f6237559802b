"""The one catalog of every metric k3serve exports.

Components register their metrics from here (`build(registry, component)`); the Grafana dashboards
and their tests read the same catalog, so a panel can only query a name that exists.
Names keep vLLM's spelling where the meaning is the same, so existing vLLM dashboards work
(prometheus-client renders `vllm:` names unchanged); what is new is `k3serve_*`.

`name` is the name as scraped for gauges and histograms; counters are declared without the
`_total` suffix that prometheus-client appends (see `scraped_names`).
"""

from __future__ import annotations

from dataclasses import dataclass

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
BYTES_BUCKETS = tuple(float(2 ** i) for i in range(10, 36, 2))


@dataclass(frozen=True)
class MetricSpec:
    name: str
    type: str  # counter | gauge | histogram
    help: str
    labels: tuple[str, ...] = ()
    components: tuple[str, ...] = ("worker",)
    buckets: tuple[float, ...] | None = None

    def scraped_names(self) -> tuple[str, ...]:
        if self.type == "counter":
            return (self.name + "_total", self.name + "_created")
        if self.type == "histogram":
            return tuple(self.name + s for s in ("_bucket", "_count", "_sum", "_created"))
        return (self.name,)


_W = ("worker",)
_R = ("router",)
_O = ("operator",)
_M = ("model_name",)

CATALOG: tuple[MetricSpec, ...] = (
    # --- engine (vLLM names) ---
    MetricSpec("vllm:num_requests_running", "gauge", "Requests in the running batch.", _M, _W),
    MetricSpec("vllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled.", _M, _W),
    MetricSpec("vllm:kv_cache_usage_perc", "gauge", "Fraction of KV-cache pages in use (1 = full).", _M, _W),
    MetricSpec("vllm:num_preemptions", "counter", "Requests preempted (recompute).", _M, _W),
    MetricSpec("vllm:prompt_tokens", "counter", "Prompt tokens processed.", _M, _W),
    MetricSpec("vllm:generation_tokens", "counter", "Generated tokens.", _M, _W),
    MetricSpec("vllm:request_success", "counter", "Finished requests by finish reason.",
               ("model_name", "finished_reason"), _W),
    MetricSpec("vllm:time_to_first_token_seconds", "histogram", "Time to first token.", _M, _W + _R,
               LATENCY_BUCKETS),
    MetricSpec("vllm:inter_token_latency_seconds", "histogram", "Time between output tokens.", _M, _W + _R,
               LATENCY_BUCKETS),
    MetricSpec("vllm:e2e_request_latency_seconds", "histogram", "End-to-end request latency.", _M, _W + _R,
               LATENCY_BUCKETS),
    MetricSpec("vllm:request_queue_time_seconds", "histogram", "Time spent waiting before first schedule.",
               _M, _W, LATENCY_BUCKETS),
    MetricSpec("vllm:prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache.", _M, _W),
    MetricSpec("vllm:prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache.", _M, _W),
    # speculative decoding (workers/engine/spec/; counted by LLMEngine.spec_stats)
    MetricSpec("vllm:spec_decode_num_drafts", "counter", "Verify steps of a request with at least one draft.", _M, _W),
    MetricSpec("vllm:spec_decode_num_draft_tokens", "counter", "Draft tokens proposed and verified.", _M, _W),
    MetricSpec("vllm:spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted.", _M, _W),
    MetricSpec("vllm:spec_decode_num_accepted_tokens_per_pos", "counter",
               "Draft tokens accepted at each draft position (0 = the first draft).", _M + ("position",), _W),
    # --- engine (k3serve) ---
    MetricSpec("k3serve_kda_state_slots_used", "gauge", "KDA state pages held by requests and the cache.", _M, _W),
    MetricSpec("k3serve_kda_state_slots_total", "gauge", "KDA state pages the pool can hold.", _M, _W),
    MetricSpec("k3serve_kv_pages_free", "gauge", "Free pages in the hybrid block pool.", _M, _W),
    MetricSpec("k3serve_prefix_cache_group_queries_tokens", "counter",
               "Tokens queried in the prefix cache per cache group kind.", ("model_name", "group"), _W),
    MetricSpec("k3serve_prefix_cache_group_hits_tokens", "counter",
               "Tokens hit in the prefix cache per cache group kind (mla | kda).", ("model_name", "group"), _W),
    MetricSpec("k3serve_kda_snapshots_stored", "counter", "KDA state snapshots registered in the cache.", _M, _W),
    MetricSpec("k3serve_kda_snapshots_evicted", "counter", "KDA state snapshots evicted.", _M, _W),
    MetricSpec("k3serve_prefill_tokens_computed", "counter", "Prompt tokens computed by prefill.", _M, _W),
    MetricSpec("k3serve_prefill_tokens_skipped", "counter", "Prompt tokens skipped thanks to cache hits.", _M, _W),
    MetricSpec("k3serve_engine_step_seconds", "histogram", "Wall time of one engine step.", _M, _W,
               LATENCY_BUCKETS),
    # per data-parallel rank of a DEP worker (workers/engine/parallel/dp_front.py); `engine` = the DP rank, vLLM's
    # label for its DP engines (the vllm: gauges above stay the worker's totals, labelled model_name only)
    MetricSpec("k3serve_dp_rank_num_requests_running", "gauge", "Requests in one data-parallel rank's running batch.",
               ("model_name", "engine"), _W),
    MetricSpec("k3serve_dp_rank_num_requests_waiting", "gauge", "Requests waiting on one data-parallel rank.",
               ("model_name", "engine"), _W),
    MetricSpec("k3serve_dp_rank_kv_cache_usage_perc", "gauge",
               "Fraction of one data-parallel rank's KV-cache pages in use (1 = full).", ("model_name", "engine"), _W),
    # --- host-memory offload tier (workers/engine/kv_connector/host_offload.py) ---
    MetricSpec("k3serve_kv_offload_hit_tokens", "counter", "Prompt tokens loaded from the host-memory KV tier.",
               _M, _W),
    MetricSpec("k3serve_kv_offload_stored_pages", "counter",
               "Pages copied to the host tier when the device cache evicted them.", _M, _W),
    MetricSpec("k3serve_kv_offload_stored_bytes", "counter", "Bytes copied device -> host by the host tier.", _M, _W),
    MetricSpec("k3serve_kv_offload_loaded_bytes", "counter", "Bytes copied host -> device by the host tier.", _M, _W),
    MetricSpec("k3serve_kv_offload_evictions", "counter", "Pages evicted from the host tier.", _M, _W),
    MetricSpec("k3serve_kv_offload_failed_loads", "counter",
               "Host-tier loads that failed (the request recomputed).", _M, _W),
    MetricSpec("k3serve_kv_offload_usage_perc", "gauge", "Fraction of host-tier slots holding cached pages.", _M, _W),
    # --- P/D transfers and store ---
    MetricSpec("k3serve_kv_transfer_bytes", "counter", "Bytes moved by KV transfers per view (mla | kda_conv | kda_ssm).",
               ("model_name", "view"), _W),
    MetricSpec("k3serve_kv_transfer_seconds", "histogram", "Latency of one request's KV transfer.", _M, _W,
               LATENCY_BUCKETS),
    MetricSpec("k3serve_kv_transfer_failures", "counter", "KV transfers that failed and fell back to recompute.",
               ("model_name", "reason"), _W),
    MetricSpec("k3serve_kv_transfers", "counter",
               "Decode-side P/D requests by outcome (pulled | cached | recomputed).", ("model_name", "outcome"), _W),
    MetricSpec("k3serve_kv_store_hits_tokens", "counter", "Prompt tokens loaded from the Mooncake store.", _M, _W),
    MetricSpec("k3serve_kv_store_puts", "counter", "Objects offered to the Mooncake store.", ("model_name", "kind"), _W),
    MetricSpec("k3serve_kv_store_lookups", "counter",
               "Store lookups at admission by result (hit | miss | skipped: store down, busy or past the deadline).",
               ("model_name", "result"), _W),
    MetricSpec("k3serve_kv_store_group_hits_tokens", "counter",
               "Prompt tokens loaded from the Mooncake store per cache group kind (mla | kda).",
               ("model_name", "group"), _W),
    MetricSpec("k3serve_kv_store_bytes", "counter", "Bytes moved to (put) and from (get) the Mooncake store.",
               ("model_name", "direction"), _W),
    MetricSpec("k3serve_kv_store_failures", "counter",
               "Store operations that failed, by operation (exists | get | put | load) and code "
               "(rpc_failed, not_found, no_space, deadline, unavailable, staging, ...).",
               ("model_name", "op", "code"), _W),
    MetricSpec("k3serve_kv_store_deadline_misses", "counter",
               "Store calls that did not answer within the deadline (the request went on without the store).",
               ("model_name", "op"), _W),
    MetricSpec("k3serve_kv_store_healthy", "gauge", "1 while the Mooncake store is attached and healthy, else 0.",
               _M, _W),
    MetricSpec("k3serve_kv_store_wait_max_seconds", "gauge",
               "Longest time a request waited on one store call (bounded by the store deadline).", _M, _W),
    MetricSpec("k3serve_parallel_layout", "gauge",
               "1, labelled with the parallel layout the worker's engine runs, read from the runner it built: "
               "tp, dp (group ranks), ep and sp (1 = on), nnodes (workers/engine/parallel/launcher.py).",
               ("model_name", "tp", "dp", "ep", "sp", "nnodes"), _W),
    # --- a non-leader node of a multi-node group (workers/engine/parallel/node_process.py) ---
    MetricSpec("k3serve_node_ranks_ready", "gauge",
               "Ranks of this non-leader node that have loaded their shard and are alive.", (), ("node",)),
    # --- router ---
    MetricSpec("k3serve_router_requests", "counter", "Requests received by the gateway.",
               ("model_name", "endpoint", "status"), _R),
    MetricSpec("k3serve_router_retries", "counter", "Requests retried on another worker.", ("model_name", "reason"), _R),
    MetricSpec("k3serve_router_workers", "gauge", "Healthy workers per role.", ("role",), _R),
    MetricSpec("k3serve_router_prefix_hit_tokens", "histogram", "Reusable prefix tokens of the chosen worker.",
               _M, _R, tuple(float(2 ** i) for i in range(0, 18))),
    MetricSpec("k3serve_router_decisions", "counter", "Routing decisions by policy and reason.",
               ("model_name", "policy", "reason"), _R),
    MetricSpec("k3serve_router_decision_seconds", "histogram", "Wall time of one routing decision.", _M, _R,
               (0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05)),
    MetricSpec("k3serve_router_hit_tokens", "counter",
               "Prompt tokens the workers reported cached, by source (worker | host | store).",
               ("model_name", "source"), _R),
    MetricSpec("k3serve_router_resumptions", "counter",
               "Sequences continued on another worker after one failed mid-stream.", _M, _R),
    MetricSpec("k3serve_router_errors", "counter", "Requests that ended in an error, by class.",
               ("model_name", "class"), _R),
    # --- operator ---
    MetricSpec("k3serve_operator_reconciles", "counter", "Reconcile handler runs.", ("handler", "result"), _O),
    MetricSpec("k3serve_operator_reconcile_errors", "counter", "Reconcile handler errors.", ("handler",), _O),
    MetricSpec("k3serve_operator_deployments", "gauge", "KimiK3Deployments by condition.", ("condition",), _O),
    MetricSpec("k3serve_operator_reconcile_seconds", "histogram", "Wall time of one reconcile handler run.",
               ("handler",), _O, LATENCY_BUCKETS),
)

BY_NAME: dict[str, MetricSpec] = {m.name: m for m in CATALOG}


def all_scraped_names() -> set[str]:
    out: set[str] = set()
    for m in CATALOG:
        out.add(m.name)
        out.update(m.scraped_names())
    return out


def build(registry, component: str) -> dict:
    """Create the prometheus-client objects of one component in `registry`; returns name -> metric."""
    import prometheus_client as pc

    made = {}
    for m in CATALOG:
        if component not in m.components:
            continue
        kw = dict(name=m.name, documentation=m.help, labelnames=m.labels, registry=registry)
        if m.type == "counter":
            made[m.name] = pc.Counter(**kw)
        elif m.type == "gauge":
            made[m.name] = pc.Gauge(**kw)
        elif m.type == "histogram":
            made[m.name] = pc.Histogram(buckets=m.buckets or pc.Histogram.DEFAULT_BUCKETS, **kw)
        else:  # pragma: no cover - guarded by tests on the catalog
            raise ValueError(f"{m.name}: unknown metric type {m.type}")
    return made
