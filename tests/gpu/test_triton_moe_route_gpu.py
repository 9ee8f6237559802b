"""GPU checks of the session-6 MoE kernels: the one-program `route_blocks` (kernels/triton/moe_route.py) against
the PyTorch form, eagerly and replayed from a CUDA graph, and the "gemv" path's combines (atomic / loop / unroll,
and the wide-K tiles `benchmarks/sweep_moe.py` tries) against the reference op (fp64 on the CPU)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from k3serve.kernels import reference  # noqa: E402
from k3serve.kernels.reference.mxfp4 import mxfp4_quantize  # noqa: E402
from k3serve.kernels.triton import moe  # noqa: E402
from tests.test_triton_moe_route import _torch_form  # noqa: E402  (the PyTorch form, one definition)

DEV = "cuda"


def _ids(g, T, E, k, invalid):
    if E <= 8:
        ids = torch.randint(0, E, (T, k), generator=g)
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    drop = torch.rand(T, k, generator=g) < invalid
    return torch.where(drop, torch.full_like(ids, -1), ids)


def _check_layout(got, want, ids, E):
    sid, order, starts, n = (t.cpu() for t in got)
    w = [t.cpu() for t in want]
    assert torch.equal(sid, w[0]) and torch.equal(starts, w[2]) and torch.equal(n, w[3])
    flat = ids.reshape(-1).cpu().long()
    flat = torch.where(flat >= 0, flat, torch.full_like(flat, E))
    assert torch.equal(order.long(), torch.sort(flat, stable=True).indices)


@pytest.mark.parametrize("T,E,k,invalid", [(1, 64, 8, 0.0), (8, 64, 8, 0.1), (64, 64, 8, 0.0), (64, 896, 16, 0.02),
                                           (100, 4, 8, 0.3), (256, 896, 16, 0.0), (512, 64, 8, 0.05)])
def test_route_blocks_kernel_gpu(T, E, k, invalid):
    g = torch.Generator().manual_seed(T * 7 + E)
    ids = _ids(g, T, E, k, invalid).to(DEV)
    got = moe.route_blocks(ids, E, count=True)
    _check_layout(got, _torch_form(ids, E), ids, E)


def test_route_blocks_kernel_in_a_graph_gpu():
    """Captured once, replayed on new routings written into the same input: the layout follows the input."""
    g = torch.Generator().manual_seed(3)
    T, E, k = 64, 64, 8
    ids = _ids(g, T, E, k, 0.0).to(DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        moe.route_blocks(ids, E, count=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.route_blocks(ids, E, count=True)
    for invalid in (0.0, 0.3, 1.0):
        ids.copy_(_ids(g, T, E, k, invalid))
        graph.replay()
        torch.cuda.synchronize()
        _check_layout(out, _torch_form(ids, E), ids, E)


@pytest.mark.parametrize("combine", moe.COMBINES)
@pytest.mark.parametrize("T,knobs,dt", [(1, {}, torch.float32), (8, {}, torch.bfloat16),
                                        (1, dict(bn2=8, bk2=1024), torch.bfloat16),
                                        (1, dict(bn1=8, bk1=1024, bk2=1024), torch.bfloat16)])
def test_gemv_combines_gpu(T, knobs, dt, combine):
    """The small preset's expert shapes (64 experts, top-8, latent 1024, I 768), MXFP4, with invalid pairs."""
    g = torch.Generator().manual_seed(T + len(knobs))
    E, k, DIN, I, DOUT = 64, 8, 1024, 768, 1024
    z = torch.randn(T, DIN, generator=g)
    p13, s13 = mxfp4_quantize(torch.randn(E, 2 * I, DIN, generator=g) * DIN**-0.5)
    p2, s2 = mxfp4_quantize(torch.randn(E, DOUT, I, generator=g) * I**-0.5)
    ids = _ids(g, T, E, k, 0.0)
    ids[0, -1] = -1
    tw = torch.rand(T, k, generator=g)
    kw = dict(w13_packed=p13, w13_scale=s13, w2_packed=p2, w2_scale=s2)
    ref = reference.moe_experts(z.double(), tw.double(), ids, situ_linear_beta=25.0, **kw)
    torch.full((1 << 26,), float("nan"), device=DEV)  # poison the allocator: an unwritten output shows up
    out = moe.moe_experts_triton(z.to(DEV, dt), tw.to(DEV), ids.to(DEV), situ_linear_beta=25.0, variant="gemv",
                                 combine=combine, **{a: t.to(DEV) for a, t in kw.items()}, **knobs)
    torch.cuda.synchronize()
    err = float((out.double().cpu() - ref).norm() / ref.norm())
    assert err < (2e-4 if dt == torch.float32 else 2.5e-2), err
