"""A NIXL agent for host (or device) page memory, with the UCX environment set by us, not by hand.

    agent = TransferAgent("decode-1a2b", local_only=True)     # sets UCX_* before the backend starts
    agent.register([t.data_ptr(), t.nbytes) for t in pages])
    md = agent.metadata()                                     # bytes, sent over gRPC (never NIXL's listener)
    peer = agent.add_peer(md_from_peer)                       # the peer's agent name
    local = agent.prep_local(descs)                           # Nx3 uint64 (addr, len, dev): prepared once
    remote = agent.prep_remote(peer, descs)
    xfer = agent.read(local, local_ids, remote, remote_ids, notif=b"req-1")   # NIXL READ, non-blocking
    xfer.poll()  -> "PROC" | "DONE" | "ERR"                    # a dead peer gives "ERR", never a hang
    agent.notifs() -> {peer: [msg, ...]}                       # completions of peers' reads of our pages
    agent.notify(peer, b"req-1")                              # the same message, sent on its own

Environment (nixl-on-cpu.md): in local mode `UCX_TLS=self,sm` (shared memory and CMA only, no sockets)
or, when a transfer network device is given, `UCX_NET_DEVICES=<devices>`; always `UCX_MEM_EVENTS=no`
(backend start 410 → 15 ms); NIXL's progress thread off in local mode (it halves throughput on small
machines; shared-memory reads need no target progress) and on with network devices (a TCP/RDMA READ is
served by the target's progress); NIXL's own metadata listener never enabled (it binds every interface).
"""

from __future__ import annotations

import logging
import os

import numpy as np

log = logging.getLogger(__name__)


def import_nixl():
    """(nixl_agent, nixl_agent_config) from the `nixl` meta package or the `nixl_cu12` wheel."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[import-not-found]
    except ImportError:
        try:
            from nixl_cu12._api import nixl_agent, nixl_agent_config  # type: ignore[import-not-found]
        except ImportError as e:
            raise RuntimeError("NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1; "
                               "scripts/install.sh does it)") from e
    return nixl_agent, nixl_agent_config


def ucx_environment(devices: str | None) -> dict[str, str]:
    """The UCX variables for a transfer agent: loopback-only (`self,sm`) unless network devices are given."""
    env = {"UCX_MEM_EVENTS": "no"}
    if devices:
        env["UCX_NET_DEVICES"] = devices
    else:
        env["UCX_TLS"] = "self,sm"
    return env


def apply_ucx_environment(devices: str | None) -> dict[str, str]:
    """Set the variables in this process (before the first UCX backend is created); returns them."""
    env = ucx_environment(devices)
    for k, v in env.items():
        os.environ[k] = v
    if not devices:
        os.environ.pop("UCX_NET_DEVICES", None)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    return env


_HUGE = 2 << 20
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25


def back_with_huge_pages(regions: list[tuple[int, int]]) -> int:
    """Move the 2 MiB-aligned interior of each (address, nbytes) host region onto transparent huge pages
    in place (madvise MADV_HUGEPAGE + MADV_COLLAPSE, Linux >= 6.1; contents kept). Same-host reads go
    through process_vm_readv, which walks the pages of both sides: on 4 KiB pages a 16 MiB READ ran at
    ~2-5 GB/s here, on huge pages at ~18 GB/s. Returns the bytes collapsed (0 where the kernel refuses,
    which only costs speed)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return 0
    done = 0
    for addr, n in regions:
        lo = (addr + _HUGE - 1) // _HUGE * _HUGE
        hi = (addr + n) // _HUGE * _HUGE
        if hi <= lo:
            continue
        ok = libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_HUGEPAGE) == 0
        if ok and libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_COLLAPSE) == 0:
            done += hi - lo
        else:
            log.debug("huge pages for %#x+%d refused (errno %d)", lo, hi - lo, ctypes.get_errno())
    return done


class TransferError(RuntimeError):
    """A transfer could not be started or failed (the caller recomputes)."""


class Transfer:
    """One posted READ. `poll()` is non-blocking; `release()` frees the handle (idempotent)."""

    def __init__(self, agent, handle):
        self._agent = agent
        self._handle = handle

    def poll(self) -> str:
        if self._handle is None:
            return "ERR"
        try:
            state = self._agent.check_xfer_state(self._handle)
        except Exception as e:  # nixlRemoteDisconnectError and friends: the peer is gone
            log.warning("KV transfer failed: %s", e)
            return "ERR"
        return state if state in ("DONE", "PROC") else "ERR"

    def release(self) -> None:
        if self._handle is not None:
            try:
                self._agent.release_xfer_handle(self._handle)
            except Exception as e:  # a handle of a dead peer may refuse to release; nothing to leak
                log.debug("release_xfer_handle: %s", e)
            self._handle = None


class TransferAgent:
    def __init__(self, name: str, *, devices: str | None = None, backend_options: dict | None = None):
        apply_ucx_environment(devices)
        nixl_agent, nixl_agent_config = import_nixl()
        self.name = name
        # Shared memory (CMA) reads are one-sided; over a network transport the target must progress its
        # UCX worker to serve a READ, so network mode runs NIXL's progress thread (pods have the cores).
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=bool(devices), enable_listen_thread=False,
                                                        backends=[]))
        opts = {"ucx_error_handling_mode": "none"} if not devices else {}
        opts.update(backend_options or {})
        self.agent.create_backend("UCX", opts)
        self._regs = []
        self._peers: set[str] = set()
        self.huge_bytes = 0  # bytes of the registered host memory moved onto huge pages

    # -- memory -------------------------------------------------------------------------------
    def register(self, regions: list[tuple[int, int]], mem: str = "DRAM") -> None:
        """Register (address, nbytes) regions: the page tensors (one per layer position)."""
        descs = [(int(a), int(n), 0, "") for a, n in regions]
        if mem == "DRAM":
            self.huge_bytes = back_with_huge_pages([(int(a), int(n)) for a, n in regions])
        self._regs.append(self.agent.register_memory(descs, mem))

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    # -- peers --------------------------------------------------------------------------------
    def add_peer(self, metadata: bytes) -> str:
        name = self.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._peers.add(name)
        return name

    def remove_peer(self, name: str) -> None:
        if name in self._peers:
            self._peers.discard(name)
            try:
                self.agent.remove_remote_agent(name)
            except Exception as e:
                log.debug("remove_remote_agent(%s): %s", name, e)

    # -- descriptor lists (prepared once, reused per request) ---------------------------------
    def prep_local(self, descs: np.ndarray, mem: str = "DRAM"):
        return self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.ascontiguousarray(descs, dtype=np.uint64), mem)

    def prep_remote(self, peer: str, descs: np.ndarray, mem: str = "DRAM"):
        return self.agent.prep_xfer_dlist(peer, np.ascontiguousarray(descs, dtype=np.uint64), mem)

    def release_dlist(self, handle) -> None:
        try:
            self.agent.release_dlist_handle(handle)
        except Exception as e:
            log.debug("release_dlist_handle: %s", e)

    # -- transfers ----------------------------------------------------------------------------
    def read(self, local, local_ids, remote, remote_ids, notif: bytes = b"") -> Transfer:
        """Post a READ of remote descriptors into local ones (pairwise); raises TransferError."""
        try:
            h = self.agent.make_prepped_xfer("READ", local, list(map(int, local_ids)), remote,
                                             list(map(int, remote_ids)), notif)
            state = self.agent.transfer(h)
        except Exception as e:
            raise TransferError(f"could not post the KV read: {e}") from e
        if state == "ERR":
            self.agent.release_xfer_handle(h)
            raise TransferError("the KV read was refused (ERR)")
        return Transfer(self.agent, h)

    def notify(self, peer: str, msg: bytes) -> None:
        """A notification not bound to a transfer (after reads from several ranks of one peer all ended);
        raises TransferError."""
        try:
            self.agent.send_notif(peer, msg)
        except Exception as e:
            raise TransferError(f"could not notify {peer}: {e}") from e

    def notifs(self) -> dict[str, list[bytes]]:
        try:
            got = self.agent.get_new_notifs()
        except Exception as e:
            log.debug("get_new_notifs: %s", e)
            return {}
        return {(k.decode() if isinstance(k, bytes) else k): list(v) for k, v in got.items()}

    def close(self) -> None:
        for p in list(self._peers):
            self.remove_peer(p)
        for r in self._regs:
            try:
                self.agent.deregister_memory(r)
            except Exception as e:
                log.debug("deregister_memory: %s", e)
        self._regs = []
