"""The Triton short-chunk KDA kernel (kernels/triton/kda_verify.py) under the CPU interpreter.

It must equal the CPU token walk (kernels/cpu/kda_verify.py) and the contract, the conv + gate + chunked
form on the reference ops (run in float64 on the same inputs as the oracle), on random shapes: sequences of
1..9 tokens, padding rows (slot -1), rows without an initial state, exports after 1..len tokens, a repeated
export, an export into the sequence's own running slot (it wins over the final write), and the static
verify layout (every row 1 + k tokens, padding rows repeating row 0's first export). Outputs, every state
slot and every conv window are compared. `ops.kda_verify` with K3SERVE_KERNELS=triton must take the kernel.
"""

from __future__ import annotations

import random

import pytest
import torch
from _kda_verify_cases import case, check, oracle, run
from _triton_cpu import skip_on_cuda

from k3serve.kernels import ops
from k3serve.kernels.cpu import kda_verify as kv
from k3serve.kernels.triton import kda_verify as tkv

pytestmark = skip_on_cuda


@pytest.mark.parametrize("seed", range(6))
def test_triton_kda_verify_equals_token_walk_and_contract(seed):
    rng = random.Random(seed)
    inputs, kw = case(rng, seed, static=seed % 3 == 2)
    assert tkv.supported(inputs["qkv"], inputs["conv_weight"], inputs["conv_states"], inputs["raw_g"],
                         inputs["state_pool"])
    out = run(tkv.kda_verify_triton, inputs, kw)
    assert out[0].dtype == torch.float32
    check(out, oracle(inputs, kw), 2e-4)
    check(out, run(kv.kda_verify, inputs, kw), 2e-4)  # the CPU token walk on the same float32 inputs


def test_ops_kda_verify_takes_the_kernel_with_triton_kernels(monkeypatch):
    rng = random.Random(11)
    inputs, kw = case(rng, 11, static=True)
    seen = []
    real = tkv.kda_verify_triton
    monkeypatch.setattr(tkv, "kda_verify_triton", lambda *a, **k: seen.append(1) or real(*a, **k))
    monkeypatch.setenv("K3SERVE_KERNELS", "triton")
    out = run(ops.kda_verify, inputs, kw)
    assert seen == [1]
    check(out, oracle(inputs, kw), 2e-4)


@pytest.mark.parametrize("seed", [5])
def test_triton_kda_verify_gated_output_equals_norm_of_contract(seed):
    """The fused output form (gate + o_norm_weight): rms_norm(o) * sigmoid(gate) of the contract's o."""
    rng = random.Random(seed)
    inputs, kw = case(rng, seed, static=True)
    N, h, _ = inputs["raw_g"].shape
    V = inputs["state_pool"].shape[2]
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(N, h * V + 3, generator=g)  # a column slice, as the merged projection gives it
    gate, onw = wide[:, 1:1 + h * V], torch.rand(V, generator=g) + 0.5
    out = run(tkv.kda_verify_triton, inputs, kw, gate=gate, o_norm_weight=onw, eps=1e-5)
    ref = oracle(inputs, kw)
    o = ref[0]
    want = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + 1e-5) * onw.double() * torch.sigmoid(
        gate.double().reshape(N, h, V))
    assert out[0].dtype == inputs["qkv"].dtype
    check(out, (want, ref[1], ref[2]), 2e-4)
    fast = run(ops.kda_verify, inputs, kw, gate=gate, o_norm_weight=onw, eps=1e-5)  # the CPU walk + ops' norm
    check(fast, (want, ref[1], ref[2]), 2e-4)


def test_short_rows_routes_on_the_host_field_without_reading_the_device():
    """K3ForwardModel._short_rows decides from ForwardBatch.max_query_len: cu_seqlens on the meta device (any
    read of its values raises) shows it never reads the tensor when the field is set."""
    from k3serve.workers.engine.forward_batch import ForwardBatch
    from k3serve.workers.engine.k3_forward import K3ForwardModel

    def batch(n):
        meta = torch.empty(3, dtype=torch.long, device="meta")
        return ForwardBatch(meta, meta, meta, meta, [], [], [], meta, None, None, None, meta, max_query_len=n)

    assert K3ForwardModel._short_rows(batch(4))
    assert K3ForwardModel._short_rows(batch(kv.MAX_TOKENS))
    assert not K3ForwardModel._short_rows(batch(kv.MAX_TOKENS + 1))
    assert not K3ForwardModel._short_rows(batch(0))
    with pytest.raises((RuntimeError, NotImplementedError)):  # unset: the fallback reads cu_seqlens
        K3ForwardModel._short_rows(batch(None))


_AOT = """
import random, sys, torch
sys.path.insert(0, {tests!r})
from _kda_verify_cases import case
from k3serve.kernels.triton.aot_check import capture_compiles
from k3serve.kernels.triton import kda_verify as tkv
seed = next(s for s in range(100) if case(random.Random(s), s, static=True, heads=(3,), dims=(64,))[0]
            ["conv_weight"].shape[-1] == 4)  # the demo model's layer: 3 heads of 64, conv width 4
inputs, kw = case(random.Random(seed), seed, static=True, heads=(3,), dims=(64,))
for n in ("qkv", "raw_g", "beta_logit", "conv_states"):
    inputs[n] = inputs[n].to(torch.bfloat16)
N, h, _ = inputs["raw_g"].shape
V = inputs["state_pool"].shape[2]
for extra in ({{}}, dict(gate=torch.zeros(N, h * V, dtype=torch.bfloat16), o_norm_weight=torch.ones(V))):
    with capture_compiles() as reps:
        tkv.kda_verify_triton(*inputs.values(), **kw, **extra)
    for r in reps:
        print(r.line())
"""


def test_kernel_compiles_for_sm90_without_spills():
    """The compiled (not interpreted) kernel for an H200 (sm_90) at the demo model's sizes (default warps): Triton's full
    pipeline through ptxas on this CPU (kernels/triton/aot_check.py), in a process without the interpreter."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tests = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", _AOT.format(tests=tests)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("_kda_verify_kernel")]
    assert len(lines) == 2 and not any("ERROR" in ln for ln in lines), r.stdout
    assert all(" spills=0 " in ln for ln in lines), r.stdout
