"""RankGroup: one gloo process group of N ranks over loopback, and the collectives the model issues.

Not torch.distributed's global default group: each engine builds its own `ProcessGroupGloo` from a
`TCPStore` that rank 0 hosts on 127.0.0.1 (port 0: the OS picks one, the children are told which), so
several engines can live in one process (tests) and nothing binds a non-loopback address.

Every collective is recorded in `self.log` as (name, shape, dtype itemsize) when `self.log` is a list
(benchmarks/parallel_comm.py counts bytes from it); it is None (no recording) by default.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

LOOPBACK = "127.0.0.1"


def host_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on 127.0.0.1 (a free port; `store.port` tells the other ranks)."""
    return dist.TCPStore(LOOPBACK, 0, world_size, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def join_store(port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(LOOPBACK, port, world_size, False, timeout=datetime.timedelta(seconds=timeout_s))


class RankGroup:
    """rank / size and the collectives, each blocking (`.wait()`); a peer that died makes them raise
    (its sockets close), a peer that hangs makes them raise after `timeout_s`."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout_s: float):
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
        self.pg = dist.ProcessGroupGloo(store, rank, size, opts)
        self.rank, self.size = rank, size
        self.log: list[tuple[str, tuple[int, ...], int]] | None = None

    def _record(self, name: str, t: torch.Tensor) -> None:
        if self.log is not None:
            self.log.append((name, tuple(t.shape), t.element_size()))

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (t must be contiguous); returns t."""
        t = t.contiguous()
        self._record("all_reduce", t)
        self.pg.allreduce([t]).wait()
        return t

    def all_gather_cat(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `t` (same shape on all ranks) concatenated along `dim`, in rank order."""
        t = t.contiguous()
        self._record("all_gather", t)
        out = [torch.empty_like(t) for _ in range(self.size)]
        self.pg.allgather([out], [t]).wait()
        return torch.cat(out, dim=dim)
