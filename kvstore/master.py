"""The Mooncake master: its command line (one definition, also rendered into the operator's pod) and
a local launcher that starts, health-checks and stops it.

    args = master_args("127.0.0.1", 50051, "127.0.0.1", 9003)     # pure: a list of flags
    with MooncakeMaster(port=0) as m:                              # local mode, loopback only
        m.address                                                  # "127.0.0.1:PORT" for clients
        m.healthy()                                                # GET /health on the metrics port

The master keeps every object in memory: a restart loses every key (the store is a cache). It never
needs the HTTP metadata server (clients use P2PHANDSHAKE), so it is always off; `/metrics` and
`/health` are served on the metrics host:port. The master itself binds only the addresses given, but
the store *clients* listen on every interface: see kvstore/netns.py.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

DEFAULT_LEASE_TTL_MS = 5000  # how long a read keeps an object from eviction


def master_args(rpc_address: str, rpc_port: int | str, metrics_host: str, metrics_port: int | str, *,
                eviction_high_watermark_ratio: float = 0.9, eviction_ratio: float = 0.1,
                default_kv_lease_ttl_ms: int = DEFAULT_LEASE_TTL_MS, rpc_threads: int | None = None) -> list[str]:
    """The master's flags (no binary name); addresses may be placeholders such as `$(K3SERVE_POD_IP)`."""
    args = [
        f"--rpc_address={rpc_address}",
        f"--rpc_port={rpc_port}",
        "--enable_http_metadata_server=false",
        f"--metrics_host={metrics_host}",
        f"--metrics_port={metrics_port}",
        f"--eviction_high_watermark_ratio={eviction_high_watermark_ratio}",
        f"--eviction_ratio={eviction_ratio}",
        f"--default_kv_lease_ttl={default_kv_lease_ttl_ms}",
    ]
    if rpc_threads:
        args.append(f"--rpc_thread_num={rpc_threads}")
    return args + ["--logtostderr"]


def master_binary() -> str:
    """`mooncake_master` next to this interpreter (the venv), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    if os.path.exists(here):
        return here
    found = shutil.which("mooncake_master")
    if not found:
        raise FileNotFoundError("mooncake_master not found (install mooncake-transfer-engine-non-cuda)")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MasterError(RuntimeError):
    pass


class MooncakeMaster:
    """A local `mooncake_master` on loopback. `port=0` / `metrics_port=0` pick free ports."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, metrics_port: int = 0, *,
                 log_path: str | None = None, rpc_threads: int | None = 4, **flags):
        self.host = host
        self.port = port or free_port(host)
        self.metrics_port = metrics_port or free_port(host)
        self.log_path = log_path
        self.rpc_threads = rpc_threads
        self.flags = flags
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def argv(self) -> list[str]:
        return [master_binary(), *master_args(self.host, self.port, self.host, self.metrics_port,
                                              rpc_threads=self.rpc_threads, **self.flags)]

    def start(self, timeout: float = 10.0) -> MooncakeMaster:
        if self.proc is not None and self.proc.poll() is None:
            return self
        self._log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.argv(), stdout=self._log, stderr=self._log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise MasterError(f"mooncake_master exited with code {self.proc.returncode} at start "
                                  f"(log: {self.log_path or 'not kept'})")
            if self.healthy():
                return self
            time.sleep(0.05)
        self.stop()
        raise MasterError(f"mooncake_master did not become healthy within {timeout} s")

    def healthy(self, timeout: float = 0.5) -> bool:
        """The master answers `/health` on its metrics port and its RPC port accepts connections."""
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.metrics_port}/health", timeout=timeout) as r:
                if r.status != 200:
                    return False
            with socket.create_connection((self.host, self.port), timeout=timeout):
                return True
        except (OSError, urllib.error.URLError):
            return False

    def metrics_text(self, timeout: float = 2.0) -> str:
        with urllib.request.urlopen(f"http://{self.host}:{self.metrics_port}/metrics", timeout=timeout) as r:
            return r.read().decode()

    def kill(self) -> None:
        """SIGKILL (an outage: clients are not told)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout: float = 5.0) -> None:
        p, self.proc = self.proc, None
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
        self._log = None

    def restart(self) -> MooncakeMaster:
        """Kill and start again on the same ports (all keys are lost)."""
        self.kill()
        self.stop()
        return self.start()

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
