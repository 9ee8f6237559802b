"""The training runs' progress log (workers/model/train/run.py, distill_mtp.py): each line, stamped with the
seconds since the log was opened, to stdout and appended to a file."""

from __future__ import annotations

import time
from pathlib import Path


class Log:
    def __init__(self, path: Path):
        self.f = open(path, "a")
        self.t0 = time.time()

    def __call__(self, msg: str) -> None:
        line = f"[{time.time() - self.t0:7.1f}s] {msg}"
        print(line, flush=True)
        self.f.write(line + "\n")
        self.f.flush()
