"""Engine decode throughput for the `small` preset next to the memory roofline of the same step.

    PYTHONSAFEPATH=1 python benchmarks/decode_roofline.py [--batches 1 8 64] [--prompt 256] [--steps 32]
        [--modes graphs graphs-s4 graphs:NAME=VALUE,... graphs-cublas eager] [--profile] [--breakdown]
        [--max-num-batched-tokens 16384] [--model DIR]

Makes the `small` checkpoint on the GPU (make_model; or loads `--model DIR`, e.g. the checkpoint
`vs_transformers.py --save-model DIR` writes, to see the model of that comparison's decode steps), measures the device copy bandwidth, then per batch
size B runs `LLM(..., device="cuda")`: the time of a generate with max_tokens = 1 + steps minus the time of
one with max_tokens = 1 (same prompts) gives the decode time of `steps` steps. Roofline of one step =
bytes that must move / copy bandwidth, with bytes = every non-expert weight once + the expected number of
distinct active experts per MoE layer (E·(1-(1-k/E)^B)) x their packed bytes + KDA recurrent and conv
state read+write per sequence and KDA layer + the MLA latent cache read per sequence and MLA layer.
Prints one table: B, decode tokens/s, roofline tokens/s, fraction. The engine replays decode steps from
captured CUDA graphs by default on CUDA; pass --enforce-eager to compare without them. A full generate per
batch size runs first as warm-up (Triton compiles, graph captures), outside the timed region. The token budget
per step defaults to 16384 so that the whole batch prefills in one step and every timed step is a decode step
(with the engine's 2048, B=64 requests start decoding while others still prefill: mixed steps, run eagerly).
`--profile` adds, per batch size, the GPU kernels of one timed generate (µs per decode step) and the host's
share of a step (wall time per step minus kernel time per step).

`graphs-s6` is `graphs` as session 6 left it: the sampler on every decode step (no argmax in the graph:
workers/engine/model_runner.py GRAPH_GREEDY off), one RequestOutput per request per step (LLM.final_outputs_only
off), token-by-token detokenization (LLMEngine.defer_detokenization off), the MoE's accumulator zeroed by a fill kernel (kernels/triton/moe.py GEMV1_ZEROS_OUT and DOT1_ZEROS_OUT off) and the MLA gate's
sigmoid between two casts (workers/engine/k3_forward.py GATE_SIGMOID_16BIT off), so session 7's changes show side
by side in one run. `graphs-s4` is `graphs`
with the MoE as session 4 left it (kernels/triton/moe.py: `route_blocks` by PyTorch's
sort/scan/scatter, the decode path's combine by fp32 atomics), so the MoE changes of session 6 show side by side
in one run. `graphs:NAME=VALUE,...` is `graphs` with module constants of kernels/triton/moe.py set (e.g.
`graphs:GEMV_COMBINE=atomic`, `graphs:AUTO_GEMV_MAX_PAIRS=32`; an int where VALUE parses as one); `--breakdown`
skips those modes.

`--breakdown` splits a graph-replayed decode step three ways, per batch size: (1) the host's phases of a real
step, timed by wrapping the engine's own calls (scheduler.schedule, the runner's input preparation, the graph
launch, the sampler or the graph's greedy ids, each including its wait for the GPU, scheduler.update_from_output,
the whole `step()`, and the cyclic GC's collections: their count and µs per step); (2) the
GPU's own time, by replaying the captured graph alone back to back on the last real step's inputs (kernels +
the gaps between the graph's kernels, no host work); (3) the kernels' time and count per step and the top
kernels (profiler, last: it slows the CUDA calls made after it).

`--ab MODULE.NAME=A,B` compares the two values of one knob inside ONE process (on an H100 the step time moves by
±15 % from process to process, more than most single changes: docs/kernels-notes.md session 13): an engine per value,
each built, warmed and graph-captured with the knob set to it, then per batch size `--ab-rounds` alternated rounds
(A B, B A, ...) of `--steps` decode steps; printed: each side's median ms per step and the median and range of the
rounds' B/A ratios. E.g. `--model /tmp/gm --batches 32 64 --prompt 512 --ab
k3serve.workers.engine.k3_forward.SHARED_EXPERT_FUSION=0,1`.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _util import SET_HELP, ab_summary, alternate, apply_sets, kernel_breakdown, parse_ab, print_table  # noqa: E402


def copy_bandwidth() -> float:
    a = torch.randn(1 << 28, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        b.copy_(a)
    torch.cuda.synchronize()
    return 20 * 2 * a.numel() * 4 / (time.perf_counter() - t)


def step_bytes(cfg, weights: dict, batch: int, ctx: int) -> float:
    expert_bytes, other = 0, 0
    n_moe = 0
    for name, w in weights.items():
        nb = w.numel() * w.element_size()
        if ".experts." in name:
            expert_bytes += nb
        else:
            other += nb
    for i in range(cfg.num_hidden_layers):
        n_moe += int(cfg.is_moe_layer(i))
    E, k = cfg.num_experts, cfg.num_experts_per_token
    per_expert = expert_bytes / max(1, n_moe * E)
    active = E * (1 - (1 - k / E) ** batch)
    kda_layers = sum(int(cfg.is_kda_layer(i)) for i in range(cfg.num_hidden_layers))
    mla_layers = cfg.num_hidden_layers - kda_layers
    h, d = cfg.kda_num_heads, cfg.kda_head_dim
    state = 2 * (h * d * d * 4 + 3 * h * d * (4 - 1) * 2)  # fp32 state + bf16 conv state, read + write
    mla = ctx * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    return other + n_moe * active * per_expert + batch * (kda_layers * state + mla_layers * mla)


class _PhaseTimer:
    """Wraps callables of live engine objects with host-clock timers (each call's seconds, per phase)."""

    def __init__(self):
        self.t: dict[str, list[float]] = {}
        self._undo: list = []

    def wrap(self, obj, name: str, phase: str) -> None:
        fn = getattr(obj, name)
        own = obj.__dict__.get(name, _PhaseTimer)  # an instance attribute (e.g. the sampler object) to restore

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.t.setdefault(phase, []).append(time.perf_counter() - t0)

        setattr(obj, name, timed)
        self._undo.append((obj, name, own))

    def undo(self) -> None:
        for obj, name, own in reversed(self._undo):
            if own is _PhaseTimer:
                delattr(obj, name)  # the class's method shows through again
            else:
                setattr(obj, name, own)
        self._undo.clear()


def breakdown(llm, prompts, spn, B: int, steps: int, step_us: float, top_kernels: int = 25) -> None:
    """Prints where a graph-replayed decode step of batch B goes (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    eng = llm.engine
    runner = eng.runner
    size = next(c for c in runner.capture_sizes if c >= B)
    g = runner.graphs.get(size)
    if g is None:
        print(f"# breakdown B={B}: no captured graph of size {size}")
        return
    # (1) the host's phases of real steps (first: the profiler below would slow every CUDA call after it)
    pt = _PhaseTimer()
    pt.wrap(eng, "step", "step")
    pt.wrap(eng.scheduler, "schedule", "schedule")
    pt.wrap(eng.scheduler, "update_from_output", "update_from_output")
    pt.wrap(runner.inputs, "prepare_decode", "prepare_decode")
    pt.wrap(runner, "execute", "execute")
    pt.wrap(g.graph, "replay", "replay (launch)")
    pt.wrap(eng, "sampler", "sampler (incl. GPU wait)")
    pt.wrap(runner, "take_greedy_ids", "greedy ids (incl. GPU wait)")
    # every graph size reads its inputs from the start of one staging buffer (model_runner.DecodeStaging): keep
    # a copy of the last size-`size` step's inputs, so the graph replayed alone below reads real ones
    timed_prepare, snap = runner.inputs.prepare_decode, {}

    def prepare_and_keep(sched, n):
        out = timed_prepare(sched, n)
        if n == size:
            snap["buf"] = runner.inputs._decode.device_buf.clone()
        return out

    runner.inputs.prepare_decode = prepare_and_keep  # removed again by pt.undo() (same attribute)
    gc_t: list[float] = []

    def gc_timer(phase, info):
        if phase == "start":
            gc_t.append(-time.perf_counter())
        elif gc_t:
            gc_t[-1] += time.perf_counter()

    gc.callbacks.append(gc_timer)
    try:
        llm.generate(prompts, spn)
        torch.cuda.synchronize()
    finally:
        gc.callbacks.remove(gc_timer)
        pt.undo()
    if "buf" not in snap:
        print(f"# breakdown B={B}: no decode step of size {size}")
        return
    runner.inputs._decode.device_buf.copy_(snap["buf"])
    # (2) the graph alone, replayed back to back
    for _ in range(3):
        g.graph.replay()
    torch.cuda.synchronize()
    reps = 50
    t0 = time.perf_counter()
    for _ in range(reps):
        g.graph.replay()
    torch.cuda.synchronize()
    replay_us = (time.perf_counter() - t0) / reps * 1e6
    # (3) kernels of one replay: time and count
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            g.graph.replay()
        torch.cuda.synchronize()
    kt, kn = 0.0, 0
    per: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            t = getattr(ev, "device_time_total", None) or ev.cuda_time_total
            kt += t
            kn += 1
            e = per.setdefault(ev.name, [0.0, 0])
            e[0] += t
            e[1] += 1
    kt, kn = kt / 5, kn / 5
    top = sorted(per.items(), key=lambda kv: -kv[1][0])[:top_kernels]
    nrep = len(pt.t.get("replay (launch)", []))
    if not nrep:
        print(f"# breakdown B={B}: no decode step replayed the graph")
        return
    print(f"# breakdown B={B} (graph size {size}): step {step_us:.0f} µs wall; graph replayed alone "
          f"{replay_us:.0f} µs = kernels {kt:.0f} µs ({kn:.0f} kernels) + in-graph gaps {replay_us - kt:.0f} µs "
          f"({(replay_us - kt) / max(kn, 1):.2f} µs per kernel); outside the graph {step_us - replay_us:.0f} µs")
    # one call of each phase per step: the median over the steps leaves out the prefill step
    phases = {k: 1e6 * statistics.median(v) for k, v in pt.t.items()}
    nsteps = len(pt.t["step"])
    print(f"#   host phases, median µs per step over {nsteps} steps ({nrep} graph replays): "
          + ", ".join(f"{k} {v:.0f}" for k, v in phases.items())
          + f"; cyclic GC {len(gc_t)} collections, {1e6 * sum(gc_t) / nsteps:.0f} µs per step", flush=True)
    for name, (t, c) in top:
        print(f"#   {t / 5:8.1f} µs  x{c / 5:5.1f}  {name[:100]}")


def host_profile(llm, prompts, spn, steps: int, top: int) -> None:
    """cProfile of one generate: the `top` functions by own time, in µs per decode step (the prefill step included,
    spread over the decode steps; the profiler's own overhead inflates every row alike)."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    llm.generate(prompts, spn)
    torch.cuda.synchronize()
    pr.disable()
    st = pstats.Stats(pr)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
    print(f"#   cProfile, µs per decode step (own / cumulative, calls per step), top {top} by own time:")
    for (fn, line, name), (_cc, nc, tt, ct, _callers) in rows:
        print(f"#   {1e6 * tt / steps:8.1f} {1e6 * ct / steps:8.1f} {nc / steps:6.1f}  {os.path.basename(fn)}:{line}({name})")


def mode_sets(ap, mode: str, moe) -> dict:
    """The kernels/triton/moe.py constants a --modes entry sets (see the module docstring)."""
    if mode == "graphs-s4":
        return {"ROUTE_KERNEL": False, "GEMV_COMBINE": "atomic"}
    if mode == "graphs-s6":
        return {"GEMV1_ZEROS_OUT": False, "DOT1_ZEROS_OUT": False}
    if mode in ("graphs", "graphs-cublas", "eager"):
        return {}
    base, colon, items = mode.partition(":")
    out = {}
    for item in items.split(",") if base == "graphs" and colon else [""]:
        name, eq, value = item.partition("=")
        if not eq or not name.isupper() or not hasattr(moe, name):
            ap.error(f"--modes: {mode!r} is not graphs, eager, graphs-cublas, graphs-s4, graphs-s6 or graphs:NAME=VALUE,... "
                     "with NAME a constant of kernels/triton/moe.py")
        out[name] = int(value) if value.lstrip("-").isdigit() else value
    return out


def batch_prompts(B: int, length: int) -> list[list[int]]:
    """The timed batch: B prompts of `length` token ids, distinct per row (no prefix shared between them)."""
    return [[(7 * i + j) % 500 + 10 for j in range(length)] for i in range(B)]


def decode_seconds(llm, prompts, steps: int) -> float:
    """Seconds of `steps` decode steps of this batch: a generate of 1 + steps tokens minus one of 1 token."""
    from k3serve.sampling_params import SamplingParams

    sp1 = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    spn = SamplingParams(max_tokens=1 + steps, temperature=0.0, ignore_eos=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, sp1)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    llm.generate(prompts, spn)
    torch.cuda.synchronize()
    return (time.perf_counter() - t1) - (t1 - t0)


def ab_decode(ap, args, d: str, ab) -> None:
    """--ab: one engine per side of the knob (built, warmed and graph-captured with the knob at that value; each
    engine's KV cache a quarter of the free memory), then per batch size `alternate`d decode timings."""
    from k3serve.sampling_params import SamplingParams
    from k3serve.workers.llm import LLM

    target, sides = ab
    engines = []
    for value in sides:
        apply_sets(ap, [f"{target}={value}"])
        llm = LLM(d, device="cuda", dtype="bfloat16", max_num_seqs=max(args.batches), kv_cache_memory=0.25,
                  max_model_len=args.prompt + args.steps + 8, max_num_batched_tokens=args.max_num_batched_tokens,
                  skip_tokenizer_init=bool(args.model))
        llm.final_outputs_only = llm.engine.defer_detokenization = True
        for B in args.batches:  # compiles and this batch size's graph capture, under this side's value
            prompts = batch_prompts(B, args.prompt)
            llm.generate(prompts, SamplingParams(max_tokens=1 + args.steps, temperature=0.0, ignore_eos=True))
        engines.append(llm)
    rows = []
    for B in args.batches:
        prompts = batch_prompts(B, args.prompt)

        def measure(side, prompts=prompts):
            apply_sets(ap, [f"{target}={sides[side]}"])  # for what the host reads at run time
            return 1e3 * decode_seconds(engines[side], prompts, args.steps) / args.steps

        a, b, ratio, lo, hi = ab_summary(alternate(measure, args.ab_rounds))
        rows.append([B, f"{a:.3f}", f"{b:.3f}", f"{ratio:.3f}", f"{lo:.3f}-{hi:.3f}"])
        print(f"# --ab {target} B={B}: {a:.3f} ms ({sides[0]}) vs {b:.3f} ms ({sides[1]}) per decode step, "
              f"B/A {ratio:.3f} (rounds {lo:.3f}-{hi:.3f})", flush=True)
    print(f"# --ab {target}: {args.ab_rounds} alternated rounds of {args.steps} decode steps, graphs")
    print_table(["batch", f"ms/step {sides[0]}", f"ms/step {sides[1]}", "B/A median", "B/A range"], rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--modes", nargs="+", default=["graphs", "eager"],
                    help="decode with captured CUDA graphs and/or eagerly (one generated model for all): graphs, "
                         "eager, graphs-cublas (graphs with every projection on cuBLAS: the skinny GEMM off), "
                         "graphs-s4 (graphs with session 4's MoE routing and combine), graphs-s6 (graphs with "
                         "session 6's host path and glue kernels, see the module docstring), "
                         "graphs:NAME=VALUE,... "
                         "(graphs with constants of kernels/triton/moe.py set)")
    ap.add_argument("--enforce-eager", action="store_true", help="same as --modes eager")
    ap.add_argument("--profile", action="store_true", help="per-kernel GPU time of the decode steps")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384,
                    help="the engine's token budget per step (default 16384: 64 x 256-token prompts prefill in one "
                         "step, so every timed step is a pure, graph-replayed decode step; with B x prompt above it "
                         "early requests decode in mixed steps, which run eagerly, and the figure mixes the two)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="after each batch size's timing: cProfile one more generate and print its N functions of "
                         "most own time (the host's Python between graph replays, ms per decode step)")
    ap.add_argument("--set", nargs="*", default=[], metavar="MODULE.NAME=VALUE", help=SET_HELP)
    ap.add_argument("--model", default=None, metavar="DIR",
                    help="an existing checkpoint the engine loads (e.g. vs_transformers.py --save-model DIR) "
                         "instead of the generated `small` one")
    ap.add_argument("--ab", default=None, metavar="MODULE.NAME=A,B",
                    help="A/B of one knob inside this process: two engines (the knob set to A, then to B, while each "
                         "is built and captures its graphs), their decode steps timed in alternated rounds (A B, "
                         "B A, ...; --ab-rounds), per batch size: the median ms per step of each side and the median, "
                         "min and max of the rounds' B/A ratios (graphs mode only)")
    ap.add_argument("--ab-rounds", type=int, default=6, metavar="N", help="alternated rounds of --ab (default 6)")
    ap.add_argument("--breakdown", action="store_true",
                    help="graph replay alone, kernel count, and the host's phases of a decode step")
    args = ap.parse_args()
    from k3serve.sampling_params import SamplingParams
    from k3serve.workers.llm import LLM
    from k3serve.workers.model.config import K3Config
    from k3serve.workers.model.make_model import make_model

    if args.model and not os.path.isfile(os.path.join(args.model, "config.json")):
        print(f"decode_roofline: --model: no config.json in {args.model}", file=sys.stderr)
        return 2
    apply_sets(ap, args.set)
    ab = parse_ab(ap, args.ab) if args.ab else None
    if ab:
        apply_sets(ap, [f"{ab[0]}={ab[1][0]}"])  # checks MODULE.NAME before any GPU work
        if args.ab_rounds < 1:
            ap.error("--ab-rounds must be >= 1")
    bw = copy_bandwidth()
    print(f"# copy bandwidth {bw / 1e12:.2f} TB/s")
    modes = ["eager"] if args.enforce_eager else args.modes
    with tempfile.TemporaryDirectory() as tmp:
        d = args.model or tmp
        cfg = K3Config.from_pretrained(d) if args.model else make_model(d, "small", device="cuda")
        print(f"# model {args.model or 'small (generated)'}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
              f"{cfg.num_experts} experts (top {cfg.num_experts_per_token})", flush=True)
        rows = []
        from k3serve.kernels import triton_ops
        from k3serve.kernels.triton import moe
        from k3serve.workers.engine import k3_forward, model_runner

        if ab:
            ab_decode(ap, args, d, ab)
            return 0
        sets = {mode: mode_sets(ap, mode, moe) for mode in modes}
        defaults = {name: getattr(moe, name) for name in ("ROUTE_KERNEL", "GEMV_COMBINE", "AUTO_GEMV_MAX_PAIRS",
                                                          *(n for v in sets.values() for n in v))}
        for mode in modes:
            triton_ops.SKINNY_GEMM = mode != "graphs-cublas"
            model_runner.GRAPH_GREEDY = mode != "graphs-s6"  # read at each graph capture (a new LLM per mode)
            k3_forward.GATE_SIGMOID_16BIT = mode != "graphs-s6"
            for name, value in {**defaults, **sets[mode]}.items():
                setattr(moe, name, value)
            print(f"# mode {mode}: moe " + ", ".join(f"{n}={getattr(moe, n)!r}" for n in defaults), flush=True)
            llm = LLM(d, device="cuda", dtype="bfloat16", max_num_seqs=max(args.batches),
                      max_model_len=args.prompt + args.steps + 8, enforce_eager=mode == "eager",
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      skip_tokenizer_init=bool(args.model))  # (prompts are token ids; a --model may have no tokenizer)
            llm.final_outputs_only = llm.engine.defer_detokenization = mode != "graphs-s6"
            weights = llm.engine.runner.model.w  # the engine's own weights: their sizes give the step's bytes
            for B in args.batches:
                prompts = batch_prompts(B, args.prompt)
                sp1 = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
                spn = SamplingParams(max_tokens=1 + args.steps, temperature=0.0, ignore_eos=True)
                llm.generate(prompts, spn)  # warm-up: kernel compiles and the graph capture for this size
                dec = decode_seconds(llm, prompts, args.steps)
                tok_s = B * args.steps / dec
                roof = B / (step_bytes(cfg, weights, B, args.prompt + args.steps // 2) / bw)
                rows.append((mode, B, tok_s, roof))
                print(f"# {mode} B={B}: {1e3 * dec / args.steps:.2f} ms per decode step "
                      f"(graph replays so far {llm.engine.runner.num_static_decode_steps})", flush=True)
                if args.cprofile:
                    host_profile(llm, prompts, spn, args.steps, args.cprofile)
                if args.breakdown and mode != "eager" and ":" not in mode:
                    breakdown(llm, prompts, spn, B, args.steps, 1e6 * dec / args.steps)
                if args.profile and mode == modes[0]:
                    k_pre = kernel_breakdown(f"B={B} prefill only", lambda p=prompts, s=sp1, e=llm: e.generate(p, s), 1,
                                             top=5)
                    k_all = kernel_breakdown(f"B={B} prefill + {args.steps} decode steps",
                                             lambda p=prompts, s=spn, e=llm: e.generate(p, s), 1, top=25)
                    k_step = (k_all - k_pre) / args.steps
                    print(f"# B={B}: kernels {k_step:.0f} µs per decode step of {1e6 * dec / args.steps:.0f} µs "
                          "wall", flush=True)
            del llm, weights
            torch.cuda.empty_cache()
        print("| mode | batch | decode tok/s | roofline tok/s | fraction |")
        for mode, B, tok_s, roof in rows:
            print(f"| {mode} | {B} | {tok_s:.0f} | {roof:.0f} | {100 * tok_s / roof:.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
