"""Shared pytest fixtures (several engineers append here; keep sections self-contained)."""

import os
import sys

import pytest

# test helper modules (tests/_*.py) import by plain name under --import-mode=importlib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# On a CPU-only machine the Triton kernels run under the interpreter, which must be switched on before ANY
# module decorates a @triton.jit function; doing it here (before collection imports test modules, e.g. a GPU
# test file that imports a kernel module) keeps the import order of test files from mattering.
import _triton_cpu  # noqa: E402,F401


# --- k3serve.workers.model: the generated tiny checkpoint, shared by the whole session ---------------
@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The tiny preset's checkpoint directory (`ensure_tiny_model()`, seed 0).

    Unless K3SERVE_HOME is already set (e.g. by the Makefile, which keeps the model cached across runs),
    K3SERVE_HOME points at a per-session temporary directory for the rest of the session.
    """
    from k3serve.workers.model.paths import ensure_tiny_model

    if os.environ.get("K3SERVE_HOME"):
        yield ensure_tiny_model()
        return
    os.environ["K3SERVE_HOME"] = str(tmp_path_factory.mktemp("k3serve_home"))
    try:
        yield ensure_tiny_model()
    finally:
        os.environ.pop("K3SERVE_HOME", None)
