"""Start `k3serve up` for a test module and stop it again (shared by the router/platform tests)."""

from __future__ import annotations

import contextlib
import json
import signal
import sys

from tests._serve_proc import popen_until


@contextlib.contextmanager
def running_up(model_dir, logs, *extra: str, max_model_len: int, start_timeout: float = 240,
               stop_timeout: float = 30, check_exit: bool = True):
    """`k3serve up --model DIR ... --port 0` (float64, one thread, served name "tiny") until it prints the
    gateway URL; yields {"url", "proc", "state" (platform.json), "lines"}; SIGINT at the end (exit 0 asserted
    when `check_exit`)."""
    cmd = [sys.executable, "-m", "k3serve.cli", "up", *extra, "--model", str(model_dir), "--port", "0",
           "--log-dir", str(logs), "--max-model-len", str(max_model_len), "--dtype", "float64",
           "--num-threads", "1", "--served-model-name", "tiny"]
    proc, m, lines = popen_until(cmd, r"API is at (http://\S+)/v1", start_timeout, f"k3serve up {' '.join(extra)}")
    url = m.group(1)
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
