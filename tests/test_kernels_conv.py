"""causal_conv1d_varlen: split prompt == one pass, checkpoints == the raw-input window, slot handling."""

import pytest
import torch

from k3serve.kernels import ops
from k3serve.kernels.reference import causal_conv1d_varlen

torch.set_num_threads(1)
F64 = torch.float64
C, K = 5, 4


def conv_literal(stream, w, silu=True):
    """Full causal conv of one raw stream [N, C] (zero history) via torch's conv1d -> [N, C]."""
    y = torch.nn.functional.conv1d(stream.t()[None], w[:, None, :], padding=K - 1, groups=C)[
        0, :, : stream.shape[0]
    ]
    y = y.t()
    return torch.nn.functional.silu(y) if silu else y


def data(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, C, generator=gen, dtype=F64), torch.randn(C, K, generator=gen, dtype=F64)


def garbage(num_slots, seed=9):
    return torch.randn(num_slots, C, K - 1, generator=torch.Generator().manual_seed(seed), dtype=F64) * 5


def call(x, w, states, slots, lens, init, ckpts=None, **kw):
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    ck = {}
    if ckpts:
        ck = dict(
            checkpoint_seq=torch.tensor([c[0] for c in ckpts]),
            checkpoint_offsets=torch.tensor([c[1] for c in ckpts]),
            checkpoint_slots=torch.tensor([c[2] for c in ckpts]),
        )
    return causal_conv1d_varlen(x, w, states, torch.tensor(slots), cu, torch.tensor(init), **ck, **kw)


@pytest.mark.parametrize("split", [1, 2, 3, 7, 11])
def test_prompt_split_in_two_chunks_equals_one_pass(split):
    x, w = data(12)
    one = garbage(4)
    y_one = call(x, w, one, [2], [12], [False])
    torch.testing.assert_close(y_one, conv_literal(x, w), rtol=1e-12, atol=1e-12)
    two = garbage(4)
    y_a = call(x[:split], w, two, [2], [split], [False])
    y_b = call(x[split:], w, two, [2], [12 - split], [True])
    torch.testing.assert_close(torch.cat([y_a, y_b]), y_one, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(two[2], x[-(K - 1) :].t(), rtol=0, atol=0)
    torch.testing.assert_close(one[2], two[2], rtol=0, atol=0)


def test_ragged_batch_each_sequence_equals_its_stream():
    lens, slots, init = [6, 1, 0, 9], [3, 0, 5, 1], [True, True, False, False]
    x, w = data(sum(lens), seed=1)
    hist = garbage(6, seed=2)
    states = hist.clone()
    y = call(x, w, states, slots, lens, init)
    start = 0
    for L, s, i in zip(lens, slots, init):
        prev = hist[s].t() if i else torch.zeros(K - 1, C, dtype=F64)  # garbage is ignored when not init
        stream = torch.cat([prev, x[start : start + L]])
        torch.testing.assert_close(
            y[start : start + L], conv_literal(stream, w)[K - 1 :], rtol=1e-12, atol=1e-12
        )
        torch.testing.assert_close(states[s], stream[-(K - 1) :].t(), rtol=0, atol=0)
        start += L
    assert torch.equal(states[2], hist[2]) and torch.equal(states[4], hist[4])  # untouched slots


def test_checkpoints_equal_window_and_resume_exactly():
    # sequence 0 continues a stream whose first 5 tokens are in slot 1; sequence 1 is fresh
    x_all, w = data(5 + 10 + 7, seed=3)
    prefix, chunk0, chunk1 = x_all[:5], x_all[5:15], x_all[15:]
    states = garbage(12, seed=4)
    call(prefix, w, states, [1], [5], [False])
    offsets0 = [0, 1, 2, 3, 6, 10]  # < K-1 pulls history rows; 10 = the end
    offsets1 = [1, 4, 7]
    ckpts = [(0, o, 2 + i) for i, o in enumerate(offsets0)] + [(1, o, 8 + i) for i, o in enumerate(offsets1)]
    y = call(torch.cat([chunk0, chunk1]), w, states, [1, 0], [10, 7], [True, False], ckpts=ckpts)
    stream0 = torch.cat([prefix, chunk0])
    stream1 = torch.cat([torch.zeros(K - 1, C, dtype=F64), chunk1])
    for i, o in enumerate(offsets0):
        end = 5 + o
        torch.testing.assert_close(states[2 + i], stream0[end - (K - 1) : end].t(), rtol=0, atol=0)
    for i, o in enumerate(offsets1):
        end = K - 1 + o
        torch.testing.assert_close(states[8 + i], stream1[end - (K - 1) : end].t(), rtol=0, atol=0)
    # resuming from a checkpoint reproduces the one-pass outputs after it
    o = 6
    y_resume = call(chunk0[o:], w, states, [2 + offsets0.index(o)], [10 - o], [True])
    torch.testing.assert_close(y_resume, y[o:10], rtol=1e-12, atol=1e-12)


def test_activation_none_padded_sequence_and_dtypes():
    x, w = data(7, seed=5)
    states = garbage(2, seed=6)
    before = states.clone()
    y = call(x, w[:, None, :], states, [-1, 0], [3, 4], [True, False], activation=None)
    assert torch.count_nonzero(y[:3]) == 0 and torch.equal(states[1], before[1])
    torch.testing.assert_close(y[3:], conv_literal(x[3:], w, silu=False), rtol=1e-12, atol=1e-12)
    sb = torch.zeros(1, C, K - 1, dtype=torch.bfloat16)
    yb = ops.causal_conv1d_varlen(
        x.bfloat16(), w.float(), sb, torch.tensor([0]), torch.tensor([0, 7]), torch.tensor([False])
    )
    assert yb.dtype == torch.bfloat16 and sb.dtype == torch.bfloat16
    torch.testing.assert_close(
        yb.double(), conv_literal(x.bfloat16().double(), w.float().double()), rtol=2e-2, atol=2e-2
    )
    with pytest.raises(ValueError):
        call(x, w, states, [0], [7], [False], activation="gelu")
