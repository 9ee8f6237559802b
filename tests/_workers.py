"""Real `k3serve worker` processes for tests: start one (`_start`), wait for its ready line (`_wait_ready`), a
gRPC handle on a ready one (`_W`), and `worker_group`, which waits for a dict of started workers and, at the
end, closes their channels and stops them (SIGTERM, wait, SIGKILL). `_metric` sums a metric in a worker's
/metrics text."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from k3serve.proto import worker_pb2_grpc as pb_grpc

MAX_LEN = 256


def _start(model_dir, role, *extra, env_extra=None):
    cmd = [sys.executable, "-m", "k3serve.cli", "worker", "--model", str(model_dir), "--role", role,
           "--grpc-port", "0", "--metrics-port", "0", "--max-model-len", str(MAX_LEN), "--dtype", "float64",
           "--skip-tokenizer-init", "--num-threads", "1", "--log-level", "warning", *extra]
    env = dict(os.environ, PYTHONSAFEPATH="1", **(env_extra or {}))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _wait_ready(proc, timeout=240):
    """(grpc address, metrics url) from the worker's ready line; its later output is drained by a thread."""
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"ready grpc=(\S+) metrics=(\S+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return m.group(1), m.group(2)
    proc.kill()
    pytest.fail("worker did not start:\n" + "".join(lines))


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


def _metric(text, name, **labels):
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
