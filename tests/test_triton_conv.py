"""Triton causal_conv1d_varlen under the CPU interpreter, against the reference op (ragged batches, initial
states, padded sequences, checkpoints inside the history window, a slot both read and written, strided pools)."""

import _triton_cpu  # (sets TRITON_INTERPRET=1 first)
import pytest
import torch
from _triton_cpu import cu_of

from k3serve.kernels import reference as R
from k3serve.kernels.triton.conv import causal_conv1d_varlen_triton

pytestmark = _triton_cpu.skip_on_cuda


def _case(seed, lens, slots, init, ckpts, C=40, K=4, dt=torch.float32, num_slots=8, strided=False, act="silu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), C, generator=g).to(dt)
    w = torch.randn(C, K, generator=g)
    if strided:  # a view into larger pages, as the engine's pools are
        pages = torch.randn(num_slots, C + 3, K + 2, generator=g).to(dt)
        pool = pages[:, :C, 1:K]
    else:
        pool = torch.randn(num_slots, C, K - 1, generator=g).to(dt)
    ck = {}
    if ckpts:
        ck = dict(checkpoint_seq=torch.tensor([c[0] for c in ckpts]),
                  checkpoint_offsets=torch.tensor([c[1] for c in ckpts]),
                  checkpoint_slots=torch.tensor([c[2] for c in ckpts]))
    ref_pool = pool.double().clone()
    ref = R.causal_conv1d_varlen(x.double(), w.double(), ref_pool, torch.tensor(slots), cu_of(lens),
                                 None if init is None else torch.tensor(init), activation=act, **ck)
    out = causal_conv1d_varlen_triton(x, w, pool, torch.tensor(slots), cu_of(lens),
                                      None if init is None else torch.tensor(init), activation=act, **ck)
    tol = 1e-5 if dt == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(pool.double(), ref_pool, rtol=tol, atol=tol)
    return out, pool


def test_ragged_batch_with_history_and_padding():
    # lens 6, 1 (shorter than the window), 0, 9, 2; slot -1 = padded sequence
    _case(0, [6, 1, 0, 9, 2], [3, 0, 5, 1, -1], [True, True, False, False, True], None)


@pytest.mark.parametrize("strided", [False, True])
def test_checkpoints_and_aliasing(strided):
    # checkpoints at offset 0 and 1 (inside the history window), at the end, and one into a slot another
    # sequence reads (its history must be read before the write)
    ckpts = [(0, 0, 6), (0, 2, 7), (1, 1, 2), (2, 9, 4), (2, 5, 5)]
    _case(1, [6, 3, 9], [2, 4, 1], [True, True, False], ckpts, strided=strided)


def test_all_initial_none_bf16_identity_kernel_width_3():
    _case(2, [5, 17], [1, 0], None, [(1, 16, 3)], C=24, K=3, dt=torch.bfloat16, act=None)


def test_later_write_wins_like_the_reference():
    # final state of seq 0 and a checkpoint of seq 1 target the same slot: the checkpoint (later) wins
    _, pool = _case(3, [4, 5], [2, 6], [False, True], [(1, 3, 2)])
    assert torch.isfinite(pool).all()
