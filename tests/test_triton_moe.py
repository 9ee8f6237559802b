"""Triton MoE router and MXFP4/dense grouped expert GEMMs under the CPU interpreter."""

import _triton_cpu  # (sets TRITON_INTERPRET=1 first)
import pytest
import torch
from _triton_cpu import rel

from k3serve.kernels import reference as R
from k3serve.kernels.reference.mxfp4 import mxfp4_quantize
from k3serve.kernels.triton.moe import moe_experts_triton, moe_route_triton, route_blocks

pytestmark = _triton_cpu.skip_on_cuda


@pytest.mark.parametrize("T,E,k,G,tg,scoring", [(5, 16, 4, 1, 1, "sigmoid"), (4, 24, 3, 4, 2, "sigmoid"),
                                                (3, 12, 2, 3, 2, "softmax"), (2, 8, 8, 1, 1, "sigmoid")])
def test_route_matches_reference(T, E, k, G, tg, scoring):
    g = torch.Generator().manual_seed(T * E)
    lg, b = torch.randn(T, E, generator=g), torch.randn(E, generator=g) * 0.1
    rw, ri = R.moe_route(lg, b, k, num_expert_group=G, topk_group=tg, scoring=scoring, routed_scaling_factor=2.0)
    w, i = moe_route_triton(lg, b, k, num_expert_group=G, topk_group=tg, scoring=scoring, routed_scaling_factor=2.0)
    assert torch.equal(i, ri) and i.dtype == torch.int64
    assert rel(w, rw) < 1e-6


@pytest.mark.parametrize("n", [1, 2, 3])
def test_route_appends_shared_experts(n):
    """shared_experts=n: the routed columns as without it, then ids E..E+n-1 with weight exactly 1 (neither
    renormalized nor scaled); the Triton kernel writes the same rows; a negative count is an error."""
    g = torch.Generator().manual_seed(n)
    T, E, k = 5, 16, 3
    lg, b = torch.randn(T, E, generator=g), torch.randn(E, generator=g) * 0.1
    kw = dict(num_expert_group=4, topk_group=2, routed_scaling_factor=2.5)
    rw, ri = R.moe_route(lg, b, k, **kw)
    sw, si = R.moe_route(lg, b, k, shared_experts=n, **kw)
    assert si.shape == sw.shape == (T, k + n)
    assert torch.equal(si[:, :k], ri) and torch.equal(sw[:, :k], rw)
    assert si[:, k:].tolist() == [list(range(E, E + n))] * T and sw[:, k:].eq(1).all()
    w, i = moe_route_triton(lg, b, k, shared_experts=n, **kw)
    assert torch.equal(i, si) and rel(w, sw) < 1e-6 and w[:, k:].eq(1).all()
    for fn in (R.moe_route, moe_route_triton):
        with pytest.raises(ValueError, match="shared_experts"):
            fn(lg, b, k, shared_experts=-1)


def test_route_blocks_group_by_expert():
    ids = torch.tensor([[3, 1], [3, -1], [1, 3]])
    sid, order, starts = route_blocks(ids, 4)
    assert sid.tolist() == [1, 1, 3, 3, 3, 4]
    assert sorted(order[:2].tolist()) == [1, 4] and sorted(order[2:5].tolist()) == [0, 2, 5]
    assert starts.tolist() == [0, 2, -1, -1, -1, -1]


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp4,act,lin", [(True, "situ", 25.0), (False, "silu", None), (True, "silu", None)])
def test_experts_match_reference(dt, fp4, act, lin):
    g = torch.Generator().manual_seed(1)
    T, E, k, DIN, I, DOUT = 7, 6, 3, 64, 32, 48
    z = torch.randn(T, DIN, generator=g).to(dt)
    w13 = torch.randn(E, 2 * I, DIN, generator=g) * 0.2
    w2 = torch.randn(E, DOUT, I, generator=g) * 0.2
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids[1, 2] = -1
    tw = torch.rand(T, k, generator=g)
    if fp4:
        p13, s13 = mxfp4_quantize(w13)
        p2, s2 = mxfp4_quantize(w2)
        kw = dict(w13_packed=p13, w13_scale=s13, w2_packed=p2, w2_scale=s2)
    else:
        kw = dict(w13=w13.to(dt), w2=w2.to(dt))
    ref = R.moe_experts(z.double(), tw.double(), ids, activation=act, situ_linear_beta=lin,
                        **{a: (t.double() if t.is_floating_point() else t) for a, t in kw.items()})
    # silu configs carry situ_beta=None (the model passes its config's value through)
    beta = {} if act == "situ" else {"situ_beta": None}
    out = moe_experts_triton(z, tw, ids, activation=act, situ_linear_beta=lin, **beta, **kw)
    assert out.dtype == dt
    assert rel(out, ref) < (1e-5 if dt == torch.float32 else 2e-2)
