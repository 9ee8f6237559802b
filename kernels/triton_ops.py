"""Registers the Triton kernels with `k3serve.kernels.ops` (imported automatically on the first CUDA call).

Every registered function keeps the reference signature; inputs a kernel does not handle (float64,
non-power-of-two head sizes, ...) are passed on to the reference op, so a registration never narrows
the op's contract. Importing this module needs triton (the dispatcher treats its absence as "no kernels").
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from . import reference
from .ops import register_impl
from .triton import attn_res as _ar
from .triton import conv as _cv
from .triton import gemv as _gemv
from .triton import kda_chunk as _kc
from .triton import kda_decode as _kd
from .triton import kda_recurrent as _kr
from .triton import mla_cache as _mlc
from .triton import mla_decode as _mla
from .triton import moe as _moe
from .triton import pointwise as _pw

SKINNY_GEMM = os.environ.get("K3SERVE_SKINNY_GEMM", "1") != "0"
"""Decode-sized projections (M <= 16 rows) go to the Triton skinny GEMM (kernels/triton/gemv.py); False (or
K3SERVE_SKINNY_GEMM=0) keeps every projection on cuBLAS. Read at each call, so a benchmark can measure both
in one process (benchmarks/decode_roofline.py --compare-skinny)."""


def _kda_chunked(q, k, v, g, beta, state_pool, state_indices, cu_seqlens, has_initial_state, **kw):
    if not _kc.supported(q, k, v, g, beta, state_pool):
        return reference.kda_chunked(q, k, v, g, beta, state_pool, state_indices, cu_seqlens, has_initial_state, **kw)
    B = cu_seqlens.numel() - 1
    if kw.get("checkpoint_seq") is None and q.shape[0] <= 2 * B:  # decode-shaped: token-serial, no host sync
        kw.pop("chunk_size", None)
        kw.pop("host", None)  # (the token-serial kernel builds no chunk plan: it never reads the index arguments back)
        return _kr.kda_recurrent_triton(q, k, v, g, beta, state_pool, state_indices, cu_seqlens, has_initial_state,
                                        **kw)
    return _kc.kda_chunked_triton(q, k, v, g, beta, state_pool, state_indices, cu_seqlens, has_initial_state, **kw)


def _kda_recurrent(q, k, v, g, beta, state_pool, state_indices, cu_seqlens, has_initial_state, **kw):
    if not _kc.supported(q, k, v, g, beta, state_pool):
        return reference.kda_recurrent(q, k, v, g, beta, state_pool, state_indices, cu_seqlens, has_initial_state,
                                       **kw)
    if kw.get("checkpoint_seq") is not None:  # exact same function; the chunk path handles any checkpoints
        return _kc.kda_chunked_triton(q, k, v, g, beta, state_pool, state_indices, cu_seqlens, has_initial_state,
                                      **kw)
    return _kr.kda_recurrent_triton(q, k, v, g, beta, state_pool, state_indices, cu_seqlens, has_initial_state, **kw)


def _causal_conv1d_varlen(x, weight, conv_states, state_indices, cu_seqlens, has_initial_state, **kw):
    fn = _cv.causal_conv1d_varlen_triton if _cv.supported(x, weight, conv_states) else reference.causal_conv1d_varlen
    return fn(x, weight, conv_states, state_indices, cu_seqlens, has_initial_state, **kw)


def _kda_decode(qkv, conv_weight, conv_states, raw_g, A_log, dt_bias, beta_logit, gate, o_norm_weight, state_pool,
                state_indices, has_initial_state, **kw):
    args = (qkv, conv_weight, conv_states, raw_g, A_log, dt_bias, beta_logit, gate, o_norm_weight, state_pool,
            state_indices, has_initial_state)
    if not _kd.supported(qkv, raw_g, state_pool, conv_states):
        return reference.kda_decode(*args, **kw)
    return _kd.kda_decode_triton(*args, **kw)


def _attn_res(partial, delta, blocks, w_norm, w_q, w_out, n, write_idx, eps, eps_out=None, round_dtype=None):
    fn = _ar.attn_res_triton if _ar.supported(partial, delta, blocks, round_dtype) else reference.attn_res
    return fn(partial, delta, blocks, w_norm, w_q, w_out, n, write_idx, eps, eps_out, round_dtype)


def _mla_paged_attention(q_lat, q_pe, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, *, kv_lora_rank):
    fn = _mla.mla_paged_attention_triton if _mla.supported(q_lat, q_pe, kv_cache, kv_lora_rank) else (
        reference.mla_paged_attention)
    return fn(q_lat, q_pe, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, kv_lora_rank=kv_lora_rank)


def _mla_write_cache(c_kv, k_pe, kv_cache, slot_mapping):
    fn = _mlc.mla_write_cache_triton if _mlc.supported(c_kv, k_pe, kv_cache) else reference.mla_write_cache
    return fn(c_kv, k_pe, kv_cache, slot_mapping)


def _moe_route(router_logits, correction_bias, top_k, **kw):
    if router_logits.dtype == torch.float64:
        return reference.moe_route(router_logits, correction_bias, top_k, **kw)
    return _moe.moe_route_triton(router_logits, correction_bias, top_k, **kw)


def _moe_experts(z, topk_weights, topk_ids, **kw):
    if not _moe.supported(z, kw.get("w13"), kw.get("w2")):
        return reference.moe_experts(z, topk_weights, topk_ids, **kw)
    return _moe.moe_experts_triton(z, topk_weights, topk_ids, **kw)


def _linear(x, weight, dtype=None):
    if SKINNY_GEMM and _gemv.supported(x, weight, dtype):
        return _gemv.skinny_linear_triton(x, weight, dtype)
    return reference.linear(x, weight, dtype)


def _rms_norm(x, weight, eps):
    if not _pw.supported(x) or (weight is not None and weight.device != x.device):
        return reference.rms_norm(x, weight, eps)
    return _pw.rms_norm_triton(x, weight, eps)


def _add_rms_norm(x, residual, weight, eps):
    if not _pw.supported(x) or (weight is not None and weight.device != x.device):
        return reference.add_rms_norm(x, residual, weight, eps)  # (a mismatched residual: ValueError either way)
    return _pw.add_rms_norm_triton(x, residual, weight, eps)


def _rms_norm_gated(x, gate, weight, eps, out_dtype=None):
    ok = _pw.supported(x) and _pw.supported(gate) and gate.device == x.device and (out_dtype or x.dtype) in _pw.TL_DTYPE
    if weight is not None:  # (a float64 weight makes the reference compute in float64)
        ok = ok and weight.device == x.device and weight.dtype != torch.float64
    if not ok:
        return reference.rms_norm_gated(x, gate, weight, eps, out_dtype)
    return _pw.rms_norm_gated_triton(x, gate, weight, eps, out_dtype)


def _kda_gate(raw_g, A_log, dt_bias, lower_bound=None):
    ins = (raw_g, A_log, dt_bias)
    if not all(_pw.supported(t) and t.device == raw_g.device for t in ins):  # float64 anywhere: the reference
        return reference.kda_gate(raw_g, A_log, dt_bias, lower_bound)
    return _pw.kda_gate_triton(raw_g, A_log, dt_bias, lower_bound)


def _silu_and_mul(x):
    return _pw.silu_and_mul_triton(x) if _pw.supported(x) else reference.silu_and_mul(x)


def _situ_and_mul(x, beta=4.0, linear_beta=None):
    fn = _pw.situ_and_mul_triton if _pw.supported(x) else reference.situ_and_mul
    return fn(x, beta, linear_beta)


IMPLS: dict[str, Callable] = {
    "kda_chunked": _kda_chunked,
    "kda_recurrent": _kda_recurrent,
    "kda_decode": _kda_decode,
    "causal_conv1d_varlen": _causal_conv1d_varlen,
    "attn_res": _attn_res,
    "mla_paged_attention": _mla_paged_attention,
    "mla_write_cache": _mla_write_cache,
    "moe_route": _moe_route,
    "moe_experts": _moe_experts,
    "linear": _linear,
    "rms_norm": _rms_norm,
    "add_rms_norm": _add_rms_norm,
    "rms_norm_gated": _rms_norm_gated,
    "kda_gate": _kda_gate,
    "silu_and_mul": _silu_and_mul,
    "situ_and_mul": _situ_and_mul,
}
"""Op name -> the registered Triton-backed function (reference signature)."""

for _name, _fn in IMPLS.items():
    register_impl(_name, _fn)
