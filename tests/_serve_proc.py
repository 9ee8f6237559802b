"""`k3serve serve` as a real subprocess for end-to-end tests: started on a free port, its URL read from the
"listening on" line, an official `openai` client on it, and a clean exit on SIGTERM checked when done."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import openai
import pytest


def read_until(proc: subprocess.Popen, pattern: str, timeout: float, what: str,
               lines: list[str] | None = None) -> re.Match:
    """Reads proc's output lines (text stdout, stderr merged) into `lines` until one matches `pattern` and returns
    the match; a thread appends the rest of the output to `lines` after that, so the process never blocks on a full
    pipe. A process that ends or stays silent past `timeout` seconds is killed and fails the test with its output,
    naming `what`."""
    lines = [] if lines is None else lines
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(pattern, line)
        if m:
            threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout], daemon=True).start()
            return m
    proc.kill()
    pytest.fail(f"{what} did not start:\n" + "".join(lines) + (proc.stdout.read() or ""))


def popen_until(cmd: list[str], pattern: str, timeout: float, what: str) -> tuple[subprocess.Popen, re.Match, list[str]]:
    """Starts cmd (PYTHONSAFEPATH=1) and `read_until` its line matching `pattern`: (process, match, its output)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONSAFEPATH="1"))
    lines: list[str] = []
    return proc, read_until(proc, pattern, timeout, what, lines), lines


@contextlib.contextmanager
def serve_process(model_dir, *args: str, start_timeout: float = 180) -> Iterator[tuple[str, openai.OpenAI]]:
    """Runs `k3serve serve MODEL_DIR --port 0 ARGS...`; yields (url, client); fails the test with the server's
    output when it does not start within start_timeout seconds."""
    cmd = [sys.executable, "-m", "k3serve.cli", "serve", str(model_dir), "--port", "0", *args]
    proc, m, _ = popen_until(cmd, r"listening on (http://127\.0\.0\.1:\d+)", start_timeout, "k3serve serve")
    url = m.group(1)
    try:
        yield url, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    finally:
        proc.terminate()
        try:
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
