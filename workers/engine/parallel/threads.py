"""Torch CPU threads of a multi-rank engine's ranks: the host's CPUs split over the ranks on that host.

Left alone, every spawned rank would start torch's default thread pool (one thread per CPU), so N ranks on
a host oversubscribe it N times and each collective waits for the slowest, descheduled rank (a 128-token
TP=2 prefill on 2 CPUs: 4-7 s instead of tens of milliseconds). Each rank therefore runs

    threads = max(1, host CPUs // ranks on this host)

(host CPUs: those this process may run on, `os.sched_getaffinity`), rank 0 too when the engine has more
than one rank on its host. `K3SERVE_RANK_THREADS=N` (or `--num-threads N` of `k3serve serve|worker`, which
sets it) gives every rank N threads instead. Used by the TP launcher (workers/engine/parallel/launcher.py,
its spawned ranks and Ray actors), the ranks of other nodes (node_process.py) and the DEP group
(dp_front.py, dp_engine.py).
"""

from __future__ import annotations

import os

import torch

ENV = "K3SERVE_RANK_THREADS"


def host_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity API on this platform
        return max(1, os.cpu_count() or 1)


def override() -> int | None:
    """The threads every rank gets from K3SERVE_RANK_THREADS, or None (unset); ValueError if malformed."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{ENV}={text!r}: must be a positive integer (torch CPU threads per rank)")
    return n


def rank_threads(ranks_on_host: int, forced: int | None = None) -> int:
    """Threads for one of `ranks_on_host` ranks: `forced`, else K3SERVE_RANK_THREADS, else the CPU share."""
    if forced:
        return int(forced)
    return override() or max(1, host_cpus() // max(1, int(ranks_on_host)))


def set_rank_threads(ranks_on_host: int, forced: int | None = None) -> int:
    """torch.set_num_threads(rank_threads(...)) for this process; returns the count."""
    n = rank_threads(ranks_on_host, forced)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
