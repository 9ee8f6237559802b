"""Prefix-cache metrics as scraped from `k3serve serve`'s and `k3serve worker`'s /metrics: the real engine on
the tiny model, built from each command's own CLI options (prefix caching, dense KDA retention, a small KV
budget), after a workload that hits the cache, evicts and preempts; every value equals `engine.stats()`."""

import argparse
import asyncio
import random
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from k3serve.sampling_params import SamplingParams
from k3serve.workers import serve as serve_cli
from k3serve.workers import worker as worker_cli
from k3serve.workers.engine.cache_layout import plan_cache_layout
from k3serve.workers.engine_cli import start_engine
from k3serve.workers.model.config import K3Config
from k3serve.workers.serving.app import build_app

MAX_LEN, BLOCK = 128, 16
NAME = "tiny-metrics"

# scraped sample -> (labels beyond model_name, the engine.stats() key it must equal)
EXPECTED = {
    "vllm:prefix_cache_queries_total": ({}, "prefix_cache_queries"),
    "vllm:prefix_cache_hits_total": ({}, "prefix_cache_hits"),
    "k3serve_prefix_cache_group_queries_tokens_total": ({"group": "mla"}, "prefix_cache_queries"),
    "k3serve_prefix_cache_group_queries_tokens_total#kda": ({"group": "kda"}, "prefix_cache_queries"),
    "k3serve_prefix_cache_group_hits_tokens_total": ({"group": "mla"}, "prefix_cache_mla_hits"),
    "k3serve_prefix_cache_group_hits_tokens_total#kda": ({"group": "kda"}, "prefix_cache_kda_hits"),
    "k3serve_kda_snapshots_stored_total": ({}, "kda_snapshots_stored"),
    "k3serve_kda_snapshots_evicted_total": ({}, "kda_snapshots_evicted"),
    "k3serve_prefill_tokens_computed_total": ({}, "prefill_tokens_computed"),
    "k3serve_prefill_tokens_skipped_total": ({}, "prefill_tokens_skipped"),
    "k3serve_kda_state_slots_used": ({}, "kda_slots_used"),
    "k3serve_kda_state_slots_total": ({}, "kda_slots_total"),
    "k3serve_kv_pages_free": ({}, "free_pages"),
    "vllm:num_preemptions_total": ({}, "num_preemptions"),
}


OFFLOAD = {  # with `serve --kv-offload-memory`: the host tier's series
    "k3serve_kv_offload_hit_tokens_total": ({}, "kv_offload_hit_tokens"),
    "k3serve_kv_offload_stored_pages_total": ({}, "kv_offload_stored_blocks"),
    "k3serve_kv_offload_stored_bytes_total": ({}, "kv_offload_stored_bytes"),
    "k3serve_kv_offload_loaded_bytes_total": ({}, "kv_offload_loaded_bytes"),
    "k3serve_kv_offload_evictions_total": ({}, "kv_offload_evictions"),
    "k3serve_kv_offload_usage_perc": ({}, "kv_offload_usage"),
}


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _scraped(samples, key):
    labels, _ = {**EXPECTED, **OFFLOAD}[key]
    name = key.split("#")[0]
    return samples.get((name, tuple(sorted({"model_name": NAME, **labels}.items()))))


def _engine_options(model_dir):
    layout = plan_cache_layout(K3Config.from_pretrained(str(model_dir)), torch.float32, BLOCK)
    budget = (layout.min_blocks_for(MAX_LEN, True) + 4) * layout.bytes_per_block
    return ["--served-model-name", NAME, "--enable-prefix-caching", "--block-size", str(BLOCK),
            "--prefix-match-unit", "8", "--prefix-cache-retention-interval", "dense",
            "--prefix-cache-eviction", "compute-per-byte", "--max-model-len", str(MAX_LEN),
            "--kv-cache-memory", str(budget), "--max-num-batched-tokens", "48", "--dtype", "float32"]


async def _workload(aeng):
    rng = random.Random(2)
    system = [rng.randrange(576) for _ in range(48)]

    async def one(i, prompt):
        sp = SamplingParams(max_tokens=rng.randint(20, 40), temperature=0.0, ignore_eos=True)
        return [o async for o in aeng.generate(f"m{i}", prompt, sp)][-1]

    prompts = [system[: 16 * (1 + i % 3)] + [rng.randrange(576) for _ in range(8)] for i in range(6)]
    outs = []
    for r in range(2):  # the second round re-sends the same prompts: cache hits
        outs += await asyncio.gather(*(one(f"{r}-{i}", p) for i, p in enumerate(prompts)))
    return outs


@pytest.mark.parametrize("command", ["serve", "worker", "serve-offload"])
def test_prefix_cache_metrics_scraped(tiny_model_dir, command):
    torch.set_num_threads(1)
    p = argparse.ArgumentParser()
    expected = {**EXPECTED, **OFFLOAD} if command == "serve-offload" else EXPECTED
    if command.startswith("serve"):
        serve_cli.configure(p)
        extra = ["--kv-offload-memory", "64M"] if command == "serve-offload" else []
        args = p.parse_args([str(tiny_model_dir), "--port", "0", *_engine_options(tiny_model_dir), *extra])
    else:
        worker_cli.configure(p)
        args = p.parse_args(["--model", str(tiny_model_dir), "--grpc-port", "0", "--metrics-port", "0",
                             *_engine_options(tiny_model_dir)])
    served = start_engine(args, str(tiny_model_dir))
    aeng = served.async_engine
    if command.startswith("serve"):
        app = build_app(aeng, served_model_names=served.model_names, registry=served.registry)
    else:
        app = worker_cli.build_metrics_app(aeng, served.registry)

    async def go():
        outs = await _workload(aeng)
        assert all(o.finished for o in outs) and any(o.num_cached_tokens > 0 for o in outs)
        stats = await aeng.run_on_engine_thread(lambda e: e.stats())
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            deadline = time.monotonic() + 10  # counters follow the engine's stats refreshes (idle: at once)
            while True:
                r = await client.get("/metrics")
                assert r.status_code == 200
                samples = _samples(r.text)
                got = {k: _scraped(samples, k) for k in expected}
                want = {k: float(stats[key]) for k, (_, key) in expected.items()}
                if got == want or time.monotonic() > deadline:
                    return stats, got, want

    try:
        stats, got, want = asyncio.run(asyncio.wait_for(go(), 120))
    finally:
        aeng.shutdown()
    assert got == want
    for key in ("prefix_cache_hits", "prefix_cache_mla_hits", "prefix_cache_kda_hits", "kda_snapshots_stored",
                "kda_snapshots_evicted", "prefill_tokens_skipped", "num_preemptions"):
        assert stats[key] > 0, f"the workload was meant to produce {key}"
    if command == "serve-offload":
        for key in ("kv_offload_hit_tokens", "kv_offload_stored_blocks", "kv_offload_loaded_bytes"):
            assert stats[key] > 0, f"the workload was meant to produce {key}"
