"""Helpers for the Triton-interpreter tests (TRITON_INTERPRET=1 must be set before the kernels import).

On a machine with CUDA the interpreter is left off (it would also reroute GPU tests that import kernels
later in the same process) and these CPU tests skip themselves: tests/gpu covers the kernels there.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET_OK = not torch.cuda.is_available()
if INTERPRET_OK:
    os.environ["TRITON_INTERPRET"] = "1"

skip_on_cuda = pytest.mark.skipif(not INTERPRET_OK, reason="interpreter tests run on CPU-only machines")

torch.set_num_threads(1)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def cu_of(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
