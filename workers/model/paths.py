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


DEMO_MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "k3-demo-stdlib"
"""The trained demo model in the repository (models/k3-demo-stdlib, made by scripts/train_demo_model.py)."""


def default_serving_model() -> Path:
    """The model `k3serve up` / `make run` serve when no `--model` is given.

    The trained demo model (`DEMO_MODEL_DIR`) when the checkout holds it, else the generated tiny model
    (random weights). Tests that need random weights call `ensure_tiny_model` directly.
    """
    if (DEMO_MODEL_DIR / "config.json").is_file():
        return DEMO_MODEL_DIR
    return ensure_tiny_model()
