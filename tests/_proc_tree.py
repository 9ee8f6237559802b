"""Process trees of the processes a test starts, read from /proc, `pgrep` and `ss`: a process's children and
whole tree, whether one is still alive, a worker's spawned rank processes, and what a tree listens on."""

from __future__ import annotations

import os
import re
import subprocess


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _tree(pid: int) -> set[int]:
    """`pid` and all its descendants."""
    pids, todo = {pid}, [pid]
    while todo:
        kids = set(_children(todo.pop()))
        todo += list(kids - pids)
        pids |= kids
    return pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead
        return f.read().split(")")[-1].split()[0] != "Z"


def _rank_pids(pid: int) -> list[int]:
    """The spawned tensor-parallel ranks of a worker (its children but multiprocessing's resource tracker)."""
    return [c for c in _children(pid) if "resource_tracker" not in open(f"/proc/{c}/cmdline").read()]


def _listeners(pids: set[int]) -> list[tuple[str, str]]:
    """(process name, local address) of every TCP listener owned by one of `pids`, one row per owner (ss -ltnp)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        for name, pid in re.findall(r'\("([^"]+)",pid=(\d+)', line):
            if int(pid) in pids:
                found.append((name, line.split()[3]))
    return found


def _listen_addrs(pids: set[int]) -> list[str]:
    """Local addresses of the TCP listeners owned by `pids`, each once."""
    return list(dict.fromkeys(a for _n, a in _listeners(pids)))


def _listening_sockets(pid):
    """(proto, local address) of every listening TCP socket / bound UDP socket the process holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        with open(f"/proc/{pid}/net/{proto}") as f:
            next(f)
            for line in f:
                cols = line.split()
                local, state, inode = cols[1], cols[3], cols[9]
                if inode in inodes and (proto.startswith("udp") or state == "0A"):
                    out.append((proto, local.split(":")[0]))
    return out
