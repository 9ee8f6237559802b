"""Real `k3serve worker` processes for tests: start one (`_start`), wait for its ready line (`_wait_ready`), a
gRPC handle on a ready one (`_W`), and `worker_group`, which waits for a dict of started workers and, at the
end, closes their channels and stops them (SIGTERM, wait, SIGKILL). A worker "pod" of a multi-node group
(`_Proc`: its own session, so SIGKILL of the group kills its whole tree) runs `_cli`'s command line with
`ENV`; `assert_node_exits_when_leader_lost` checks a group's node once its leader is lost. `_metric` sums a
metric in a worker's /metrics text."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc

from k3serve.proto import worker_pb2_grpc as pb_grpc
from tests._serve_proc import read_until

MAX_LEN = 256
ENV = dict(os.environ, PYTHONSAFEPATH="1", K3SERVE_RENDEZVOUS_TIMEOUT_S="60")


def _start(model_dir, role, *extra, env_extra=None):
    cmd = [sys.executable, "-m", "k3serve.cli", "worker", "--model", str(model_dir), "--role", role,
           "--grpc-port", "0", "--metrics-port", "0", "--max-model-len", str(MAX_LEN), "--dtype", "float64",
           "--skip-tokenizer-init", "--num-threads", "1", "--log-level", "warning", *extra]
    env = dict(os.environ, PYTHONSAFEPATH="1", **(env_extra or {}))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _wait_ready(proc, timeout=240, lines=None):
    """(grpc address, metrics url) from the worker's ready line. Its output goes on into `lines` (a thread reads
    it after the ready line); a worker that exits or stays silent past `timeout` is killed and fails the test."""
    m = read_until(proc, r"ready grpc=(\S+) metrics=(\S+)", timeout, "worker", lines)
    return m.group(1), m.group(2)


class _W:
    def __init__(self, proc, addr, murl):
        self.proc, self.addr, self.murl = proc, addr, murl
        self.channel = grpc.insecure_channel(addr)
        self.stub = pb_grpc.WorkerStub(self.channel)


@contextlib.contextmanager
def worker_group(procs: dict, stop_timeout: float = 10, expect_clean_exit: bool = False):
    """{name: _W} once every started worker in `procs` ({name: Popen}) is ready. At the end: channels closed,
    SIGTERM to every live worker (also to a process a test put in place of one, a restart), `stop_timeout`
    seconds each to exit, then SIGKILL; with `expect_clean_exit`, a worker that exits non-zero fails the test."""
    out = {}
    try:
        for k, p in procs.items():
            out[k] = _W(p, *_wait_ready(p))
        yield out
    finally:
        for w in out.values():
            w.channel.close()
        alive = list(procs.values()) + [w.proc for w in out.values() if w.proc not in procs.values()]
        for p in alive:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = []
        for p in alive:
            try:
                codes.append(p.wait(stop_timeout))
            except subprocess.TimeoutExpired:
                p.kill()
        if expect_clean_exit:
            assert all(c == 0 for c in codes), codes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "k3serve.cli", "worker", *args, "--num-threads", "1", "--log-level", "warning"]


class _Proc:
    """A process in its own session (a "pod": SIGKILL of its group kills the whole tree), output collected."""

    def __init__(self, cmd: list[str], env=ENV):
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                  start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: [self.lines.append(x) for x in self.p.stdout], daemon=True).start()

    def wait_line(self, pattern: str, timeout_s: float = 180.0) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                m = re.search(pattern, line)
                if m:
                    return m
            if self.p.poll() is not None:
                time.sleep(0.2)  # the reader thread drains the last lines
                break
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r}; output:\n" + "".join(self.lines))

    def output(self) -> str:
        return "".join(self.lines)

    def kill_tree(self) -> None:
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.p.wait(10)


def assert_node_exits_when_leader_lost(leader: _Proc, node: _Proc, how: str) -> None:
    """SIGKILL of the leader's tree ("killed": its connections close) or SIGSTOP ("frozen": its sockets stay open,
    its heartbeats stop): the node process exits 1 within 10 s, saying it stops."""
    t0 = time.monotonic()
    if how == "killed":
        leader.kill_tree()
    else:
        os.killpg(leader.p.pid, signal.SIGSTOP)
    node.p.wait(10)
    assert node.p.returncode == 1 and time.monotonic() - t0 < 10, node.output()
    assert "rank 1 exited (status 1); stopping this node" in node.output()


def _metric(text, name, **labels):
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
