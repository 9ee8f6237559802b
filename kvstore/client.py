"""StoreClient: the one owner of a `MooncakeDistributedStore`, so a closed client is never called.

Calling `put`/`is_exist`/`remove` on a closed Mooncake client segfaults the process
(measured here; docs/kvstore.md). Every call here goes through `_call`, which refuses (raises
`StoreClosed`) once `close()` has begun, and `close()` waits for the calls in flight to return
before it closes the native client. The native object is never handed out.

    c = StoreClient("127.0.0.1:50051", segment_bytes=64 << 20)
    c.connect()                          # one bounded attempt (MC_STORE_CLIENT_SETUP_RETRIES, default 1)
    c.register(ptr, nbytes)              # zero-copy buffers for the batch calls
    c.batch_put([key], [[ptr, ...]], [[nbytes, ...]])   # one object per key, gathered from parts
    c.batch_get([key], [[ptr, ...]], [[nbytes, ...]])   # bytes read per key (> 0), or a negative code
    c.batch_exists([key, ...])           # 1 present, 0 absent, negative: error
    c.health()                           # 0 healthy, 2 master unreachable (answers at once)
    c.close()

`connect()` first checks that the master's RPC port accepts a TCP connection, so a worker whose
master is down finds out in milliseconds instead of blocking in `setup()` (4.4 s per retry).
Codes: 0 OK; -704 not found; -706 leased; -600 invalid parameter; -900 RPC failed; -200 no space.
"""

from __future__ import annotations

import os
import socket
import threading

OK = 0
NOT_FOUND = -704
RPC_FAILED = -900
CODE_NAMES = {0: "ok", -704: "not_found", -706: "leased", -600: "invalid", -900: "rpc_failed",
              -200: "no_space", -1: "setup_failed"}


def code_name(code: int) -> str:
    return CODE_NAMES.get(int(code), f"code_{int(code)}")


class StoreClosed(RuntimeError):
    """The client is closed or closing: the native client must not be called."""


class StoreNotConnected(RuntimeError):
    """The client has not been set up (the master was unreachable)."""


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"kv store address: expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def master_reachable(address: str, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection(_split(address), timeout=timeout):
            return True
    except OSError:
        return False


class StoreClient:
    def __init__(self, master: str, *, segment_bytes: int = 64 << 20, local_buffer_bytes: int = 16 << 20,
                 local_hostname: str | None = None, protocol: str = "tcp", setup_retries: int = 1):
        _split(master)  # validate early
        self.master = master
        self.segment_bytes = int(segment_bytes)
        self.local_buffer_bytes = int(local_buffer_bytes)
        self.local_hostname = local_hostname or os.environ.get("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        self.protocol = protocol
        self.setup_retries = setup_retries
        self._store = None
        self._cv = threading.Condition()
        self._in_flight = 0
        self._closing = False
        self._registered: list[tuple[int, int]] = []

    # -- lifetime -------------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._store is not None and not self._closing

    @property
    def closed(self) -> bool:
        return self._closing

    def connect(self) -> bool:
        """One bounded setup attempt; True once connected. Registered buffers are re-registered."""
        with self._cv:
            if self._closing:
                raise StoreClosed("kv store client is closed")
            if self._store is not None:
                return True
        if not master_reachable(self.master):
            return False
        os.environ.setdefault("GLOG_minloglevel", "1")  # Mooncake's INFO lines: one per call otherwise
        from mooncake.store import MooncakeDistributedStore

        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", str(self.setup_retries))
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", self.local_hostname)
        store = MooncakeDistributedStore()
        rc = store.setup(self.local_hostname, "P2PHANDSHAKE", self.segment_bytes, self.local_buffer_bytes,
                         self.protocol, "", self.master)
        if rc != 0:
            return False
        for ptr, size in self._registered:
            store.register_buffer(ptr, size)
        with self._cv:
            if self._closing:  # closed while connecting: never publish it
                store.close()
                raise StoreClosed("kv store client is closed")
            self._store = store
        return True

    def close(self) -> None:
        """Refuse new calls, wait for the ones in flight, then close the native client (idempotent)."""
        with self._cv:
            if self._closing:
                return
            self._closing = True
            while self._in_flight:
                self._cv.wait()
            store, self._store = self._store, None
        if store is not None:
            store.close()

    # -- calls ----------------------------------------------------------------------------------
    def _call(self, name: str, *args):
        with self._cv:
            if self._closing:
                raise StoreClosed("kv store client is closed")
            store = self._store
            if store is None:
                raise StoreNotConnected(f"kv store client is not connected to {self.master}")
            self._in_flight += 1
        try:
            return getattr(store, name)(*args)
        finally:
            with self._cv:
                self._in_flight -= 1
                self._cv.notify_all()

    def register(self, ptr: int, size: int) -> int:
        """Register [ptr, ptr+size) for zero-copy puts/gets (kept across reconnects)."""
        self._registered.append((int(ptr), int(size)))
        if self._store is None:
            return OK
        return int(self._call("register_buffer", int(ptr), int(size)))

    def batch_exists(self, keys: list[str]) -> list[int]:
        if not keys:
            return []
        return [int(x) for x in self._call("batch_is_exist", list(keys))]

    def batch_put(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        """Store each key as the concatenation of its parts (registered memory). 0 per key on success."""
        if not keys:
            return []
        from mooncake.store import ReplicateConfig

        return [int(x) for x in self._call("batch_put_from_multi_buffers", list(keys), ptrs, sizes,
                                           ReplicateConfig())]

    def batch_get(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        """Read each key into its parts (registered memory). Bytes read per key on success (> 0)."""
        if not keys:
            return []
        return [int(x) for x in self._call("batch_get_into_multi_buffers", list(keys), ptrs, sizes)]

    def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        if not keys:
            return []
        from mooncake.store import ReplicateConfig

        return [int(x) for x in self._call("batch_put_from", list(keys), list(ptrs), list(sizes),
                                           ReplicateConfig())]

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        if not keys:
            return []
        return [int(x) for x in self._call("batch_get_into", list(keys), list(ptrs), list(sizes))]

    def health(self) -> int:
        """0 healthy, 2 master unreachable, -1 not connected."""
        try:
            return int(self._call("health_check"))
        except StoreNotConnected:
            return -1
