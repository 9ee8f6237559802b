"""Checkpoint exports aimed at a padded sequence (state slot -1): the CPU chunked KDA skips them, as the
reference (kernels/reference/_kda_batch.py run_sequences) and the Triton form (kernels/triton/kda_chunk.py
ChunkPlan) do; every other sequence's outputs, final states and exports equal the reference's."""

import random

import pytest
import torch

from k3serve.kernels import cpu, reference

torch.set_num_threads(1)
F64 = torch.float64


def _case(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    H, K, V = rng.choice([(2, 8, 6), (3, 16, 16), (1, 4, 8)])
    B = rng.randint(2, 5)
    lens = [rng.randint(1, 70) for _ in range(B)]
    T = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    slots = rng.sample(range(2 * B), B)
    padded = rng.sample(range(B), rng.randint(1, B - 1))  # at least one live sequence stays
    for b in padded:
        slots[b] = -1
    free = list(range(2 * B, 2 * B + 4 * B))
    ckpt = []
    for b in range(B):  # every sequence exports, the padded ones included
        for off in sorted(rng.sample(range(1, lens[b] + 1), min(2, lens[b]))):
            ckpt.append((b, off, free.pop()))
    t = dict(q=torch.randn(T, H, K, generator=gen, dtype=F64), k=torch.randn(T, H, K, generator=gen, dtype=F64),
             v=torch.randn(T, H, V, generator=gen, dtype=F64),
             beta=torch.sigmoid(torch.randn(T, H, generator=gen, dtype=F64)))
    t["g"] = reference.kda_gate(torch.randn(T, H, K, generator=gen, dtype=F64),
                                torch.randn(H, generator=gen, dtype=F64) * 0.5,
                                torch.randn(H * K, generator=gen, dtype=F64), -5.0)
    pool = torch.randn(2 * B + 4 * B, H, V, K, generator=gen, dtype=F64)
    kw = dict(state_indices=torch.tensor(slots), cu_seqlens=cu,
              has_initial_state=torch.tensor([rng.random() < 0.5 for _ in range(B)]),
              checkpoint_seq=torch.tensor([c[0] for c in ckpt]),
              checkpoint_offsets=torch.tensor([c[1] for c in ckpt]),
              checkpoint_slots=torch.tensor([c[2] for c in ckpt]))
    skipped = [c[2] for c in ckpt if slots[c[0]] < 0]
    return t, pool, kw, cu, padded, skipped


@pytest.mark.parametrize("seed", range(5))
def test_padded_sequence_exports_are_skipped_like_the_reference(seed, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("fell back to the reference op")

    monkeypatch.setattr(cpu.kda, "_ref_chunked", refuse)  # the batched form itself, not its fallback
    t, pool, kw, cu, padded, skipped = _case(seed)
    assert skipped
    p_ref, p_cpu = pool.clone(), pool.clone()
    want = reference.kda_chunked(t["q"], t["k"], t["v"], t["g"], t["beta"], p_ref, **kw)
    got = cpu.kda_chunked(t["q"], t["k"], t["v"], t["g"], t["beta"], p_cpu, **kw)
    assert float((got - want).abs().max()) < 1e-10
    assert float((p_cpu - p_ref).abs().max()) < 1e-10  # finals, live exports, untouched slots
    assert torch.equal(p_cpu[skipped], pool[skipped])  # a padded sequence's export slots are not written
    for b in padded:  # and its output rows are zero
        assert not got[int(cu[b]):int(cu[b + 1])].any()
