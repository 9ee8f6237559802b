"""RankGroup: one gloo process group of N ranks (loopback, or the pod network when the group spans nodes).

Not torch.distributed's global default group: each engine builds its own `ProcessGroupGloo` from a
`TCPStore` that rank 0 hosts (port 0: the OS picks one, the children are told which), so several engines
can live in one process (tests). Binds: the store and gloo listen on `host` only, 127.0.0.1 unless the
group spans nodes (then the address the pod manifest gives: workers/engine/parallel/nodes.py). The store's
listening socket is ours (`master_listen_fd`): TCPStore left to itself listens on every interface.

Every collective is recorded in `self.log` as (name, shape, dtype itemsize) when `self.log` is a list
(benchmarks/parallel_comm.py counts bytes from it); it is None (no recording) by default. For
`all_to_all` the recorded shape is that of the rows leaving this rank for OTHER ranks (its own rows stay).
"""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

LOOPBACK = "127.0.0.1"
WATCH_S = 1.0  # how often a waiting collective calls RankGroup.watch (when set)


class RendezvousError(ConnectionError):
    """The group could not form: the leader's address cannot be bound or reached in time (names it).
    A ConnectionError (an OSError), so the serving commands report it as one line (workers/engine_cli.py)."""


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=1024)
    except OSError as e:
        raise RendezvousError(f"rendezvous: cannot listen on {host}:{port}: {e.strerror or e}") from None


def host_store(world_size: int, timeout_s: float, host: str = LOOPBACK, port: int = 0) -> dist.TCPStore:
    """Rank 0's rendezvous store on host:port (port 0: a free one; `store.port` tells the other ranks)."""
    sock = _listen(host, port)
    return dist.TCPStore(host, sock.getsockname()[1], world_size, True,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                         master_listen_fd=sock.detach())


def join_store(port: int, world_size: int, timeout_s: float, host: str = LOOPBACK) -> dist.TCPStore:
    """A rank's client of rank 0's store; waits up to `timeout_s` for it to listen."""
    try:
        return dist.TCPStore(host, port, world_size, False, timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as e:  # DistStoreError / DistNetworkError are RuntimeErrors
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RendezvousError(f"rendezvous: no group leader answered at {host}:{port} within {timeout_s:g} s "
                              f"({first})") from None


class RankGroup:
    """rank / size and the collectives, each blocking (`.wait()`); a peer that died makes them raise
    (its sockets close), a peer that hangs makes them raise after `timeout_s`. With `watch` set (a TP or DEP
    group spanning nodes: workers/engine/parallel/launcher.py, dp_engine.py), a collective still waiting calls it every WATCH_S,
    so a peer known lost (its node silent: workers/engine/parallel/nodes.py) fails the wait before
    `timeout_s` (watch raises; a gloo wait cannot be aborted otherwise)."""

    watch = None  # () -> None, raises when the group cannot complete

    def __init__(self, store: dist.Store, rank: int, size: int, timeout_s: float, host: str = LOOPBACK):
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]  # this rank's listener: host only
        self.pg = dist.ProcessGroupGloo(store, rank, size, opts)
        self.rank, self.size = rank, size
        self.log: list[tuple[str, tuple[int, ...], int]] | None = None

    def _wait(self, work) -> None:
        if self.watch is None:
            work.wait()
            return
        while True:
            try:
                work.wait(datetime.timedelta(seconds=WATCH_S))
                return
            except RuntimeError as e:  # this wait's own bound only: the collective is still running
                if str(e) != "Operation timed out!":
                    raise
            self.watch()

    def _record(self, name: str, t: torch.Tensor) -> None:
        if self.log is not None:
            self.log.append((name, tuple(t.shape), t.element_size()))

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (t must be contiguous); returns t."""
        t = t.contiguous()
        self._record("all_reduce", t)
        self._wait(self.pg.allreduce([t]))
        return t

    def all_gather_cat(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `t` (same shape on all ranks) concatenated along `dim`, in rank order."""
        t = t.contiguous()
        self._record("all_gather", t)
        out = [torch.empty_like(t) for _ in range(self.size)]
        self._wait(self.pg.allgather([out], [t]))
        return torch.cat(out, dim=dim)

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks of `t` [size * s, ...], this rank's rows [rank * s, (rank + 1) * s) of it."""
        t = t.contiguous()
        if t.shape[0] % self.size:
            raise ValueError(f"reduce_scatter: {t.shape[0]} rows do not split over {self.size} ranks")
        self._record("reduce_scatter", t)
        out = t.new_empty((t.shape[0] // self.size, *t.shape[1:]))
        self._wait(self.pg._reduce_scatter_base(out, t))
        return out

    def all_to_all(self, t: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Ragged all-to-all along dim 0: rows [sum(send_counts[:r]), +send_counts[r]) of `t` go to rank r;
        returns the rows received, rank 0's first (`recv_counts[r]` from rank r, as rank r was told)."""
        t = t.contiguous()
        if self.log is not None:
            self.log.append(("all_to_all", (int(sum(send_counts)) - int(send_counts[self.rank]), *t.shape[1:]),
                             t.element_size()))
        out = t.new_empty((int(sum(recv_counts)), *t.shape[1:]))
        self._wait(self.pg.alltoall_base(out, t, [int(c) for c in recv_counts], [int(c) for c in send_counts],
                                         dist.AllToAllOptions()))
        return out
