"""A mixed engine step (D decodes + one prefill chunk of C tokens) against its two parts, issue 19's last row.

    python3 benchmarks/mixed_step.py                      # CUDA, `small` preset, bf16, D=8, C=2048
    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/mixed_step.py --device cpu --preset tiny --chunk 64 --context 32

One engine (`LLMEngine`, no prefix caching, a token budget of C + D so the chunk is scheduled whole) runs, per
repeat, on fresh token ids:
* decode part: D requests of --context prompt tokens prefilled, then one decode-only step of the D rows timed (on
  CUDA the engine replays it from its captured graph, as every pure decode step);
* mixed: a request of C prompt tokens added to those D decoding ones; the next step is D decode rows + the chunk
  (the engine runs such steps eagerly: no graph covers mixed steps yet);
* prefill part: the D requests aborted, a new request of C tokens alone; its first step is the chunk alone.
Each step is timed twice: its wall time (a device sync before and after `step()`), and, in a second identical
pass under torch.profiler, its kernels' time (the sum of the device kernels' durations on CUDA; on the CPU the
profiler's self time of every op, a stand-in that only checks the script). Printed: per part the median over
--repeats of wall and kernel µs, and the ratios mixed / (decode + prefill) of both. Issue 19's target: the mixed
step's kernel time within 1.3x of the sum of its parts'.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import SET_HELP, apply_sets, print_table  # noqa: E402

from k3serve.sampling_params import SamplingParams
from k3serve.workers.llm import LLM
from k3serve.workers.model.config import K3Config
from k3serve.workers.model.make_model import make_model


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _kernel_us(prof, device: str) -> float:
    if device == "cuda":
        return sum((getattr(ev, "device_time_total", None) or ev.cuda_time_total) for ev in prof.events()
                   if ev.device_type == torch.autograd.DeviceType.CUDA)
    return sum(ev.self_cpu_time_total for ev in prof.key_averages())


class StepTimer:
    """Times one `engine.step()`: wall µs, or (profiled) kernel µs; `self.last` = the profiled step's events."""

    def __init__(self, eng, device: str, profiled: bool):
        self.eng, self.device, self.profiled = eng, device, profiled
        self.last = None

    def __call__(self) -> float:
        _sync(self.device)
        if not self.profiled:
            t0 = time.perf_counter()
            self.eng.step()
            _sync(self.device)
            return (time.perf_counter() - t0) * 1e6
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CUDA] if self.device == "cuda" else [ProfilerActivity.CPU]
        with profile(activities=acts) as prof:
            self.eng.step()
            _sync(self.device)
        self.last = prof
        return _kernel_us(prof, self.device)


def host_profile(eng, rng: random.Random, vocab: int, C: int, device: str, top: int) -> None:
    """One more prefill-part step (a new request of C tokens alone) under cProfile: its wall time and the `top`
    functions by own time, in µs. On CUDA, a wait for the device shows as the op that waited (a `.tolist()`,
    `.item()` or copy to the host), a kernel launch as Triton's or torch's launch path: where the step's wall time
    goes beyond its kernels' time."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    box = {}

    def run():
        t0 = time.perf_counter()
        pr.enable()
        eng.step()
        _sync(device)
        pr.disable()
        box["wall"] = (time.perf_counter() - t0) * 1e6

    _solo_prefill(eng, rng, vocab, C, device, run)
    wall = box["wall"]
    stats = pstats.Stats(pr).stats  # {(file, line, name): (calls, primitive calls, own s, cumulative s, callers)}
    print(f"# prefill step under cProfile: {wall:.0f} µs wall; top {top} functions by own time (µs, calls, cumulative)")
    for (f, line, name), (_, calls, own, cum, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]:
        where = f"{os.path.basename(f)}:{line}" if f != "~" else ""
        print(f"#   {own * 1e6:9.0f}  x{calls:5d}  {cum * 1e6:9.0f}  {where} {name}"[:150])


def _solo_prefill(eng, rng: random.Random, vocab: int, C: int, device: str, run) -> None:
    """Add a request of C tokens alone, call `run()` around its first step (synchronized before), abort it."""
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    rid = eng.next_request_id()
    eng.add_request(rid, [rng.randrange(10, vocab) for _ in range(C)], sp)
    _sync(device)
    run()
    eng.abort_request([rid])
    while eng.has_unfinished_requests():
        eng.step()


def _repo_site(stack) -> str:
    """The innermost frame of this repository in `stack` (traceback.extract_stack order), as path:line code."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for f in reversed(stack):
        if f.filename.startswith(root) and "benchmarks" not in f.filename:
            return f"{os.path.relpath(f.filename, root)}:{f.lineno} {(f.line or '').strip()[:70]}"
    return "?"


def sync_census(eng, rng: random.Random, vocab: int, C: int, top: int) -> None:
    """Where a prefill step (C tokens alone) makes the host wait for the device, two ways (CUDA only):

    * torch.cuda.set_sync_debug_mode("warn") for one step: every synchronizing call (a copy to the host, `.item()`,
      a copy from pageable host memory) warns; the warnings are counted by the innermost frame of this repository;
    * one step under torch.profiler with CPU and CUDA activity: the CUDA runtime calls' host time by name (a long
      cudaStreamSynchronize / cudaMemcpyAsync is the host waiting; a long launch call, a full launch queue), the
      union of the kernels' busy time against the step's span, and when the last kernel launch left the host
      (near the span's end: the host, not the device, sets the pace);
    * the caching allocator's counters over the step (retries, device allocations and frees: each a sync)."""
    import traceback
    import warnings

    from torch.profiler import ProfilerActivity, profile

    sites: dict[str, int] = {}

    def show(message, category, filename, lineno, file=None, line=None):
        site = _repo_site(traceback.extract_stack()[:-1])
        sites[site] = sites.get(site, 0) + 1

    def debug_step():
        with warnings.catch_warnings():  # restores warnings.showwarning and the filters on exit
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                eng.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        _sync("cuda")

    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
    before = torch.cuda.memory_stats()
    _solo_prefill(eng, rng, vocab, C, "cuda", debug_step)
    after = torch.cuda.memory_stats()
    print("# allocator during that step (a retry frees every cached block: a device-wide sync): "
          + ", ".join(f"{k} +{after.get(k, 0) - before.get(k, 0)}" for k in keys)
          + f"; reserved {after.get('reserved_bytes.all.current', 0) / 2**30:.2f} GiB, "
          f"free on the device {torch.cuda.mem_get_info()[0] / 2**30:.2f} GiB")
    print(f"# prefill step: {sum(sites.values())} synchronizing calls at {len(sites)} sites; top {top}")
    for site, n in sorted(sites.items(), key=lambda kv: -kv[1])[:top]:
        print(f"#   x{n:4d}  {site}"[:150])
    box = {}

    def profiled_step():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            eng.step()
            _sync("cuda")
            box["wall"] = (time.perf_counter() - t0) * 1e6
        box["prof"] = prof

    _solo_prefill(eng, rng, vocab, C, "cuda", profiled_step)
    evs = box["prof"].events()
    api: dict[str, list[float]] = {}
    kernels, launches = [], []
    for ev in evs:
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append((ev.time_range.start, ev.time_range.end))
        elif ev.name.startswith(("cuda", "cu")) and not ev.name.startswith("cudnn"):
            e = api.setdefault(ev.name, [0.0, 0])
            e[0] += ev.time_range.end - ev.time_range.start
            e[1] += 1
            if "Launch" in ev.name:
                launches.append(ev.time_range.end)
    kernels.sort()
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in kernels:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    if kernels and launches:
        start, end = kernels[0][0], kernels[-1][1]
        print(f"# prefill step under the profiler: {box['wall']:.0f} µs wall; kernels busy {busy:.0f} µs of the "
              f"{end - start:.0f} µs from the first kernel's start to the last's end; the last launch left the host "
              f"{end - max(launches):.0f} µs before the last kernel ended")
    print("# CUDA runtime calls by host time (µs, calls)")
    for name, (t, n) in sorted(api.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"#   {t:9.0f}  x{n:5d}  {name}")


def print_top(name: str, prof, device: str, top: int) -> None:
    """The `top` kernels of one profiled step by time (CUDA), or ops by self time (CPU)."""
    per: dict[str, list[float]] = {}
    if device == "cuda":
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                e = per.setdefault(ev.name, [0.0, 0])
                e[0] += getattr(ev, "device_time_total", None) or ev.cuda_time_total
                e[1] += 1
    else:
        for ev in prof.key_averages():
            per[ev.key] = [ev.self_cpu_time_total, ev.count]
    print(f"# {name}: top {top} of {sum(c for _, c in per.values())} kernels")
    for k, (t, c) in sorted(per.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"#   {t:9.1f} µs  x{c:4d}  {k[:110]}")


def one_round(eng, rng: random.Random, vocab: int, D: int, C: int, ctx: int, timer: StepTimer,
              top: int = 0) -> dict[str, float]:
    """The three steps of one repeat (see the module docstring) on fresh ids; returns {part: µs}; `top` > 0 prints
    each profiled step's top kernels."""
    def ids(n):
        return [rng.randrange(10, vocab) for _ in range(n)]

    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    dec = [eng.next_request_id() for _ in range(D)]
    for r in dec:
        eng.add_request(r, ids(ctx), sp.clone())
    reqs = eng.scheduler.requests
    while any(not reqs[r].output_token_ids for r in dec):  # the prefills (in chunks of the token budget)
        eng.step()
    for _ in range(2):  # two plain decode steps: no first-step effects in the timed one
        eng.step()
    out = {"decode": timer()}
    tops = {"decode": timer.last}
    big = eng.next_request_id()
    eng.add_request(big, ids(C), sp.clone())
    before = eng.get_num_unfinished_requests()
    out["mixed"] = timer()
    tops["mixed"] = timer.last
    if eng.get_num_unfinished_requests() != before:
        raise RuntimeError("a request finished during the mixed step: raise max_tokens")
    eng.abort_request(dec + [big])
    solo = eng.next_request_id()
    eng.add_request(solo, ids(C), sp.clone())
    out["prefill"] = timer()
    tops["prefill"] = timer.last
    if top and timer.profiled:
        for part in ("decode", "prefill", "mixed"):
            print_top(f"{part} step, {out[part]:.0f} µs", tops[part], timer.device, top)
    eng.abort_request([solo])
    while eng.has_unfinished_requests():
        eng.step()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--preset", choices=("small", "tiny"), default="small")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--decodes", type=int, default=8, help="decode rows D")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk C (one request's whole prompt)")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens of each decoding request")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--moe", nargs="*", default=[], metavar="NAME=VALUE",
                    help="set kernels/triton/moe.py constants first (e.g. DOT_BM_LARGE=16), ints where they parse")
    ap.add_argument("--set", nargs="*", default=[], metavar="MODULE.NAME=VALUE", help=SET_HELP)
    ap.add_argument("--top", type=int, default=0, help="print the top N kernels of each step of the last repeat")
    ap.add_argument("--syncs", type=int, default=0, metavar="N",
                    help="CUDA: two more prefill-part steps, one in sync-debug mode (the N call sites that made the "
                         "host wait) and one under the profiler (runtime calls' host time, kernel busy time)")
    ap.add_argument("--model", default=None, metavar="DIR",
                    help="load this checkpoint (e.g. vs_transformers.py --save-model DIR's) instead of --preset")
    ap.add_argument("--host", type=int, default=0, metavar="N",
                    help="one more prefill-part step under cProfile: print its N functions of most own time")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("mixed_step: no CUDA device here; pass --device cpu", file=sys.stderr)
        return 2
    if min(args.decodes, args.chunk, args.context, args.repeats) < 1:
        ap.error("--decodes, --chunk, --context and --repeats must be >= 1")
    if args.moe:
        from k3serve.kernels.triton import moe

        for item in args.moe:
            name, _, value = item.partition("=")
            if not hasattr(moe, name):
                ap.error(f"--moe: kernels/triton/moe.py has no {name!r}")
            setattr(moe, name, int(value) if value.lstrip("-").isdigit() else value)
    if args.model and not os.path.isfile(os.path.join(args.model, "config.json")):
        ap.error(f"--model: no config.json in {args.model}")
    apply_sets(ap, args.set)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    with tempfile.TemporaryDirectory() as tmp:
        d = args.model or tmp
        cfg = K3Config.from_pretrained(d) if args.model else make_model(d, args.preset, device=args.device)
        llm = LLM(d, device=args.device, dtype=dtype, max_num_seqs=args.decodes + 1,
                  max_model_len=max(args.chunk, args.context) + 80, max_num_batched_tokens=args.chunk + args.decodes,
                  enable_prefix_caching=False, skip_tokenizer_init=True)
        eng = llm.engine
        rng = random.Random(args.seed)
        one_round(eng, rng, cfg.vocab_size, args.decodes, args.chunk, args.context,
                  StepTimer(eng, args.device, False))  # warm-up: compiles, the decode graph's capture
        res = {}
        for profiled in (False, True):
            timer = StepTimer(eng, args.device, profiled)
            runs = [one_round(eng, rng, cfg.vocab_size, args.decodes, args.chunk, args.context, timer,
                              args.top if i == args.repeats - 1 else 0) for i in range(args.repeats)]
            res["kernels" if profiled else "wall"] = {p: statistics.median(r[p] for r in runs) for p in runs[0]}
        if args.syncs > 0 and args.device == "cuda":
            sync_census(eng, rng, cfg.vocab_size, args.chunk, args.syncs)
        if args.host > 0:
            host_profile(eng, rng, cfg.vocab_size, args.chunk, args.device, args.host)
    what = "kernels" if args.device == "cuda" else "op self time (CPU stand-in)"
    print(f"# {args.model or args.preset + ' preset'}, {args.device}, {dtype}: {args.decodes} decodes of "
          f"{args.context}-token prompts + "
          f"one {args.chunk}-token prefill chunk; median of {args.repeats}")
    rows = []
    for key, label in (("wall", "wall"), ("kernels", what)):
        r = res[key]
        rows.append([label, f"{r['decode']:.0f}", f"{r['prefill']:.0f}", f"{r['mixed']:.0f}",
                     f"{r['mixed'] / (r['decode'] + r['prefill']):.3f}"])
    print_table(["measure", "decode part µs", "prefill part µs", "mixed µs", "mixed / (decode + prefill)"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
