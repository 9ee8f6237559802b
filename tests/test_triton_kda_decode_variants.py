"""Fused KDA decode step (kernels/triton/kda_decode.py) under the CPU interpreter: every tuning variant of
`kda_decode_triton` (block_v, v_splits, num_warps, maxnreg) against `reference.kda_decode`, on ragged
batches with padding slots, fresh states and poisoned (NaN) unused slots, fp32 and bf16 activations."""

import _triton_cpu  # (sets TRITON_INTERPRET=1 first)
import pytest
import torch
from _triton_cpu import rel

from k3serve.kernels import reference as R
from k3serve.kernels.triton.kda_decode import kda_decode_triton

pytestmark = _triton_cpu.skip_on_cuda

W = 4

VARIANTS = {
    "default": {},
    "bv16": dict(block_v=16),
    "bv64": dict(block_v=64),
    "whole-8w": dict(block_v=128, num_warps=8),
    "split2-bv32": dict(block_v=32, v_splits=2),
    "split2-bv64-8w": dict(block_v=64, v_splits=2, num_warps=8, maxnreg=96),
    "split4": dict(block_v=32, v_splits=4),
    "split8-2w": dict(block_v=16, v_splits=8, num_warps=2),
    "split2-bv32-atomic": dict(block_v=32, v_splits=2, combine="atomic"),
    "split4-atomic": dict(block_v=32, v_splits=4, combine="atomic"),
    "split8-bv8-atomic": dict(block_v=8, v_splits=8, combine="atomic"),
}


def make_case(N, H, K, act_dtype, seed, lower_bound=-5.0):
    """Inputs for N sequences: slot -1 padding, fresh-state rows, a spare slot range poisoned with NaN."""
    g = torch.Generator().manual_seed(seed)
    V = K
    C = 2 * H * K + H * V
    n_slots = N + 3
    perm = torch.randperm(n_slots, generator=g)
    si = perm[:N].clone()
    if N > 1:
        si[torch.arange(1, N, 3)] = -1  # every third sequence (from the 2nd) is padding
    init = torch.rand(N, generator=g) > 0.3
    if N > 2:
        init[2] = False
    qkv = torch.randn(N, C, generator=g).to(act_dtype)
    cw = torch.randn(C, W, generator=g) * 0.5
    cs = torch.randn(n_slots, C, W - 1, generator=g).to(act_dtype)
    pool = torch.randn(n_slots, H, V, K, generator=g)
    unused = sorted(set(range(n_slots)) - set(si[si >= 0].tolist()))
    cs[unused] = float("nan")
    pool[unused] = float("nan")
    rest = (
        torch.randn(N, H, K, generator=g).to(act_dtype),  # raw_g
        torch.randn(H, generator=g) * 0.5,  # A_log
        torch.randn(H * K, generator=g),  # dt_bias
        torch.randn(N, H, generator=g).to(act_dtype),  # beta_logit
        torch.randn(N, H, V, generator=g).to(act_dtype),  # gate
        torch.rand(V, generator=g) + 0.5,  # o_norm_weight
    )
    return qkv, cw, cs, rest, pool, si, init, unused


def check(N, H, K, act_dtype, variant, seed, lower_bound=-5.0, with_init=True):
    qkv, cw, cs, rest, pool, si, init, unused = make_case(N, H, K, act_dtype, seed, lower_bound)
    if not with_init:
        init = None
    rc, rp = cs.double(), pool.double()
    ref = R.kda_decode(
        qkv.double(), cw.double(), rc, *(a.double() for a in rest), rp, si, init, lower_bound=lower_bound
    )
    out = kda_decode_triton(qkv, cw, cs, *rest, pool, si, init, lower_bound=lower_bound, **VARIANTS[variant])
    assert out.dtype == act_dtype and out.shape == (N, H, K)
    used = si[si >= 0].tolist()
    pad = (si < 0).nonzero().flatten().tolist()
    tol = 1e-5 if act_dtype == torch.float32 else 6e-3  # bf16: one rounding of the output
    assert rel(out[si >= 0], ref[si >= 0]) < tol
    assert (out[pad] == 0).all()
    assert rel(pool[used], rp[used]) < 1e-5
    # the rolled conv state is a copy of stored values: exact in any dtype
    assert torch.equal(cs[used].double(), rc[used])
    assert torch.isnan(pool[unused]).all() and torch.isnan(cs[unused]).all()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_fp32_k64(variant):
    for N, H, seed in ((1, 2, 0), (3, 3, 1), (17, 2, 2)):
        check(N, H, 64, torch.float32, variant, seed)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_fp32_k128(variant):
    check(3, 4, 128, torch.float32, variant, 3)
    check(1, 2, 128, torch.float32, variant, 4, lower_bound=None)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_bf16(variant):
    check(6, 2, 64, torch.bfloat16, variant, 5)
    check(3, 3, 128, torch.bfloat16, variant, 6, lower_bound=None, with_init=False)


@pytest.mark.parametrize("variant", ["split2-bv32", "split2-bv32-atomic"])
def test_two_steps(variant):
    """Two decode steps in a row: the second sees the first's conv/recurrent state, and (atomic combine) the
    arrival counters are back at zero after each launch."""
    from k3serve.kernels.triton import kda_decode as kd

    qkv, cw, cs, rest, pool, si, init, _ = make_case(3, 2, 64, torch.float32, 7)
    rc, rp = cs.double(), pool.double()
    for step in range(2):
        x = qkv * (1 + step)
        ref = R.kda_decode(
            x.double(), cw.double(), rc, *(a.double() for a in rest), rp, si, init, lower_bound=-5.0
        )
        out = kda_decode_triton(x, cw, cs, *rest, pool, si, init, lower_bound=-5.0, **VARIANTS[variant])
        assert rel(out[si >= 0], ref[si >= 0]) < 1e-5
        assert all(int(c.abs().sum()) == 0 for c in kd._COUNTERS.values())
        init = torch.ones_like(init)
    used = si[si >= 0].tolist()
    assert rel(pool[used], rp[used]) < 1e-5 and torch.equal(cs[used].double(), rc[used])


def test_knob_validation():
    qkv, cw, cs, rest, pool, si, init, _ = make_case(1, 2, 64, torch.float32, 0)
    for bad in (dict(v_splits=3), dict(v_splits=128), dict(block_v=48), dict(v_splits=2, combine="nope")):
        with pytest.raises(ValueError):
            kda_decode_triton(qkv, cw, cs, *rest, pool, si, init, **bad)
