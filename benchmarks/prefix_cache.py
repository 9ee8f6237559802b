"""Prefix caching on the hybrid (KDA + MLA) cache under eviction pressure: one table, one run.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/prefix_cache.py [--quick] [--sessions 12] [--turns 5]
        [--budget-frac 1.0] [--interval 64] [--unit 16] [--max-num-seqs 8] [--model DIR]

(~3 minutes on 2 shared CPU cores; --quick ~30 s. The issue's 32 sessions x 8 turns is
`--sessions 32 --turns 8`, ~10x longer on the CPU.)

A synthetic agentic trace (`_agentic_trace.py`: every session starts with the same system prompt +
tool list; each turn replays the previous prompt, the model's reply and new text) runs through the
tiny model (float32, CPU, greedy, `--output-tokens` per turn) once per cache configuration. Turn t of
every session is submitted at once, as an agent fleet would, and the engine is stepped until all of
them finish. Every configuration gets the same KV budget: `--budget-frac` x the trace's working set
(every session's final MLA pages + one KDA snapshot each) plus what the running requests hold beyond
it (their running KDA states, a snapshot in flight, a copy-on-write page). The unit-hashed rows store
a new snapshot per session and turn, so they must evict (see the "evicted" columns); `vllm-style`
keeps state only at block boundaries and may fit.

Rows: `off`; `vllm-style/lru` (KV-centric prefix caching as vLLM does it for hybrid models: hash unit
= block, state at every block boundary, hits only at block boundaries); and retention dense (the
KV-centric analogue at unit granularity: a snapshot at every block boundary, plus the prompt end),
interval-N, prompt-end, and prompt-end + Marconi junctions, each with LRU and compute-per-byte
eviction. The script prints what each row means under the table.

A second table runs `--tier-configs` with the host-memory offload tier off and on, both with the
device pool at `--tier-budget-frac` (default 25 %) of the working set and the host tier at
`--tier-host-frac` of it: hit % (device + tier), prefill tokens computed and their ratio to the tier
off, pages stored to the host, host evictions, bytes loaded, wall time, and tokens==off.

Columns: token hit rate (prompt tokens served from the cache / prompt tokens, at first admission),
its ratio to the `dense/lru` row, prefill tokens computed (recomputation after preemption included)
and their ratio to caching off, peak KDA snapshot memory (cached "kda" blocks x page_bytes x
group_size, sampled after every engine step), snapshots stored, cached blocks evicted (all kinds /
KDA), preemptions, wall time (adding requests + engine steps) and its ratio to caching off, and
tokens==off: whether every turn of every session produced the same greedy tokens as caching off.
The script exits 1 when any tokens==off is False (a prefix cache must not change outputs).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _agentic_trace import AgenticTrace, make_trace  # noqa: E402
from _util import print_table  # noqa: E402

from k3serve.sampling_params import SamplingParams  # noqa: E402
from k3serve.workers.llm import LLM  # noqa: E402

HEADERS = ["config", "hit%", "hit/dense", "prefill computed", "computed/off", "peak KDA MiB", "snaps stored",
           "evicted", "evicted KDA", "preempt", "wall s", "wall/off", "tokens==off"]
DENSE_LABEL = "dense/lru"


@dataclass(frozen=True)
class CacheConfig:
    """One row: `label`, what it means, and the LLM(...) cache kwargs it runs with."""

    label: str
    meaning: str
    kwargs: dict = field(default_factory=dict)


@dataclass
class RunResult:
    """What one configuration measured; `outputs[s][t]` are the greedy tokens of turn t of session s."""

    stats: dict
    outputs: list[list[list[int]]]
    peak_kda_bytes: int
    wall_s: float


def cache_configs(unit: int, interval: int, block_size: int) -> list[CacheConfig]:
    """The rows, in table order (caching off first: the other rows' ratios refer to it)."""
    rows = [CacheConfig("off", "prefix caching off: every prompt token is computed",
                        dict(enable_prefix_caching=False))]
    rows.append(CacheConfig(
        "vllm-style/lru", f"KV-centric as vLLM does it: hash unit = block ({block_size}), KDA state at every "
        "block boundary, hits only at block boundaries",
        dict(enable_prefix_caching=True, prefix_match_unit=block_size, prefix_cache_retention_interval="dense",
             prefix_cache_eviction="lru")))
    policies = [
        ("dense", f"KV-centric analogue: KDA snapshot at every block boundary ({block_size}) + prompt end",
         dict(prefix_cache_retention_interval="dense")),
        (f"interval-{interval}", f"KDA snapshot every {interval} tokens + prompt end",
         dict(prefix_cache_retention_interval=interval)),
        ("prompt-end", "KDA snapshot only at each prompt's replay boundary",
         dict(prefix_cache_retention_interval=0)),
        ("prompt-end+marconi", "prompt end + Marconi junctions (snapshot a shared prefix on its second hit)",
         dict(prefix_cache_retention_interval=0, prefix_cache_selective_retention=True)),
    ]
    for name, meaning, kw in policies:
        for ev, ev_name in (("lru", "LRU"), ("compute-per-byte", "compute-per-byte")):
            tag = "lru" if ev == "lru" else "cpb"
            rows.append(CacheConfig(f"{name}/{tag}", f"{meaning}; {ev_name} eviction",
                                    dict(enable_prefix_caching=True, prefix_match_unit=unit,
                                         prefix_cache_eviction=ev, **kw)))
    return rows


def running_reserve_blocks(concurrency: int, kda_groups: int) -> int:
    """Blocks running requests hold beyond the cached working set: per request, its running KDA state
    (one block per KDA group), a new snapshot written while its previous one is still cached, and a
    copy-on-write MLA tail page."""
    return concurrency * (2 * kda_groups + 1)


def kda_snapshot_blocks(eng) -> int:
    """Blocks of the device pool that hold a cached KDA snapshot (each carries exactly one key)."""
    return eng.kv_manager.num_cached_kda_blocks()


def run_trace(llm: LLM, trace: AgenticTrace) -> RunResult:
    """Drive `trace` through `llm.engine` turn by turn, sampling KDA snapshot memory after every step."""
    eng = llm.engine
    block_bytes = eng.layout.page_bytes * eng.layout.group_size
    S, T = trace.num_sessions, trace.num_turns
    outputs: list[list[list[int]]] = [[[] for _ in range(T)] for _ in range(S)]
    prompts: list[list[int] | None] = [None] * S
    peak = 0
    busy = 0.0
    for t in range(T):
        pending: dict[str, int] = {}
        t0 = time.perf_counter()
        for s in range(S):
            prompts[s] = trace.prompt(s, t, prompts[s], outputs[s][t - 1] if t else None)
            rid = f"s{s}-t{t}"
            sp = SamplingParams(temperature=0.0, max_tokens=trace.output_tokens, ignore_eos=True)
            eng.add_request(rid, prompts[s], sp)
            pending[rid] = s
        busy += time.perf_counter() - t0
        while pending:
            t0 = time.perf_counter()
            outs = eng.step()
            busy += time.perf_counter() - t0
            for out in outs:
                if out.finished and out.request_id in pending:
                    outputs[pending.pop(out.request_id)][t] = list(out.outputs[0].token_ids)
            peak = max(peak, kda_snapshot_blocks(eng) * block_bytes)
    stats = eng.stats()
    stats["evicted"] = eng.pool.num_evicted
    return RunResult(stats, outputs, peak, busy)


def _ratio(a: float, b: float) -> float | str:
    return a / b if b else "n/a"


def table_rows(configs: list[CacheConfig], results: dict[str, RunResult]) -> list[list]:
    off = results["off"]
    dense = results.get(DENSE_LABEL)

    def hit_rate(r: RunResult) -> float:
        q = r.stats["prefix_cache_queries"]
        return r.stats["prefix_cache_hits"] / q if q else 0.0

    rows = []
    for c in configs:
        r = results[c.label]
        st = r.stats
        rows.append([
            c.label, 100.0 * hit_rate(r), _ratio(hit_rate(r), hit_rate(dense)) if dense else "n/a",
            st["prefill_tokens_computed"], _ratio(st["prefill_tokens_computed"], off.stats["prefill_tokens_computed"]),
            r.peak_kda_bytes / 2**20, st["kda_snapshots_stored"], st["evicted"], st["kda_snapshots_evicted"],
            st["num_preemptions"], r.wall_s, _ratio(r.wall_s, off.wall_s), r.outputs == off.outputs,
        ])
    return rows


TIER_HEADERS = ["tier config", "host tier", "hit% (device+tier)", "device hit%", "tier hit tokens",
                "prefill computed", "computed/tier-off", "stored pages", "host evictions", "loaded MiB", "wall s",
                "wall/tier-off", "tokens==off"]


def tier_rows(labels: list[str], results: dict[str, RunResult], off: RunResult) -> list[list]:
    """Per config: the tier off and on at the same (small) device budget."""
    rows = []
    for label in labels:
        base = results[(label, False)]
        for on in (False, True):
            r = results[(label, on)]
            st = r.stats
            q = st["prefix_cache_queries"] or 1
            tier = st.get("kv_offload_hit_tokens", 0)
            rows.append([
                label, "on" if on else "off", 100.0 * (st["prefix_cache_hits"] + tier) / q,
                100.0 * st["prefix_cache_hits"] / q, tier, st["prefill_tokens_computed"],
                _ratio(st["prefill_tokens_computed"], base.stats["prefill_tokens_computed"]),
                st.get("kv_offload_stored_blocks", 0), st.get("kv_offload_evictions", 0),
                st.get("kv_offload_loaded_bytes", 0) / 2**20, r.wall_s, _ratio(r.wall_s, base.wall_s),
                r.outputs == off.outputs,
            ])
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="small trace (defaults 4 sessions x 3 turns, 2 output tokens) for smoke runs")
    ap.add_argument("--sessions", type=int, default=None, help="sessions (default 12; --quick 4)")
    ap.add_argument("--turns", type=int, default=None, help="turns per session (default 5; --quick 3)")
    ap.add_argument("--shared-len", type=int, default=None, help="system prompt + tool list tokens (default 256)")
    ap.add_argument("--new-min", type=int, default=None, help="min new tokens per turn (default 16)")
    ap.add_argument("--new-max", type=int, default=None, help="max new tokens per turn (default 48; --quick 32)")
    ap.add_argument("--output-tokens", type=int, default=None, help="greedy tokens per turn (default 4; --quick 2)")
    ap.add_argument("--budget-frac", type=float, default=1.0,
                    help="KV budget as a fraction of the trace's working set (default 1.0)")
    ap.add_argument("--unit", type=int, default=16, help="prefix_match_unit of the unit-hashed rows")
    ap.add_argument("--interval", type=int, default=64, help="N of the interval-N retention rows")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0, help="trace seed")
    ap.add_argument("--tier-budget-frac", type=float, default=0.25,
                    help="device KV budget of the host-tier rows, as a fraction of the working set (default 0.25)")
    ap.add_argument("--tier-host-frac", type=float, default=2.0,
                    help="host tier size (--kv-offload-memory) as a fraction of the working set (default 2.0)")
    ap.add_argument("--tier-configs", nargs="*", default=None,
                    help="rows run with the host tier off and on (default prompt-end/lru dense/lru; --quick "
                         "prompt-end/lru); none: skip the tier table")
    ap.add_argument("--model", default=None, help="model directory (default: the tiny preset, generated once)")
    args = ap.parse_args(argv)
    small = dict(sessions=4, turns=3, shared_len=256, new_min=16, new_max=32, output_tokens=2)
    full = dict(sessions=12, turns=5, shared_len=256, new_min=16, new_max=48, output_tokens=4)
    for k, v in (small if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.tier_configs is None:
        args.tier_configs = ["prompt-end/lru"] if args.quick else ["prompt-end/lru", "dense/lru"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.model is None:
        from k3serve.workers.model.paths import ensure_tiny_model

        args.model = str(ensure_tiny_model())
    trace = make_trace(args.sessions, args.turns, args.shared_len, args.new_min, args.new_max,
                       args.output_tokens, seed=args.seed)
    max_len = trace.max_length() + 16
    common = dict(dtype="float32", device="cpu", skip_tokenizer_init=True, max_model_len=max_len,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)

    # warm-up on a throwaway engine (first-call costs must not land on the first row) + the layout
    warm = LLM(args.model, **common)
    warm.generate([trace.shared[:32] or [11]], SamplingParams(temperature=0.0, max_tokens=2))
    layout = warm.engine.layout
    del warm
    B, block_bytes, n_kda = layout.block_size, layout.bytes_per_block, len(layout.kda_groups)
    working_set = trace.working_set_blocks(B, n_kda)
    concurrency = min(trace.num_sessions, args.max_num_seqs)
    reserve = running_reserve_blocks(concurrency, n_kda)
    min_blocks = layout.min_blocks_for(max_len, True) - 1
    budget_blocks = max(math.ceil(args.budget_frac * working_set) + reserve, min_blocks)
    kv_bytes = (budget_blocks + 1) * block_bytes  # + the null block

    print("command: PYTHONSAFEPATH=1 " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    print(f"trace: {trace.num_sessions} sessions x {trace.num_turns} turns, shared prefix {len(trace.shared)} "
          f"tokens, {args.new_min}-{args.new_max} new tokens + {trace.output_tokens} output tokens per turn, "
          f"{trace.total_prompt_tokens()} prompt tokens in all, longest sequence {trace.max_length()}")
    print(f"model: {args.model} (float32, CPU, greedy); block_size {B}, page {layout.page_bytes} B x "
          f"{layout.group_size} layers = {block_bytes} B per block; a KDA snapshot = {n_kda} blocks")
    print(f"budget: kv_cache_memory={kv_bytes} B ({kv_bytes / 2**20:.2f} MiB) = {budget_blocks} usable blocks "
          f"= {args.budget_frac:g} x the working set of {working_set} blocks (every session's final MLA pages "
          f"+ one KDA snapshot each) + {reserve} blocks for {concurrency} running requests; max_num_seqs "
          f"{args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}", flush=True)

    configs = cache_configs(args.unit, args.interval, B)
    results: dict[str, RunResult] = {}
    for c in configs:
        llm = LLM(args.model, kv_cache_memory=kv_bytes, **common, **c.kwargs)
        results[c.label] = run_trace(llm, trace)
        del llm
    print()
    print_table(HEADERS, table_rows(configs, results))
    print()
    print("rows:")
    for c in configs:
        print(f"  {c.label}: {c.meaning}")
    print(f"ratios: hit/dense vs the {DENSE_LABEL} row; computed/off and wall/off vs the off row")
    bad = [c.label for c in configs if results[c.label].outputs != results["off"].outputs]
    if args.tier_configs:
        by_label = {c.label: c for c in configs}
        tier_blocks = max(math.ceil(args.tier_budget_frac * working_set) + reserve, min_blocks)
        tier_kv = (tier_blocks + 1) * block_bytes
        host_bytes = max(1, math.ceil(args.tier_host_frac * working_set)) * block_bytes
        tier_results: dict[tuple[str, bool], RunResult] = {}
        for label in args.tier_configs:
            for on in (False, True):
                extra = dict(kv_offload_memory=host_bytes) if on else {}
                llm = LLM(args.model, kv_cache_memory=tier_kv, **common, **by_label[label].kwargs, **extra)
                tier_results[(label, on)] = run_trace(llm, trace)
                del llm
        print()
        print(f"host-memory offload tier (--kv-offload-memory {host_bytes} B = {args.tier_host_frac:g} x the working "
              f"set): device budget {tier_kv} B = {tier_blocks} usable blocks = {args.tier_budget_frac:g} x the "
              f"working set + the running reserve; the tier off and on, same run")
        print_table(TIER_HEADERS, tier_rows(args.tier_configs, tier_results, results["off"]))
        print("hit% (device+tier): prompt tokens from the device cache at first admission + tokens loaded from the "
              "host tier (every admission) / prompt tokens; computed/tier-off and wall/tier-off vs the same config "
              "with the tier off")
        bad += [f"{lab} (tier {'on' if on else 'off'})" for (lab, on), r in tier_results.items()
                if r.outputs != results["off"].outputs]
    if bad:
        print(f"ERROR: greedy outputs differ from caching off for: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
