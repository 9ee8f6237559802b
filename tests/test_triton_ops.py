"""Registration of the Triton kernels with the dispatcher (CPU: registration and fallbacks only)."""

import _triton_cpu  # (sets TRITON_INTERPRET=1 first)
import torch

from k3serve.kernels import ops, reference

pytestmark = _triton_cpu.skip_on_cuda


def test_triton_ops_registers_reference_signatures():
    import inspect

    from k3serve.kernels import triton_ops

    reg = ops.registered()
    assert set(triton_ops.IMPLS) <= set(reference.OPS)
    for name, fn in triton_ops.IMPLS.items():
        assert reg[name] is fn
        ref_params = list(inspect.signature(getattr(reference, name)).parameters)
        params = inspect.signature(fn).parameters
        positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        assert [p.name for p in positional] == ref_params[: len(positional)], name


def test_fp64_goes_to_reference():
    from k3serve.kernels import triton_ops

    g = torch.Generator().manual_seed(0)
    lg = torch.randn(3, 8, generator=g, dtype=torch.float64)
    w, i = triton_ops.IMPLS["moe_route"](lg, None, 2)
    rw, ri = reference.moe_route(lg, None, 2)
    assert w.dtype == torch.float64 and torch.equal(i, ri) and torch.equal(w, rw)


def test_kda_decode_reference_composes_ops():
    # the new fused op's reference equals conv -> gate -> recurrent -> gated RMSNorm written out
    g = torch.Generator().manual_seed(1)
    N, H, K, V, W = 3, 2, 4, 4, 3
    C = 2 * H * K + H * V
    qkv = torch.randn(N, C, generator=g, dtype=torch.float64)
    cw = torch.randn(C, W, generator=g, dtype=torch.float64)
    cs = torch.randn(5, C, W - 1, generator=g, dtype=torch.float64)
    pool = torch.randn(5, H, V, K, generator=g, dtype=torch.float64)
    rg, al = torch.randn(N, H, K, generator=g, dtype=torch.float64), torch.randn(H, generator=g, dtype=torch.float64)
    dtb, bl = torch.randn(H * K, generator=g, dtype=torch.float64), torch.randn(N, H, generator=g, dtype=torch.float64)
    gate, onw = torch.randn(N, H, V, generator=g, dtype=torch.float64), torch.rand(V, generator=g, dtype=torch.float64)
    si, init = torch.tensor([4, 0, 2]), torch.tensor([True, False, True])
    c1, p1, c2, p2 = cs.clone(), pool.clone(), cs.clone(), pool.clone()
    y = reference.kda_decode(qkv, cw, c1, rg, al, dtb, bl, gate, onw, p1, si, init, lower_bound=-5.0)
    cu = torch.arange(N + 1)
    x = reference.causal_conv1d_varlen(qkv, cw, c2, si, cu, init)
    q, k, v = x[:, : H * K].view(N, H, K), x[:, H * K: 2 * H * K].view(N, H, K), x[:, 2 * H * K:].view(N, H, V)
    gg = reference.kda_gate(rg, al, dtb, -5.0)
    o = reference.kda_recurrent(q, k, v, gg, torch.sigmoid(bl), p2, si, cu, init)
    want = reference.rms_norm(o, onw, 1e-5) * torch.sigmoid(gate)
    assert torch.allclose(y, want) and torch.equal(c1, c2) and torch.allclose(p1, p2)
