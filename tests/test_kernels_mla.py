"""MLA: absorbed paged attention == expanded attention with a random kv_b weight; cache writes."""

import pytest
import torch

from k3serve.kernels import ops

torch.set_num_threads(1)
F64 = torch.float64
Hh, Dn, R, L, Dv, BS = 3, 8, 4, 16, 6, 4


def rnd(*shape, gen):
    return torch.randn(*shape, generator=gen, dtype=F64)


def test_write_cache_layout_and_skips():
    gen = torch.Generator().manual_seed(0)
    cache = rnd(5, BS, L + R, gen=gen)
    before = cache.clone()
    c_kv, k_pe = rnd(4, L, gen=gen), rnd(4, R, gen=gen)
    slots = torch.tensor([7, -1, 0, 19])
    ops.mla_write_cache(c_kv, k_pe, cache, slots)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            torch.testing.assert_close(cache[s // BS, s % BS], torch.cat([c_kv[t], k_pe[t]]), rtol=0, atol=0)
    written = {7, 0, 19}
    flat_b, flat_a = before.view(-1, L + R), cache.view(-1, L + R)
    for s in range(5 * BS):
        if s not in written:
            assert torch.equal(flat_a[s], flat_b[s])
    bf = torch.zeros(2, BS, L + R, dtype=torch.bfloat16)
    ops.mla_write_cache(c_kv.float(), k_pe.float(), bf, torch.tensor([1, 2, 3, 4]))
    torch.testing.assert_close(bf[1, 0].double(), torch.cat([c_kv[3], k_pe[3]]).bfloat16().double())


def expanded_via_sdpa(q_nope, q_pe, k_nope, k_pe, v, scale):
    """Independent oracle: torch SDPA over [nope|pe] heads with an explicit bottom-right causal mask."""
    T, S = q_nope.shape[0], k_nope.shape[0]
    q = torch.cat([q_nope, q_pe], -1).transpose(0, 1)
    k = torch.cat([k_nope, k_pe[:, None, :].expand(S, Hh, R)], -1).transpose(0, 1)
    mask = torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None]
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v.transpose(0, 1), attn_mask=mask, scale=scale
    ).transpose(0, 1)


def test_expanded_matches_sdpa():
    gen = torch.Generator().manual_seed(1)
    T, S = 3, 7
    args = (
        rnd(T, Hh, Dn, gen=gen),
        rnd(T, Hh, R, gen=gen),
        rnd(S, Hh, Dn, gen=gen),
        rnd(S, R, gen=gen),
        rnd(S, Hh, Dv, gen=gen),
    )
    out = ops.mla_attention_expanded(*args, scale=0.2)
    torch.testing.assert_close(out, expanded_via_sdpa(*args, scale=0.2), rtol=1e-10, atol=1e-10)
    full = ops.mla_attention_expanded(*args, scale=0.2, causal=False)
    assert not torch.allclose(full, out)
    torch.testing.assert_close(full[-1], out[-1], rtol=1e-12, atol=1e-12)  # last query sees everything anyway


@pytest.mark.parametrize("seed", [2, 3])
def test_paged_absorbed_equals_expanded(seed):
    gen = torch.Generator().manual_seed(seed)
    # (context length incl. this step, query tokens this step): prefill, decode, chunked prefill
    seqs = [(7, 7), (10, 1), (13, 3)]
    num_blocks = 16
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = 4
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    for b, (n, _) in enumerate(seqs):
        for j in range(-(-n // BS)):
            block_tables[b, j] = perm.pop()
    kv_b = rnd(Hh * (Dn + Dv), L, gen=gen) * 0.3  # kv_b_proj weight: latent -> per head [k_nope | v]
    W = kv_b.view(Hh, Dn + Dv, L)
    W_UK, W_UV = W[:, :Dn], W[:, Dn:]
    cache = rnd(num_blocks, BS, L + R, gen=gen) * 10  # garbage outside the written slots
    scale = (Dn + R) ** -0.5
    ctx = [(rnd(n, L, gen=gen), rnd(n, R, gen=gen)) for n, _ in seqs]
    # earlier steps wrote the context; this step writes the new tokens (exercise both calls)
    for step in ("context", "new"):
        for b, ((n, nq), (c_kv, k_pe)) in enumerate(zip(seqs, ctx)):
            pos = torch.arange(0, n - nq) if step == "context" else torch.arange(n - nq, n)
            slots = block_tables[b, pos // BS].long() * BS + pos % BS
            ops.mla_write_cache(c_kv[pos], k_pe[pos], cache, slots)
    qs = [(rnd(nq, Hh, Dn, gen=gen), rnd(nq, Hh, R, gen=gen)) for _, nq in seqs]
    q_nope = torch.cat([q for q, _ in qs])
    q_pe = torch.cat([p for _, p in qs])
    q_lat = torch.einsum("thd,hdl->thl", q_nope, W_UK)
    cu_q = torch.tensor([0, 7, 8, 11], dtype=torch.int32)
    seq_lens = torch.tensor([n for n, _ in seqs], dtype=torch.int32)
    o_lat = ops.mla_paged_attention(q_lat, q_pe, cache, block_tables, seq_lens, cu_q, scale, kv_lora_rank=L)
    assert o_lat.shape == (11, Hh, L)
    o = torch.einsum("thl,hvl->thv", o_lat, W_UV)
    for b, (c_kv, k_pe) in enumerate(ctx):
        k_nope = torch.einsum("sl,hdl->shd", c_kv, W_UK)
        v = torch.einsum("sl,hvl->shv", c_kv, W_UV)
        qn, qp = qs[b]
        exp = ops.mla_attention_expanded(qn, qp, k_nope, k_pe, v, scale)
        s, e = int(cu_q[b]), int(cu_q[b + 1])
        torch.testing.assert_close(o[s:e], exp, rtol=1e-10, atol=1e-10)
