"""KDA reference ops: chunked == recurrent == a literal per-token loop; slots, checkpoints, gate."""

import math

import pytest
import torch

from k3serve.kernels import ops
from k3serve.kernels.reference import kda_chunked, kda_gate, kda_recurrent

torch.set_num_threads(1)
F64 = torch.float64


def literal_kda(q, k, v, g, beta, S0, scale, l2norm=True):
    """One sequence, written out token by token and head by head. q,k,g [L,H,K]; v [L,H,V]; S0 [H,V,K].

    Returns (o [L,H,V], states after each token: list of [H,V,K]).
    """
    L, H, K = q.shape
    S = [S0[h].clone() for h in range(H)]
    outs, states = torch.zeros(L, H, v.shape[-1], dtype=F64), []
    for t in range(L):
        for h in range(H):
            qt, kt = q[t, h], k[t, h]
            if l2norm:
                qt = qt / math.sqrt(float((qt * qt).sum()) + 1e-6)
                kt = kt / math.sqrt(float((kt * kt).sum()) + 1e-6)
            qt = qt * scale
            Sp = S[h] @ torch.diag(torch.exp(g[t, h]))
            u = beta[t, h] * (v[t, h] - Sp @ kt)
            S[h] = Sp + torch.outer(u, kt)
            outs[t, h] = S[h] @ qt
        states.append(torch.stack(S))
    return outs, states


def make_inputs(T, H=2, K=8, V=6, seed=0, lower_bound=-5.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, K, generator=gen, dtype=F64)
    k = torch.randn(T, H, K, generator=gen, dtype=F64)
    v = torch.randn(T, H, V, generator=gen, dtype=F64)
    raw_g = torch.randn(T, H, K, generator=gen, dtype=F64)
    A_log = torch.randn(H, generator=gen, dtype=F64) * 0.5
    dt_bias = torch.randn(H * K, generator=gen, dtype=F64)
    g = kda_gate(raw_g, A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(torch.randn(T, H, generator=gen, dtype=F64))
    return q, k, v, g, beta


def garbage_pool(num_slots, H, K, V, seed=1, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_slots, H, V, K, generator=gen, dtype=F64) * 3).to(dtype)


LENS = [5, 13, 0, 1, 9]
SLOTS = [6, 2, 4, 0, 7]
INIT = [True, False, True, False, True]
# (seq, offset, slot): mid-chunk, chunk boundaries (for chunk 4), the end, two per sequence, first token
CKPTS = [(1, 3, 1), (1, 4, 3), (1, 13, 5), (4, 7, 8), (0, 1, 9), (4, 9, 10)]


def run_both(chunk_size, lens=LENS, slots=SLOTS, init=INIT, ckpts=CKPTS, seed=0, **kw):
    T = sum(lens)
    q, k, v, g, beta = make_inputs(T, seed=seed)
    H, K, V = q.shape[1], q.shape[2], v.shape[2]
    pool0 = garbage_pool(12, H, K, V, seed=seed + 1)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    args = dict(
        state_indices=torch.tensor(slots),
        cu_seqlens=cu,
        has_initial_state=torch.tensor(init),
        checkpoint_seq=torch.tensor([c[0] for c in ckpts]) if ckpts else None,
        checkpoint_offsets=torch.tensor([c[1] for c in ckpts]) if ckpts else None,
        checkpoint_slots=torch.tensor([c[2] for c in ckpts]) if ckpts else None,
        **kw,
    )
    pool_r, pool_c = pool0.clone(), pool0.clone()
    o_r = kda_recurrent(q, k, v, g, beta, state_pool=pool_r, **args)
    o_c = kda_chunked(q, k, v, g, beta, state_pool=pool_c, chunk_size=chunk_size, **args)
    return (q, k, v, g, beta, cu, pool0), (o_r, pool_r), (o_c, pool_c)


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 5, 16, 64])
def test_chunked_equals_recurrent_ragged_batch_with_checkpoints(chunk_size):
    _, (o_r, pool_r), (o_c, pool_c) = run_both(chunk_size)
    torch.testing.assert_close(o_c, o_r, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(pool_c, pool_r, rtol=1e-10, atol=1e-10)


def test_both_forms_equal_literal_loop_per_sequence():
    (q, k, v, g, beta, cu, pool0), (o_r, pool_r), (o_c, pool_c) = run_both(4)
    K = q.shape[-1]
    touched = set(SLOTS) | {c[2] for c in CKPTS}
    for b, (slot, init) in enumerate(zip(SLOTS, INIT)):
        s, e = int(cu[b]), int(cu[b + 1])
        S0 = pool0[slot].clone() if init else torch.zeros_like(pool0[slot])
        o_lit, states = literal_kda(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], S0, K**-0.5)
        final = states[-1] if states else S0
        for o, pool in ((o_r, pool_r), (o_c, pool_c)):
            torch.testing.assert_close(o[s:e], o_lit, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(pool[slot], final, rtol=1e-10, atol=1e-10)
            for cb, off, cslot in CKPTS:
                if cb == b:
                    torch.testing.assert_close(pool[cslot], states[off - 1], rtol=1e-10, atol=1e-10)
    for slot in set(range(12)) - touched:  # untouched slots keep their bytes
        assert torch.equal(pool_r[slot], pool0[slot]) and torch.equal(pool_c[slot], pool0[slot])


def test_has_initial_state_false_ignores_recycled_garbage():
    (q, k, v, g, beta, cu, pool0), (o_r, _), (o_c, _) = run_both(5, ckpts=[])
    b = 1  # has_initial_state False over a slot full of large garbage
    s, e = int(cu[b]), int(cu[b + 1])
    o_lit, _ = literal_kda(
        q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], torch.zeros(2, 6, 8, dtype=F64), 8**-0.5
    )
    torch.testing.assert_close(o_c[s:e], o_lit, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(o_r[s:e], o_lit, rtol=1e-10, atol=1e-10)
    # and the garbage really would have mattered
    o_bad, _ = literal_kda(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], pool0[SLOTS[b]], 8**-0.5)
    assert (o_bad - o_lit).abs().max() > 1e-3


def test_state_continuation_split_prompt_matches_one_pass():
    q, k, v, g, beta = make_inputs(17, seed=3)
    pool = garbage_pool(3, 2, 8, 6, seed=4)
    one = pool.clone()
    o_one = kda_chunked(
        q, k, v, g, beta, one, torch.tensor([1]), torch.tensor([0, 17]), torch.tensor([False]), chunk_size=4
    )
    two = pool.clone()
    o_a = kda_chunked(
        q[:6],
        k[:6],
        v[:6],
        g[:6],
        beta[:6],
        two,
        torch.tensor([1]),
        torch.tensor([0, 6]),
        torch.tensor([False]),
        chunk_size=4,
    )
    o_b = kda_recurrent(
        q[6:],
        k[6:],
        v[6:],
        g[6:],
        beta[6:],
        two,
        torch.tensor([1]),
        torch.tensor([0, 11]),
        torch.tensor([True]),
    )
    torch.testing.assert_close(torch.cat([o_a, o_b]), o_one, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(two, one, rtol=1e-10, atol=1e-10)


def test_no_l2norm_custom_scale_and_padded_sequence():
    lens, slots, init = [7, 3, 6], [0, -1, 2], [True, True, False]
    _, (o_r, pool_r), (o_c, pool_c) = run_both(
        4, lens=lens, slots=slots, init=init, ckpts=[(0, 2, 1)], use_qk_l2norm=False, scale=0.3, seed=5
    )
    torch.testing.assert_close(o_c, o_r, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(pool_c, pool_r, rtol=1e-10, atol=1e-10)
    assert torch.count_nonzero(o_r[7:10]) == 0  # the padded sequence produces zeros
    assert o_r[:7].abs().max() > 0


def test_literal_without_l2norm():
    lens, slots, init = [6], [0], [True]
    (q, k, v, g, beta, cu, pool0), (o_r, pool_r), (o_c, _) = run_both(
        4, lens=lens, slots=slots, init=init, ckpts=[], use_qk_l2norm=False, scale=0.3, seed=6
    )
    o_lit, states = literal_kda(q, k, v, g, beta, pool0[0], 0.3, l2norm=False)
    torch.testing.assert_close(o_r, o_lit, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(o_c, o_lit, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(pool_r[0], states[-1], rtol=1e-10, atol=1e-10)


def test_fp32_strong_decay_long_chunk_is_finite_and_matches():
    q, k, v, g, beta = (t.float() for t in make_inputs(70, H=2, K=16, V=8, seed=7, lower_bound=-5.0))
    g = torch.full_like(g, -4.9)  # e^{-4.9*64} underflows fp32 if factored as e^{G_t} e^{-G_s}
    args = (torch.tensor([0]), torch.tensor([0, 70]), torch.tensor([False]))
    pool_r, pool_c = torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16)
    o_r = kda_recurrent(q, k, v, g, beta, pool_r, *args)
    o_c = kda_chunked(q, k, v, g, beta, pool_c, *args, chunk_size=64)
    assert o_c.dtype == torch.float32 and torch.isfinite(o_c).all()
    torch.testing.assert_close(o_c, o_r, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool_c, pool_r, rtol=1e-4, atol=1e-5)


def test_bf16_inputs_fp32_pool_output_dtype_and_ops_dispatch():
    q, k, v, g, beta = make_inputs(9, seed=8)
    args = (torch.tensor([0]), torch.tensor([0, 9]), torch.tensor([False]))
    pool = torch.zeros(1, 2, 6, 8)
    o = ops.kda_chunked(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), g.float(), beta.bfloat16(), pool, *args, chunk_size=4
    )
    assert o.dtype == torch.bfloat16 and pool.dtype == torch.float32
    ref_pool = torch.zeros(1, 2, 6, 8, dtype=F64)
    o_ref = kda_recurrent(
        q.bfloat16().double(),
        k.bfloat16().double(),
        v.bfloat16().double(),
        g.float().double(),
        beta.bfloat16().double(),
        ref_pool,
        *args,
    )
    torch.testing.assert_close(o.double(), o_ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(pool.double(), ref_pool, rtol=1e-4, atol=1e-5)


def test_checkpoint_offset_validation():
    q, k, v, g, beta = make_inputs(4)
    args = (
        torch.zeros(2, 2, 6, 8, dtype=F64),
        torch.tensor([0]),
        torch.tensor([0, 4]),
        torch.tensor([False]),
    )
    for off in (0, 5):
        with pytest.raises(ValueError):
            kda_chunked(
                q,
                k,
                v,
                g,
                beta,
                *args,
                checkpoint_seq=torch.tensor([0]),
                checkpoint_offsets=torch.tensor([off]),
                checkpoint_slots=torch.tensor([1]),
            )
    with pytest.raises(ValueError):
        kda_recurrent(q, k, v, g, beta, *args, checkpoint_seq=torch.tensor([0]))


def test_kda_gate_formulas():
    gen = torch.Generator().manual_seed(0)
    raw = torch.randn(3, 2, 4, generator=gen, dtype=F64) * 10
    raw[0, 0, 0] = 50.0  # softplus linear region
    A_log = torch.tensor([0.3, -0.7], dtype=F64)
    dt_bias = torch.randn(8, generator=gen, dtype=F64)
    g = kda_gate(raw, A_log, dt_bias)
    g_lb = kda_gate(raw, A_log, dt_bias, lower_bound=-5.0)
    for t in range(3):
        for h in range(2):
            for d in range(4):
                z = float(raw[t, h, d] + dt_bias[h * 4 + d])
                a = math.exp(float(A_log[h]))
                sp = z if z > 20 else math.log1p(math.exp(z))
                assert abs(float(g[t, h, d]) - (-a * sp)) < 1e-9
                assert abs(float(g_lb[t, h, d]) - (-5.0 / (1 + math.exp(-a * z)))) < 1e-9
    assert kda_gate(raw.float(), A_log.float(), dt_bias.float()).dtype == torch.float32
    assert kda_gate(raw.bfloat16(), A_log.float(), dt_bias.float()).dtype == torch.float32
    assert ((g_lb >= -5) & (g_lb <= 0)).all()  # open interval, saturating at |z|*a large
