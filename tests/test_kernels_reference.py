"""Small reference ops (norms, activations, AttnRes) against literal transcriptions; ops dispatch."""

import math

import pytest
import torch

import k3serve.kernels as kernels
from k3serve.kernels import cpu, ops, reference

torch.set_num_threads(1)
F64 = torch.float64


def rnd(*shape, seed=0, dtype=F64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype)


def test_rms_norm_and_l2_normalize_literal():
    x, w = rnd(3, 6), rnd(6, seed=1)
    y, z = ops.rms_norm(x, w, 1e-5), ops.l2_normalize(x)
    for r in range(3):
        row = [float(v) for v in x[r]]
        ms = sum(v * v for v in row) / 6
        ss = sum(v * v for v in row)
        for d in range(6):
            assert abs(float(y[r, d]) - row[d] / math.sqrt(ms + 1e-5) * float(w[d])) < 1e-12
            assert abs(float(z[r, d]) - row[d] / math.sqrt(ss + 1e-6)) < 1e-12
    xb = x.bfloat16()
    yb = ops.rms_norm(xb, w.float(), 1e-5)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(
        yb.double(), ops.rms_norm(xb.double(), w.float().double(), 1e-5), rtol=1e-2, atol=1e-2
    )


def test_situ_and_silu_literal():
    x = rnd(2, 8) * 6
    gate, up = x[:, :4], x[:, 4:]
    for lb in (None, 25.0, 2.0):
        y = ops.situ_and_mul(x, beta=4.0, linear_beta=lb)
        for t in range(2):
            for i in range(4):
                gv, uv = float(gate[t, i]), float(up[t, i])
                gp = 4.0 * math.tanh(gv / 4.0) / (1 + math.exp(-gv))
                up_ = uv if lb is None else lb * math.tanh(uv / lb)
                assert abs(float(y[t, i]) - gp * up_) < 1e-12
    y = ops.silu_and_mul(x)
    torch.testing.assert_close(y, gate / (1 + torch.exp(-gate)) * up, rtol=1e-12, atol=1e-12)
    assert ops.situ_and_mul(x.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError):
        ops.silu_and_mul(rnd(2, 5))


def attn_res_literal(partial, delta, blocks, w_norm, w_q, w_out, n, write_idx, eps, eps_out, round_dtype):
    """Design doc §1.2 AttnRes, token by token, source by source, in Python floats / float64."""
    T, H = partial.shape
    if delta is not None:
        new = partial.double() + delta.double()
        if round_dtype is not None:
            new = new.to(round_dtype)
        partial = new.to(partial.dtype)
    blocks = blocks.clone()
    if write_idx >= 0:
        blocks[:, write_idx] = partial
    wq = [float(v) for v in w_q.reshape(-1)]
    out = torch.zeros(T, H, dtype=F64)
    for t in range(T):
        sources = [blocks[t, i].double() for i in range(n)] + [partial[t].double()]
        logits = []
        for s in sources:
            rms = math.sqrt(sum(float(v) ** 2 for v in s) / H + eps)
            logits.append(sum(wq[d] * float(w_norm[d]) * float(s[d]) for d in range(H)) / rms)
        mx = max(logits)
        ex = [math.exp(v - mx) for v in logits]
        alphas = [e / sum(ex) for e in ex]
        m = sum(a * s for a, s in zip(alphas, sources))
        if w_out is not None:
            e2 = eps if eps_out is None else eps_out
            m = m / math.sqrt(float((m * m).mean()) + e2) * w_out.double()
        out[t] = m
    return out, partial, blocks


@pytest.mark.parametrize(
    "n,write_idx,with_delta,with_out,wq_shape,round_dtype,eps_out",
    [
        (0, 0, True, True, (6,), None, None),
        (2, -1, True, True, (1, 6), torch.bfloat16, 1e-3),
        (3, 3, True, False, (6,), torch.bfloat16, None),
        (4, -1, False, True, (1, 6), None, None),
    ],
)
def test_attn_res_equals_literal(n, write_idx, with_delta, with_out, wq_shape, round_dtype, eps_out):
    T, NB, H = 3, 4, 6
    partial, blocks = rnd(T, H, seed=1), rnd(T, NB, H, seed=2) * 3
    delta = rnd(T, H, seed=3) if with_delta else None
    w_norm, w_q = rnd(H, seed=4), rnd(*wq_shape, seed=5)
    w_out = rnd(H, seed=6) if with_out else None
    exp_out, exp_partial, exp_blocks = attn_res_literal(
        partial, delta, blocks, w_norm, w_q, w_out, n, write_idx, 1e-5, eps_out, round_dtype
    )
    p, b = partial.clone(), blocks.clone()
    out = ops.attn_res(
        p, delta, b, w_norm, w_q, w_out, n, write_idx, 1e-5, eps_out=eps_out, round_dtype=round_dtype
    )
    torch.testing.assert_close(p, exp_partial, rtol=0, atol=0)
    torch.testing.assert_close(b, exp_blocks, rtol=0, atol=0)
    torch.testing.assert_close(out, exp_out, rtol=1e-10, atol=1e-10)
    if with_delta and round_dtype is not None:  # rounding really happened
        assert torch.equal(p, p.to(round_dtype).to(p.dtype)) and not torch.equal(p, partial + delta)


def test_attn_res_bf16_storage():
    T, NB, H = 2, 3, 8
    partial, blocks = rnd(T, H, seed=7, dtype=torch.bfloat16), rnd(T, NB, H, seed=8, dtype=torch.bfloat16)
    delta = rnd(T, H, seed=9, dtype=torch.bfloat16)
    w = [rnd(H, seed=s, dtype=torch.float32) for s in (10, 11, 12)]
    exp_out, exp_p, exp_b = attn_res_literal(partial, delta, blocks, w[0], w[1], w[2], 2, 2, 1e-5, None, None)
    out = ops.attn_res(partial, delta, blocks, w[0], w[1], w[2], 2, 2, 1e-5)
    assert out.dtype == torch.bfloat16
    assert torch.equal(partial, exp_p) and torch.equal(blocks, exp_b)
    torch.testing.assert_close(out.double(), exp_out, rtol=1e-2, atol=1e-2)


class _FakeCuda:
    is_cuda = True


def test_dispatch_single_place():
    assert set(reference.OPS) <= set(kernels.__all__)
    for name in reference.OPS:
        assert ops._impl(name, torch.zeros(1)) is cpu.OPS.get(name, getattr(reference, name))  # kernels/cpu/
        assert getattr(ops, name).__doc__ == getattr(reference, name).__doc__

    def fake(x, weight, eps):
        return "triton"

    ops._autoload()  # load the Triton registrations first (a CUDA lookup would), then set them aside
    saved = ops.registered()
    for name in saved:
        ops.unregister_impl(name)
    ops.register_impl("rms_norm", fake)
    try:
        assert ops._impl("rms_norm", _FakeCuda()) is fake
        assert ops._impl("rms_norm", torch.zeros(1)) is reference.rms_norm  # CPU stays on the reference
        assert ops._impl("l2_normalize", _FakeCuda()) is reference.l2_normalize  # nothing registered
        assert ops.registered() == {"rms_norm": fake}
        ops.unregister_impl("rms_norm")
        assert ops._impl("rms_norm", _FakeCuda()) is reference.rms_norm
    finally:
        ops.unregister_impl("rms_norm")
        for name, fn in saved.items():
            ops.register_impl(name, fn)
    with pytest.raises(ValueError):
        ops.register_impl("not_an_op", fake)
