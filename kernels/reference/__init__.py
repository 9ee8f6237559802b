"""k3serve.kernels.reference: plain-PyTorch reference implementations (oracles for the fast kernels).

Every op here has the serving signature that `k3serve.kernels.ops` exposes (and that the Triton
implementations will share). Only torch is imported.
"""

from .activations import silu_and_mul, situ_and_mul
from .attn_res import attn_res
from .conv import causal_conv1d_varlen
from .kda_chunked import kda_chunked
from .kda_decode import kda_decode
from .kda_gate import kda_gate
from .kda_recurrent import kda_recurrent
from .linear import linear
from .mla import mla_attention_expanded, mla_paged_attention, mla_write_cache
from .moe_experts import moe_experts
from .moe_route import moe_route
from .norms import add_rms_norm, l2_normalize, rms_norm, rms_norm_gated

OPS = (
    "linear",
    "rms_norm",
    "add_rms_norm",
    "rms_norm_gated",
    "l2_normalize",
    "situ_and_mul",
    "silu_and_mul",
    "causal_conv1d_varlen",
    "kda_gate",
    "kda_recurrent",
    "kda_chunked",
    "kda_decode",
    "attn_res",
    "mla_write_cache",
    "mla_paged_attention",
    "mla_attention_expanded",
    "moe_route",
    "moe_experts",
)
"""Names of the dispatched ops (each is a function of this package and of `k3serve.kernels.ops`)."""

__all__ = [
    "OPS",
    "add_rms_norm",
    "attn_res",
    "causal_conv1d_varlen",
    "kda_chunked",
    "kda_decode",
    "kda_gate",
    "kda_recurrent",
    "l2_normalize",
    "linear",
    "mla_attention_expanded",
    "mla_paged_attention",
    "mla_write_cache",
    "moe_experts",
    "moe_route",
    "rms_norm",
    "rms_norm_gated",
    "silu_and_mul",
    "situ_and_mul",
]
