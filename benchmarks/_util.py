"""Tiny shared helpers for benchmark scripts: aligned tables and median timing.

Benchmarks run as scripts (`PYTHONSAFEPATH=1 .venv/bin/python benchmarks/x.py`) and import this with

    sys.path.insert(0, os.path.dirname(__file__))
    from _util import print_table, timeit
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO


def format_cell(value: Any) -> str:
    """str() for most values; floats get 4 significant digits (no exponent between 1e-3 and 1e6)."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return str(value)
        if value == 0 or 1e-3 <= abs(value) < 1e6:
            return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
        return f"{value:.3e}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """The table as text: a header line, a dashed rule, one line per row; numbers right-aligned.

    Every row must have len(headers) cells. Columns are separated by two spaces; no trailing spaces.
    """
    cells = [[format_cell(v) for v in row] for row in rows]
    for i, row in enumerate(cells):
        if len(row) != len(headers):
            raise ValueError(f"row {i} has {len(row)} cells, expected {len(headers)}")
    widths = [max([len(h)] + [len(r[c]) for r in cells]) for c, h in enumerate(headers)]
    numeric = [
        bool(rows) and all(isinstance(r[c], int | float) and not isinstance(r[c], bool) for r in rows)
        for c in range(len(headers))
    ]

    def line(parts: Sequence[str]) -> str:
        out = [p.rjust(w) if num else p.ljust(w) for p, w, num in zip(parts, widths, numeric)]
        return "  ".join(out).rstrip()

    lines = [line(list(headers)), line(["-" * w for w in widths])]
    lines += [line(r) for r in cells]
    return "\n".join(lines)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], file: TextIO | None = None) -> None:
    """Print `format_table(headers, rows)` to `file` (default stdout) and flush."""
    out = file if file is not None else sys.stdout
    print(format_table(headers, rows), file=out, flush=True)


def _cuda_sync() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timeit(
    fn: Callable[[], Any], repeat: int = 5, warmup: int = 1, sync: Callable[[], None] | None = _cuda_sync
) -> float:
    """Median wall time of `fn()` in seconds over `repeat` timed calls after `warmup` untimed calls.

    `sync` runs before the clock starts and before it stops (default: torch.cuda.synchronize() when
    torch is imported and CUDA is initialised, so GPU work is counted); pass None to skip it.
    """
    if repeat < 1 or warmup < 0:
        raise ValueError("repeat must be >= 1 and warmup >= 0")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernel_breakdown(name: str, fn: Callable[[], Any], reps: int, top: int | None = None, warmup: int = 3) -> float:
    """Profile `reps` calls of fn() with torch.profiler (CUDA activity) and print µs per call per kernel name,
    largest first (`top` rows at most), after the wall time per call of `reps` unprofiled calls. Returns the
    kernels' total µs per call."""
    import time
    from collections import defaultdict

    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / reps * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per: dict[str, float] = defaultdict(float)
    cnt: dict[str, int] = defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name] += getattr(ev, "device_time_total", None) or ev.cuda_time_total
            cnt[ev.name] += 1
    total = sum(per.values()) / reps
    # wall > kernels: the calls are host-bound (launches, host syncs) or leave the GPU idle between kernels
    print(f"\n## {name}: {total:.1f} µs of kernels per call, {wall:.1f} µs wall per call", flush=True)
    for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {v / reps:9.1f} µs  x{cnt[k] / reps:5.1f}  {k[:110]}", flush=True)
    return total


def ragged_lens(seed: int, total: int = 16384, n: int = 64) -> list[int]:
    """The GPU benchmarks' ragged prefill batch: n sequences of 12..512 tokens, scaled to about `total`."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lens = (torch.rand(n, generator=g) * 500 + 12).long()
    return (lens * (total / lens.sum())).long().clamp_min(1).tolist()


def kda_prefill_case(lens: Sequence[int], H: int, K: int = 128, V: int = 128, device: str = "cuda",
                     generator=None):
    """Inputs of one `ops.kda_chunked` call as the GPU benchmarks time it (bf16 q/k/v, fp32 gates in the bounded
    range, one state slot per sequence, every sequence with an initial state):
    (q, k, v, g, beta, state_pool, slots, cu_seqlens, has_initial_state)."""
    import torch

    T, B = sum(lens), len(lens)
    kw = dict(device=device, generator=generator)
    q, k = (torch.randn(T, H, K, dtype=torch.bfloat16, **kw) for _ in range(2))
    v = torch.randn(T, H, V, dtype=torch.bfloat16, **kw)
    g = -5.0 * torch.sigmoid(torch.randn(T, H, K, **kw))
    beta = torch.rand(T, H, **kw)
    pool = torch.randn(B, H, V, K, **kw) * 0.1
    cu = torch.tensor([0, *torch.tensor(list(lens)).cumsum(0).tolist()], device=device, dtype=torch.int32)
    slots = torch.arange(B, device=device, dtype=torch.int32)
    init = torch.ones(B, dtype=torch.bool, device=device)
    return q, k, v, g, beta, pool, slots, cu, init


def gpu_time_us(fn: Callable[[], Any], warmup: int = 25, rep: int = 100) -> float:
    """Median time of fn() in µs on the GPU (CUDA events; `warmup` / `rep` in ms as triton.testing.do_bench
    takes them)."""
    import triton

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3


def copy_bandwidth(warmup: int = 25, rep: int = 100) -> float:
    """Device copy bandwidth in bytes/s (read + write) of a 2 GiB fp32 copy: the ceiling the GPU benchmarks
    report their rates against."""
    import torch

    a = torch.randn(1 << 29, device="cuda", dtype=torch.float32)
    b = torch.empty_like(a)
    t = gpu_time_us(lambda: b.copy_(a), warmup, rep)
    return 2 * a.numel() * 4 / (t * 1e-6)


def cuda_graph(fn: Callable[[], Any], warmups: int = 2):
    """fn captured in a CUDA graph, after `warmups` runs on a side stream (Triton compiles, allocator)."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


SET_HELP = ("set a module constant first, e.g. k3serve.workers.engine.k3_forward.FUSED_ADD_NORM=0 (ints where they "
            "parse); repeatable, for side-by-side runs of an engine knob")


def apply_sets(ap, items: Sequence[str]) -> None:
    """`--set MODULE.NAME=VALUE ...`: setattr on the imported module (an int where VALUE parses as one); a module or
    a name that does not exist is an argument error (exit 2), not a silently unchanged run."""
    import importlib

    for item in items:
        target, eq, value = item.partition("=")
        mod_name, _, name = target.rpartition(".")
        if not eq or not mod_name or not name:
            ap.error(f"--set: {item!r} is not MODULE.NAME=VALUE")
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            ap.error(f"--set: no module {mod_name!r}")
        if not hasattr(mod, name):
            ap.error(f"--set: {mod_name} has no {name!r}")
        setattr(mod, name, int(value) if value.lstrip("-").isdigit() else value)



def parse_ab(ap, item: str) -> tuple[str, list[Any]]:
    """`--ab MODULE.NAME=A,B`: (the `--set` target, [A, B]) with ints where they parse; an error otherwise (exit 2)."""
    target, eq, values = item.partition("=")
    sides = values.split(",")
    if not eq or "." not in target or len(sides) != 2 or not all(sides):
        ap.error(f"--ab: {item!r} is not MODULE.NAME=A,B")
    return target, [int(v) if v.lstrip("-").isdigit() else v for v in sides]


def alternate(measure: Callable[[int], float], rounds: int) -> list[list[float]]:
    """Interleaved A/B timing: `rounds` rounds, each measuring side 0 and side 1 once, the order flipped every round
    (A B, B A, A B, ...) so a drift of the machine (clocks, a neighbour) falls on both sides alike. Returns
    [[side 0's values], [side 1's values]] in round order."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    out: list[list[float]] = [[], []]
    for r in range(rounds):
        for side in ((0, 1) if r % 2 == 0 else (1, 0)):
            out[side].append(measure(side))
    return out


def ab_summary(values: list[list[float]]) -> tuple[float, float, float, float, float]:
    """(median A, median B, median of the per-round ratios B/A, their min, their max) of `alternate`'s result."""
    ratios = [b / a for a, b in zip(values[0], values[1], strict=True)]
    return (statistics.median(values[0]), statistics.median(values[1]), statistics.median(ratios), min(ratios),
            max(ratios))
