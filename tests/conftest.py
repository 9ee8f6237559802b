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


# --- every test starts from the same global RNG state, whatever ran before it on its xdist worker ---------
# Tests that draw from torch's / random's global generators (most kernel tests) would otherwise see inputs
# that depend on which tests the scheduler gave the same worker first: a marginal case then fails in one CI
# run and not the next. The seed is the test's node id, so each test keeps its own (randomized) inputs.
@pytest.fixture(autouse=True)
def _seed_global_rngs(request):
    import random
    import zlib

    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    # (only what is already imported: a test that never touches torch does not pay for importing it)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed)
