"""k3serve.kernels: compute ops of the K3 model with serving signatures.

`k3serve.kernels.ops` is the entry point the model runner calls (it dispatches to Triton on CUDA once
registered, else to the plain-PyTorch `k3serve.kernels.reference`). Importing this package needs only
torch (triton is optional).
"""

from . import ops, reference
from .ops import *  # noqa: F403  (the op functions, register_impl, unregister_impl, registered)

__all__ = ["ops", "reference", *ops.__all__]
