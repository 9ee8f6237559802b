"""Private network namespaces: where local Mooncake clients (and their tests) must run.

Every Mooncake store client opens listeners on all interfaces (0.0.0.0 and [::], hard-coded; no
option changes it — docs/kvstore.md). Locally the only safe place for one is a
network namespace whose only interface is loopback. Two ways in, both need root (CAP_SYS_ADMIN):

* `enter_private_netns()`: move the *calling thread* (call it on the main thread, before any thread
  or socket that should live inside is created) into a fresh namespace with `lo` up. Every process
  and thread started from it afterwards inherits the namespace. Sockets opened before the move stay
  in the old namespace and keep working there — so a gateway can bind its public port first, then
  move, and reach only the private loopback from then on. Test modules call it at import (collection
  time, before any test starts a thread): the rest of that pytest process runs in the namespace.
* `PrivateNetns()`: a namespace held by a small holder process; `argv(cmd)` prefixes a command so it
  starts inside (`nsenter --net=...`), `enter()` moves the calling thread in. Use it when several
  processes started from a process that stays outside must share one private loopback.

`in_private_netns()` says whether the calling thread sees loopback only.
"""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import threading

CLONE_NEWNET = 0x40000000


class NetnsError(RuntimeError):
    """A private network namespace could not be made or entered (usually: not root)."""


def in_private_netns() -> bool:
    """True when the calling thread's namespace has no interface but loopback."""
    return [name for _i, name in socket.if_nameindex()] == ["lo"]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _lo_up() -> None:
    r = subprocess.run(["ip", "link", "set", "lo", "up"], capture_output=True, text=True)
    if r.returncode != 0:
        raise NetnsError(f"ip link set lo up failed: {r.stderr.strip()}")


def enter_private_netns() -> bool:
    """Move the calling thread into a fresh network namespace with only `lo` (up).

    Returns False (and does nothing) when the thread already sees loopback only, True when it moved.
    Raises NetnsError when the kernel refuses (not root) or when called off the main thread.
    """
    if in_private_netns():
        return False
    if threading.current_thread() is not threading.main_thread():
        raise NetnsError("enter_private_netns: call it on the main thread (threads inherit its namespace)")
    libc = _libc()
    if libc.unshare(CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise NetnsError(f"unshare(CLONE_NEWNET) failed: {os.strerror(err)} (a private network namespace "
                         "needs root)")
    _lo_up()
    return True


class PrivateNetns:
    """A network namespace with only loopback, held open by a holder process until `stop()`."""

    def __init__(self) -> None:
        self._holder: subprocess.Popen | None = None

    def start(self) -> PrivateNetns:
        # the holder prints once lo is up, then sleeps until killed
        self._holder = subprocess.Popen(
            ["unshare", "-n", "sh", "-c", "ip link set lo up && echo up && exec sleep 2147483647"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self._holder.stdout.readline().strip()
        if line != "up":
            err = self._holder.stderr.read() if self._holder.poll() is not None else ""
            self.stop()
            raise NetnsError(f"could not create a private network namespace: {err.strip() or 'no answer'}")
        return self

    @property
    def path(self) -> str:
        if self._holder is None or self._holder.poll() is not None:
            raise NetnsError("the namespace is not running (start() it)")
        return f"/proc/{self._holder.pid}/ns/net"

    def argv(self, cmd: list[str]) -> list[str]:
        """`cmd` prefixed so that it starts inside the namespace."""
        return ["nsenter", f"--net={self.path}", "--", *cmd]

    def enter(self) -> None:
        """Move the calling thread into the namespace (threads it starts afterwards follow)."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            if _libc().setns(fd, CLONE_NEWNET) != 0:
                raise NetnsError(f"setns failed: {os.strerror(ctypes.get_errno())}")
        finally:
            os.close(fd)

    def stop(self) -> None:
        h, self._holder = self._holder, None
        if h is not None and h.poll() is None:
            h.kill()
        if h is not None:
            h.wait()
            for f in (h.stdout, h.stderr):
                if f:
                    f.close()

    def __enter__(self) -> PrivateNetns:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
