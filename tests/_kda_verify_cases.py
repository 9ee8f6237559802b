"""Random short-chunk KDA verify cases (tests/test_kda_verify_triton.py, tests/gpu/test_kda_verify_gpu.py).

`case` draws a batch of 1..9-token sequences with padding rows (slot -1), rows without an initial state,
exports after 1..len tokens (a repeated one, one into the sequence's own running slot) or the static verify
layout (every row 1 + k tokens, trailing padding rows repeating row 0's first export); `oracle` is the
contract (kernels/cpu/kda_verify.py `kda_verify_composed` on the reference ops) in float64.
"""

from __future__ import annotations

import random

import torch

from k3serve.kernels import reference
from k3serve.kernels.cpu import kda_verify as kv


def case(rng: random.Random, seed: int, static: bool = False, heads=(1, 2, 3), dims=(16, 32),
         dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h, K, V = rng.choice(heads), rng.choice(dims), rng.choice(dims)
    W = rng.choice([2, 3, 4])
    C = 2 * h * K + h * V
    B = rng.randint(1, 4)
    if static:  # workers/engine/spec/static_verify.py: every row T = 1 + k tokens, trailing padding rows
        T1 = rng.randint(2, kv.MAX_TOKENS)
        lens = [T1] * B
    else:
        lens = [rng.randint(1, kv.MAX_TOKENS) for _ in range(B)]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    N = cu[-1] + rng.choice([0, 0, 2])  # rows past the last sequence stay zero
    num_slots = 2 * B + cu[-1] + 2
    perm = rng.sample(range(num_slots), num_slots)
    slots = perm[:B]
    n_real = B
    if static and B > 1:
        n_real = rng.randint(1, B - 1)
        slots[n_real:] = [-1] * (B - n_real)
    elif B > 1 and rng.random() < 0.4:
        slots[rng.randrange(B)] = -1
    init = [rng.random() < 0.8 for _ in range(B)]
    free = perm[B:]
    seq, off, dst = [], [], []
    for b in range(B):
        if static:
            if b < n_real:
                for t in range(1, lens[b]):
                    seq.append(b), off.append(t), dst.append(free.pop())
            continue
        if slots[b] < 0 and rng.random() < 0.5:
            continue
        for t in range(1, lens[b] + 1):
            if rng.random() < 0.6:
                seq.append(b), off.append(t), dst.append(free.pop())
    if static:  # padding rows' exports repeat row 0's first one
        for _ in range((B - n_real) * (lens[0] - 1)):
            seq.append(0), off.append(1), dst.append(dst[0])
    else:
        if seq and rng.random() < 0.5:  # the same export twice
            seq.append(seq[0]), off.append(off[0]), dst.append(dst[0])
        live = [b for b in range(B) if slots[b] >= 0]
        if live and rng.random() < 0.4:  # an export into its own running slot: it wins over the final write
            b0 = rng.choice(live)
            seq.append(b0), off.append(rng.randint(1, lens[b0])), dst.append(slots[b0])
    dt = dtype
    inputs = dict(
        qkv=torch.randn(N, C, generator=g, dtype=dt),
        conv_weight=torch.randn(C, 1, W, generator=g, dtype=dt) * 0.5,
        conv_states=torch.randn(num_slots, C, W - 1, generator=g, dtype=dt),
        raw_g=torch.randn(N, h, K, generator=g, dtype=dt) * 2.0,
        A_log=torch.randn(h, generator=g, dtype=dt) * 0.3,
        dt_bias=torch.randn(h * K, generator=g, dtype=dt),
        beta_logit=torch.randn(N, h, generator=g, dtype=dt),
        state_pool=torch.randn(num_slots, h, V, K, generator=g, dtype=dt),
        state_indices=torch.tensor(slots),
        cu_seqlens=torch.tensor(cu),
        has_initial_state=torch.tensor(init) if rng.random() < 0.85 else None,
    )
    kw = dict(lower_bound=rng.choice([None, -5.0]), scale=rng.choice([None, K ** -0.5 * 0.9]))
    if seq:
        kw.update(checkpoint_seq=torch.tensor(seq), checkpoint_offsets=torch.tensor(off),
                  checkpoint_slots=torch.tensor(dst))
    return inputs, kw


def run(fn, inputs, kw, f64=False, **extra):
    x = {k: (v.clone().double() if f64 and v is not None and v.is_floating_point() else
             (v.clone() if v is not None else None)) for k, v in inputs.items()}
    o = fn(*x.values(), **kw, **extra)
    return o, x["state_pool"], x["conv_states"]


def oracle(inputs, kw):
    return run(kv.kda_verify_composed, inputs, kw, f64=True, conv=reference.causal_conv1d_varlen,
                gate=reference.kda_gate, chunked=reference.kda_chunked)


def check(out, ref, tol):
    for name, a, b in zip(("o", "state_pool", "conv_states"), out, ref):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol, msg=name)


