"""`k3serve run-local`: the old name of `k3serve up` (k3serve/up.py), kept as an alias."""

from __future__ import annotations

from k3serve.up import configure, run

__all__ = ["configure", "run"]
