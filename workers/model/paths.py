"""Where generated models live: `$K3SERVE_HOME` or `~/.cache/k3serve`; `ensure_tiny_model` creates the tiny one."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

TINY_FORMAT_VERSION = 2
"""Bump when make-model's output for the tiny preset changes, so stale caches are not reused."""


def model_cache_dir() -> Path:
    """`$K3SERVE_HOME` when set (and non-empty), else `~/.cache/k3serve`. Not created here."""
    home = os.environ.get("K3SERVE_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "k3serve"


def ensure_tiny_model(seed: int = 0) -> Path:
    """The tiny preset's checkpoint directory for `seed`, generated on first use.

    Generation writes into a temporary sibling directory that is renamed into place, so a reader never
    sees a half-written model; a concurrent generator that loses the race discards its copy.
    """
    root = model_cache_dir() / "models"
    final = root / f"k3-tiny-v{TINY_FORMAT_VERSION}-seed{seed}"
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    from .make_model import make_model

    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        make_model(tmp, preset="tiny", seed=seed)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def default_serving_model() -> Path:
    """The model `k3serve up` / `make run` serve when no `--model` is given.

    The generated tiny model (random weights) until the trained demo model lands; then this returns
    the demo model. Tests that need random weights call `ensure_tiny_model` directly.
    """
    return ensure_tiny_model()
