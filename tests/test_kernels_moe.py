"""MoE routing on hand-made cases; experts dense == literal, MXFP4 == dequantize-then-dense."""

import math

import pytest
import torch

from k3serve.kernels import ops
from k3serve.kernels.reference import mxfp4

torch.set_num_threads(1)
F64 = torch.float64


def logit(p):
    return [math.log(x / (1 - x)) for x in p]


def test_bias_changes_selection_not_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    s = torch.sigmoid(logits)
    w, ids = ops.moe_route(logits, None, 2)
    assert ids.tolist() == [[0, 1]] and ids.dtype == torch.int64 and w.dtype == torch.float32
    torch.testing.assert_close(w, s[:, [0, 1]] / s[:, [0, 1]].sum())
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    w, ids = ops.moe_route(logits, bias, 2)
    assert ids.tolist() == [[3, 0]]
    torch.testing.assert_close(w, s[:, [3, 0]] / s[:, [3, 0]].sum())  # unbiased scores
    # a bias that keeps the same selection leaves the weights unchanged
    w2, ids2 = ops.moe_route(logits, torch.tensor([0.3, 0.1, -1.0, -1.0]), 2)
    assert ids2.tolist() == [[0, 1]]
    torch.testing.assert_close(w2, ops.moe_route(logits, None, 2)[0])


def test_grouped_selection():
    p = [0.9, 0.1, 0.6, 0.55, 0.7, 0.2, 0.2, 0.3]  # group sums (top-2): 1.0, 1.15, 0.9, 0.5
    logits = torch.tensor([logit(p)], dtype=F64)
    _, ids = ops.moe_route(logits, None, 3)
    assert ids.tolist() == [[0, 4, 2]]
    w, ids = ops.moe_route(logits, None, 3, num_expert_group=4, topk_group=2, renormalize=False)
    assert ids.tolist() == [[0, 2, 3]] and w.dtype == F64
    torch.testing.assert_close(w, torch.tensor([[0.9, 0.6, 0.55]], dtype=F64))
    # group score is the top-2 SUM, not the max: group 0 (max 0.9) loses to group 1 (0.6 + 0.55) at topk_group=1
    _, ids = ops.moe_route(logits, None, 2, num_expert_group=4, topk_group=1)
    assert ids.tolist() == [[2, 3]]
    # bias enters the group scores too
    bias = torch.tensor([0, 0, 0, 0, 0, 0.5, 0, 0], dtype=F64)
    _, ids = ops.moe_route(logits, bias, 2, num_expert_group=4, topk_group=1)
    assert ids.tolist() == [[4, 5]]
    with pytest.raises(ValueError):
        ops.moe_route(logits, None, 5, num_expert_group=4, topk_group=2)


def test_ties_lowest_id_first_softmax_and_scaling():
    logits = torch.zeros(2, 6)
    _, ids = ops.moe_route(logits, None, 3)
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    _, ids = ops.moe_route(logits, None, 2, num_expert_group=3, topk_group=1)
    assert ids.tolist() == [[0, 1], [0, 1]]
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5]])
    w, ids = ops.moe_route(logits, None, 2, scoring="softmax", renormalize=False, routed_scaling_factor=2.5)
    sm = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(w, 2.5 * sm[:, [1, 2]])


def literal_experts(z, w, ids, W13, W2, act):
    out = torch.zeros(z.shape[0], W2.shape[1], dtype=F64)
    for t in range(z.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            out[t] += float(w[t, j]) * (act(W13[e] @ z[t]) @ W2[e].t())
    return out


def situ_lit(h, lb=None):
    n = h.shape[-1] // 2
    g, u = h[..., :n], h[..., n:]
    u = u if lb is None else lb * torch.tanh(u / lb)
    return 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * u


def make_experts(E=5, I=32, Din=64, Dout=32, T=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(T, Din, generator=gen, dtype=F64)
    W13 = torch.randn(E, 2 * I, Din, generator=gen, dtype=F64) * 0.2
    W2 = torch.randn(E, Dout, I, generator=gen, dtype=F64) * 0.2
    logits = torch.randn(T, E, generator=gen, dtype=F64)
    logits[:, 4] = -1e9  # expert 4 is never routed to
    w, ids = ops.moe_route(logits, None, 2)
    return z, W13, W2, w, ids


def test_dense_experts_equal_literal():
    z, W13, W2, w, ids = make_experts()
    out = ops.moe_experts(z, w, ids, w13=W13, w2=W2, situ_linear_beta=2.0)
    torch.testing.assert_close(
        out, literal_experts(z, w, ids, W13, W2, lambda h: situ_lit(h, 2.0)), rtol=1e-10, atol=1e-10
    )
    out = ops.moe_experts(z, w, ids, w13=W13, w2=W2, activation="silu")
    silu = lambda h: torch.nn.functional.silu(h[: h.shape[0] // 2]) * h[h.shape[0] // 2 :]  # noqa: E731
    torch.testing.assert_close(out, literal_experts(z, w, ids, W13, W2, silu), rtol=1e-10, atol=1e-10)
    out_bf = ops.moe_experts(z.bfloat16(), w, ids, w13=W13.float(), w2=W2.float())
    assert out_bf.dtype == torch.bfloat16


def test_mxfp4_equals_dequantize_then_dense_and_only_active_experts(monkeypatch):
    z, W13, W2, w, ids = make_experts(seed=1)
    p13, s13 = mxfp4.mxfp4_quantize(W13)
    p2, s2 = mxfp4.mxfp4_quantize(W2)
    D13, D2 = mxfp4.mxfp4_dequantize(p13, s13, F64), mxfp4.mxfp4_dequantize(p2, s2, F64)
    assert not torch.equal(D13, W13)  # quantization really changed the weights
    calls = []
    real = mxfp4.mxfp4_dequantize

    def counting(packed, scales, dtype=torch.float32):
        calls.append(packed.shape)
        return real(packed, scales, dtype)

    monkeypatch.setattr(mxfp4, "mxfp4_dequantize", counting)
    out_q = ops.moe_experts(
        z, w, ids, w13_packed=p13, w13_scale=s13, w2_packed=p2, w2_scale=s2, situ_linear_beta=25.0
    )
    dense = ops.moe_experts(z, w, ids, w13=D13, w2=D2, situ_linear_beta=25.0)
    torch.testing.assert_close(out_q, dense, rtol=1e-12, atol=1e-12)
    active = len(torch.unique(ids))
    assert active < 5 and len(calls) == 2 * active
