"""Start `k3serve up` for a test module and stop it again (shared by the router/platform tests)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest


@contextlib.contextmanager
def running_up(model_dir, logs, *extra: str, max_model_len: int, start_timeout: float = 240,
               stop_timeout: float = 30, check_exit: bool = True):
    """`k3serve up --model DIR ... --port 0` (float64, one thread, served name "tiny") until it prints the
    gateway URL; yields {"url", "proc", "state" (platform.json), "lines"}; SIGINT at the end (exit 0 asserted
    when `check_exit`)."""
    cmd = [sys.executable, "-m", "k3serve.cli", "up", *extra, "--model", str(model_dir), "--port", "0",
           "--log-dir", str(logs), "--max-model-len", str(max_model_len), "--dtype", "float64",
           "--num-threads", "1", "--served-model-name", "tiny"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONSAFEPATH="1"))
    lines, url = [], None
    deadline = time.monotonic() + start_timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"API is at (http://\S+)/v1", line)
        if m:
            url = m.group(1)
            break
    if url is None:
        proc.kill()
        pytest.fail(f"k3serve up {' '.join(extra)} did not come up:\n" + "".join(lines))
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    state = json.loads((logs / "platform.json").read_text())
    try:
        yield {"url": url, "proc": proc, "state": state, "lines": lines}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=stop_timeout)
            if check_exit:
                assert code == 0
        finally:
            if proc.poll() is None:
                proc.kill()
