"""Kernel entry points with the serving signatures; the model runner calls these.

Dispatch happens in ONE place, `_impl(name, tensor)`: a tensor on CUDA goes to the implementation
registered for the "triton" backend under that op name (if any), everything else to
`k3serve.kernels.reference`. A Triton package registers itself with `register_impl(name, fn)`; the
module `k3serve.kernels.triton_ops`, if it exists, is imported on the first CUDA call so it can do so.
CPU tensors go to the batched CPU forms in `k3serve.kernels.cpu` where it has one (same contracts).
Setting the environment variable K3SERVE_KERNELS=reference forces the reference ops everywhere;
K3SERVE_KERNELS=triton sends CPU tensors to the Triton registrations too, which only makes sense under
Triton's CPU interpreter (TRITON_INTERPRET=1): it runs the whole engine on the kernels without a GPU.
Registered functions must have exactly the reference signature (see the reference docstrings).
Inside `pinned_kernels()` (the engine's forward, workers/engine/k3_forward.py) the variable is read once when it
is entered and every op name's choice is remembered until it exits: ~100 op calls per CPU decode step no longer
each read os.environ and walk the registries (~0.3 ms per step).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from collections.abc import Callable, Iterator

import torch

from . import cpu, reference
from .cpu import kda_verify as _cpu_kda_verify

TRITON = "triton"
_AUTOLOAD_MODULE = "k3serve.kernels.triton_ops"
_registry: dict[str, dict[str, Callable]] = {TRITON: {}}
_autoload_done = False
_generation = [0]  # bumped by every registration change: pinned choices made before it are forgotten


class _Pin(threading.local):
    """One thread's pin (see `pinned_kernels`): the pinned K3SERVE_KERNELS value (None: not pinned) and the
    choices made under it, {(op name, CUDA tensor): implementation}, valid for registry generation `generation`.
    Per thread, so an engine thread's open pin never steers another thread's ops (a test that set the variable,
    another engine)."""

    def __init__(self):
        self.mode: str | None = None
        self.impls: dict[tuple[str, bool], Callable] = {}
        self.generation = 0


_pin = _Pin()


def register_impl(name: str, fn: Callable, backend: str = TRITON) -> None:
    """Register `fn` as the `backend` implementation of op `name` (one of `reference.OPS`)."""
    if name not in reference.OPS:
        raise ValueError(f"unknown kernel op {name!r}")
    _registry.setdefault(backend, {})[name] = fn
    _generation[0] += 1


def unregister_impl(name: str, backend: str = TRITON) -> None:
    """Remove a registration (no-op if absent)."""
    _registry.get(backend, {}).pop(name, None)
    _generation[0] += 1


def registered(backend: str = TRITON) -> dict[str, Callable]:
    """A copy of {op name: fn} registered for `backend`."""
    return dict(_registry.get(backend, {}))


def _autoload() -> None:
    global _autoload_done
    if _autoload_done:
        return
    _autoload_done = True
    try:
        importlib.import_module(_AUTOLOAD_MODULE)
    except ModuleNotFoundError as e:  # no Triton package (or no triton): stay on the reference ops
        if e.name not in (_AUTOLOAD_MODULE, "triton"):
            raise


def pinned_mode() -> str | None:
    """The K3SERVE_KERNELS value this thread's open `pinned_kernels()` pinned, or None outside every block."""
    return _pin.mode


def pinned_choices() -> dict[tuple[str, bool], Callable]:
    """A copy of this thread's remembered choices still valid ({} after a registration change or outside a block)."""
    return dict(_pin.impls) if _pin.generation == _generation[0] else {}


def _mode() -> str:
    """K3SERVE_KERNELS: the value pinned by this thread's open `pinned_kernels()`, else read from the environment."""
    mode = _pin.mode
    return mode if mode is not None else os.environ.get("K3SERVE_KERNELS", "")


@contextlib.contextmanager
def pinned_kernels() -> Iterator[None]:
    """Within the block, ops called from this thread dispatch on K3SERVE_KERNELS as read on entry and remember each
    op's implementation (a registration change forgets them). Nested blocks keep the outer pin; other threads are
    not pinned by it; outside every block each op call reads the environment, so tests may set it at any time."""
    pin = _pin
    if pin.mode is not None:
        yield
        return
    pin.impls.clear()
    pin.generation = _generation[0]
    pin.mode = os.environ.get("K3SERVE_KERNELS", "")
    try:
        yield
    finally:
        pin.mode = None
        pin.impls.clear()


def _impl(name: str, tensor: torch.Tensor) -> Callable:
    """The implementation of op `name` for data living where `tensor` lives."""
    pin = _pin
    if pin.mode is None:
        return _choose(name, tensor.is_cuda, os.environ.get("K3SERVE_KERNELS", ""))
    if pin.generation != _generation[0]:
        pin.impls.clear()
        pin.generation = _generation[0]
    key = (name, tensor.is_cuda)
    fn = pin.impls.get(key)
    if fn is None:
        fn = pin.impls[key] = _choose(name, tensor.is_cuda, pin.mode)
    return fn


def _choose(name: str, is_cuda: bool, mode: str) -> Callable:
    """The implementation of op `name` for CUDA (or CPU) data under K3SERVE_KERNELS=`mode`."""
    if (is_cuda and mode != "reference") or mode == "triton":
        _autoload()
        fn = _registry[TRITON].get(name)
        if fn is not None:
            return fn
    elif not is_cuda and mode != "reference":
        fn = cpu.OPS.get(name)  # the batched CPU forms (k3serve/kernels/cpu/), same contracts
        if fn is not None:
            return fn
    return getattr(reference, name)


def linear(x, weight, dtype=None):
    return _impl("linear", x)(x, weight, dtype)


def rms_norm(x, weight, eps):
    return _impl("rms_norm", x)(x, weight, eps)


def add_rms_norm(x, residual, weight, eps):
    """(rms_norm(x + residual), x + residual): a layer's residual add and the next norm (one kernel on CUDA)."""
    return _impl("add_rms_norm", x)(x, residual, weight, eps)


def rms_norm_gated(x, gate, weight, eps, out_dtype=None):
    """rms_norm(x) * sigmoid(gate), rounded once to out_dtype: KDA's gated output norm (one kernel on CUDA)."""
    return _impl("rms_norm_gated", x)(x, gate, weight, eps, out_dtype)


def l2_normalize(x, eps=1e-6):
    return _impl("l2_normalize", x)(x, eps)


def situ_and_mul(x, beta=4.0, linear_beta=None):
    return _impl("situ_and_mul", x)(x, beta, linear_beta)


def silu_and_mul(x):
    return _impl("silu_and_mul", x)(x)


def causal_conv1d_varlen(
    x,
    weight,
    conv_states,
    state_indices,
    cu_seqlens,
    has_initial_state,
    *,
    activation="silu",
    checkpoint_seq=None,
    checkpoint_offsets=None,
    checkpoint_slots=None,
):
    return _impl("causal_conv1d_varlen", x)(
        x,
        weight,
        conv_states,
        state_indices,
        cu_seqlens,
        has_initial_state,
        activation=activation,
        checkpoint_seq=checkpoint_seq,
        checkpoint_offsets=checkpoint_offsets,
        checkpoint_slots=checkpoint_slots,
    )


def kda_gate(raw_g, A_log, dt_bias, lower_bound=None):
    return _impl("kda_gate", raw_g)(raw_g, A_log, dt_bias, lower_bound)


def kda_recurrent(
    q,
    k,
    v,
    g,
    beta,
    state_pool,
    state_indices,
    cu_seqlens,
    has_initial_state,
    *,
    scale=None,
    use_qk_l2norm=True,
    checkpoint_seq=None,
    checkpoint_offsets=None,
    checkpoint_slots=None,
):
    return _impl("kda_recurrent", q)(
        q,
        k,
        v,
        g,
        beta,
        state_pool,
        state_indices,
        cu_seqlens,
        has_initial_state,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        checkpoint_seq=checkpoint_seq,
        checkpoint_offsets=checkpoint_offsets,
        checkpoint_slots=checkpoint_slots,
    )


def kda_chunked(
    q,
    k,
    v,
    g,
    beta,
    state_pool,
    state_indices,
    cu_seqlens,
    has_initial_state,
    *,
    scale=None,
    use_qk_l2norm=True,
    checkpoint_seq=None,
    checkpoint_offsets=None,
    checkpoint_slots=None,
    chunk_size=64,
    host=None,
):
    """`host`: an optional kernels/reference/_varlen.py HostVarlen with the index arguments as lists (the Triton form
    then reads nothing back from the device)."""
    return _impl("kda_chunked", q)(
        q,
        k,
        v,
        g,
        beta,
        state_pool,
        state_indices,
        cu_seqlens,
        has_initial_state,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        checkpoint_seq=checkpoint_seq,
        checkpoint_offsets=checkpoint_offsets,
        checkpoint_slots=checkpoint_slots,
        chunk_size=chunk_size,
        host=host,
    )


def kda_decode(
    qkv,
    conv_weight,
    conv_states,
    raw_g,
    A_log,
    dt_bias,
    beta_logit,
    gate,
    o_norm_weight,
    state_pool,
    state_indices,
    has_initial_state,
    *,
    lower_bound=None,
    scale=None,
    eps=1e-5,
):
    return _impl("kda_decode", qkv)(
        qkv,
        conv_weight,
        conv_states,
        raw_g,
        A_log,
        dt_bias,
        beta_logit,
        gate,
        o_norm_weight,
        state_pool,
        state_indices,
        has_initial_state,
        lower_bound=lower_bound,
        scale=scale,
        eps=eps,
    )


KDA_VERIFY_MAX_TOKENS = _cpu_kda_verify.MAX_TOKENS  # longest sequence `kda_verify`'s token walk takes


def kda_verify(
    qkv,
    conv_weight,
    conv_states,
    raw_g,
    A_log,
    dt_bias,
    beta_logit,
    state_pool,
    state_indices,
    cu_seqlens,
    has_initial_state,
    *,
    lower_bound=None,
    scale=None,
    checkpoint_seq=None,
    checkpoint_offsets=None,
    checkpoint_slots=None,
    gate=None,
    o_norm_weight=None,
    eps=1e-5,
):
    """A KDA layer's short conv, gate and delta rule over a batch of short chunks (speculative verify steps):
    o [T, H, V] before o_norm (compute dtype); with `gate` [T, H*V] and `o_norm_weight` [V] the layer's output
    rms_norm(o, o_norm_weight) * sigmoid(gate) in qkv's dtype instead (fused into the Triton kernel).
    CPU tensors: the token walk of k3serve/kernels/cpu/kda_verify.py; CUDA tensors (or K3SERVE_KERNELS=triton,
    under TRITON_INTERPRET=1): the Triton kernel of kernels/triton/kda_verify.py, which reads every index on
    the device (no host sync: verify steps can be graph-captured) where it takes the shapes; otherwise (or
    with K3SERVE_KERNELS=reference) the contract, `kda_verify_composed`, from this module's conv, gate and
    chunked ops."""
    args = (qkv, conv_weight, conv_states, raw_g, A_log, dt_bias, beta_logit, state_pool, state_indices,
            cu_seqlens, has_initial_state)
    kw = dict(lower_bound=lower_bound, scale=scale, checkpoint_seq=checkpoint_seq,
              checkpoint_offsets=checkpoint_offsets, checkpoint_slots=checkpoint_slots)
    mode = _mode()
    if not qkv.is_cuda and not mode:
        o = _cpu_kda_verify.kda_verify(*args, **kw)
        return o if gate is None else _norm_gate(o, gate, o_norm_weight, eps, qkv.dtype)
    if (qkv.is_cuda and mode != "reference") or mode == "triton":
        try:
            from .triton import kda_verify as _tkv
        except ModuleNotFoundError as e:  # no triton: the composed form
            if e.name != "triton":
                raise
        else:
            if _tkv.supported(qkv, conv_weight, conv_states, raw_g, state_pool):
                return _tkv.kda_verify_triton(*args, **kw, gate=gate, o_norm_weight=o_norm_weight, eps=eps)
    o = _cpu_kda_verify.kda_verify_composed(*args, **kw, conv=causal_conv1d_varlen, gate=kda_gate,
                                            chunked=kda_chunked)
    return o if gate is None else _norm_gate(o, gate, o_norm_weight, eps, qkv.dtype)


def _norm_gate(o, gate, o_norm_weight, eps, dtype):
    """kda_verify's `gate` form from o [T, H, V]: rms_norm(o) * sigmoid(gate), as workers/engine/k3_forward.py's
    KDA layer applies it (in o's compute dtype, then `dtype`)."""
    if o_norm_weight is None:
        raise ValueError("kda_verify: gate and o_norm_weight go together")
    o = rms_norm(o, o_norm_weight.to(o.dtype), eps)
    return (o * torch.sigmoid(gate.reshape(o.shape).to(o.dtype))).to(dtype)


def attn_res(partial, delta, blocks, w_norm, w_q, w_out, n, write_idx, eps, eps_out=None, round_dtype=None):
    return _impl("attn_res", partial)(
        partial, delta, blocks, w_norm, w_q, w_out, n, write_idx, eps, eps_out, round_dtype
    )


def mla_write_cache(c_kv, k_pe, kv_cache, slot_mapping):
    return _impl("mla_write_cache", kv_cache)(c_kv, k_pe, kv_cache, slot_mapping)


def mla_paged_attention(q_lat, q_pe, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, *, kv_lora_rank):
    return _impl("mla_paged_attention", q_lat)(
        q_lat, q_pe, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, kv_lora_rank=kv_lora_rank
    )


def mla_attention_expanded(q_nope, q_pe, k_nope, k_pe, v, scale, causal=True):
    return _impl("mla_attention_expanded", q_nope)(q_nope, q_pe, k_nope, k_pe, v, scale, causal)


def moe_route(
    router_logits,
    correction_bias,
    top_k,
    *,
    num_expert_group=1,
    topk_group=1,
    renormalize=True,
    routed_scaling_factor=1.0,
    scoring="sigmoid",
    shared_experts=0,
):
    return _impl("moe_route", router_logits)(
        router_logits,
        correction_bias,
        top_k,
        num_expert_group=num_expert_group,
        topk_group=topk_group,
        renormalize=renormalize,
        routed_scaling_factor=routed_scaling_factor,
        scoring=scoring,
        shared_experts=shared_experts,
    )


def moe_experts(
    z,
    topk_weights,
    topk_ids,
    *,
    w13=None,
    w2=None,
    w13_packed=None,
    w13_scale=None,
    w2_packed=None,
    w2_scale=None,
    activation="situ",
    situ_beta=4.0,
    situ_linear_beta=None,
):
    return _impl("moe_experts", z)(
        z,
        topk_weights,
        topk_ids,
        w13=w13,
        w2=w2,
        w13_packed=w13_packed,
        w13_scale=w13_scale,
        w2_packed=w2_packed,
        w2_scale=w2_scale,
        activation=activation,
        situ_beta=situ_beta,
        situ_linear_beta=situ_linear_beta,
    )


for _name in reference.OPS:  # the wrappers document themselves with the reference contract
    globals()[_name].__doc__ = getattr(reference, _name).__doc__
del _name

__all__ = [*reference.OPS, "kda_verify", "pinned_choices", "pinned_kernels", "pinned_mode", "register_impl",
           "unregister_impl", "registered"]
