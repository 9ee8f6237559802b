"""Packaging contracts: import names, lightweight model/kernel imports, no stdlib shadowing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _py(code: str, cwd: Path = ROOT, safe: bool = True) -> str:
    env = {"PATH": "/usr/bin:/bin", "PYTHONSAFEPATH": "1" if safe else ""}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          check=True, timeout=120).stdout.strip()


def test_offline_api_import_names():
    out = _py("from k3serve.workers import LLM, SamplingParams; print(LLM.__module__, SamplingParams.__name__)")
    assert out == "k3serve.workers.llm SamplingParams"


def test_model_and_kernels_import_without_server_stacks():
    out = _py("import sys, k3serve.workers.model, k3serve.workers.model.reference, k3serve.kernels; "
              "print(sorted(m for m in ('fastapi', 'grpc', 'kopf', 'pydantic', 'uvicorn', 'prometheus_client', "
              "'transformers') if m in sys.modules))")
    assert out == "[]"


def test_repo_root_never_shadows_stdlib_operator():
    # even with the repo root first on sys.path (a plain `python` started there), `operator` is stdlib
    out = _py("import sys; sys.path.insert(0, '.'); sys.modules.pop('operator', None); import operator; "
              "print(operator.__file__)", safe=False)
    assert str(ROOT) not in out and out.endswith("operator.py")
    assert _py("import k3serve.operator.crd as c; print(c.KIND)") == "KimiK3Deployment"
