"""Small helpers shared by the Triton kernels: dtype maps, size helpers, the interpreter switch."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
"""torch float dtype -> triton dtype (float64 is not handled by the Triton kernels)."""


def interpreting() -> bool:
    """True when Triton runs in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


def is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def any_f64(*tensors) -> bool:
    """True if any given tensor is float64 (those calls go to the reference ops)."""
    return any(t is not None and t.dtype == torch.float64 for t in tensors)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision for fp32 operands: exact IEEE for fp32 data, tf32 otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def inter_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of stored intermediates: the activation dtype for 16-bit inputs, else fp32."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32


def _patch_interpreter() -> None:
    """Work around two bugs of Triton 3.6's CPU interpreter (no effect on compiled kernels). 1: it turns a loaded scalar into a 1-element array whose `__index__` fails
    (`range(tl.load(p), ...)`); make `__index__` accept any single-element array. CPU interpreter only."""
    import numpy as np
    from triton.runtime import interpreter as _interp

    if getattr(_interp, "_k3serve_index_patch", False):
        return
    orig = _interp._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interp._patch_lang_tensor = patched

    # Its dot also multiplies bfloat16 operands as their raw uint16 bit patterns: widen them first.
    builder_cls = _interp.InterpreterBuilder
    orig_dot = builder_cls.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def widen(x):
            if x.dtype.scalar == tl.bfloat16:
                data = _interp._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
                return _interp.TensorHandle(data, tl.float32)
            return x

        return orig_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder_cls.create_dot = create_dot
    _interp._k3serve_index_patch = True


if interpreting():
    _patch_interpreter()
