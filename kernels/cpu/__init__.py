"""k3serve.kernels.cpu: batched PyTorch implementations of the hot ops for CPU tensors.

The reference ops (k3serve.kernels.reference) are the oracles: written per sequence and per expert so
that they read like the math. On the CPU the engine's step is made of those loops' many small ops
(benchmarks/vs_transformers.py, docs/kernels-notes.md "CPU"); the functions here compute the same
contracts over the whole batch at once (decode rows gathered together, prefill chunks of every sequence
side by side, experts dense when that touches fewer bytes than the loop's overhead costs). Each one has
exactly the reference signature and hands inputs outside its fast path to the reference op, so a
registration never narrows a contract. `k3serve.kernels.ops` sends CPU tensors here
(K3SERVE_KERNELS=reference turns that off); tests/test_kernels_cpu.py compares every op with the
reference on random shapes.
"""

from .conv import causal_conv1d_varlen
from .kda import kda_chunked, kda_decode
from .mla import mla_paged_attention
from .moe import moe_experts

OPS = {
    "causal_conv1d_varlen": causal_conv1d_varlen,
    "kda_chunked": kda_chunked,
    "kda_decode": kda_decode,
    "mla_paged_attention": mla_paged_attention,
    "moe_experts": moe_experts,
}
"""{op name: implementation} for CPU tensors."""

__all__ = ["OPS", "causal_conv1d_varlen", "kda_chunked", "kda_decode", "mla_paged_attention", "moe_experts"]
