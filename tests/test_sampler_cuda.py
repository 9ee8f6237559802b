"""The sampler on a CUDA device (run on the lent H200): same contracts as on CPU."""

from __future__ import annotations

import pytest
import torch

from k3serve.sampling_params import SamplingParams
from k3serve.workers.sampler import Sampler, SamplingState

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
V = 4096


def step_logits(key: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(key * 1000 + step)
    return (torch.randn(V, generator=g) * 3.0).cuda()


def decode(
    sampler: Sampler, seqs: dict[int, SamplingState], order: list[int], steps: int
) -> dict[int, list[int]]:
    for step in range(steps):
        order = order[1:] + order[:1]  # rotate: every row visits every position
        x = torch.stack([step_logits(k, step) for k in order])
        out = sampler(x, [seqs[k] for k in order])
        for k, tok in zip(order, out.token_ids):
            seqs[k].output_token_ids.append(tok)
    return {k: s.output_token_ids for k, s in seqs.items()}


def target() -> SamplingState:
    p = SamplingParams(seed=7, temperature=0.9, top_k=100, top_p=0.9, min_p=0.01, repetition_penalty=1.2)
    return SamplingState.new(p, [1, 2, 3], eos_token_id=0)


def test_greedy_and_logprobs_match_cpu():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, V, generator=g)
    sts = [
        SamplingState.new(SamplingParams(temperature=0.0, logprobs=5, presence_penalty=0.5), [5]) for _ in x
    ]
    for st in sts:
        st.output_token_ids = [int(x[0].argmax())]
    cpu = Sampler(seed=0)(x, sts)
    gpu = Sampler(seed=0)(x.cuda(), sts)
    assert gpu.token_ids == cpu.token_ids
    for a, b in zip(cpu.logprobs, gpu.logprobs):
        assert [t[0] for t in a] == [t[0] for t in b] and [t[2] for t in a] == [t[2] for t in b]
        assert [t[1] for t in a] == pytest.approx([t[1] for t in b], abs=1e-4)


def test_seeded_batch_independent_on_cuda():
    alone = decode(Sampler(seed=0), {9: target()}, [9], 30)[9]
    seqs = {
        1: SamplingState.new(SamplingParams(temperature=1.0), [4]),
        2: SamplingState.new(SamplingParams(temperature=0.0), [4]),
        3: SamplingState.new(SamplingParams(temperature=0.5, seed=3, logprobs=3), [4]),
        9: target(),
    }
    got = decode(Sampler(seed=5), seqs, [1, 2, 9, 3], 30)
    assert got[9] == alone
    assert len(set(alone)) > 3


def test_unseeded_rows_on_cuda_generator_frequencies():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0], device="cuda")
    p = torch.softmax(logits.double().cpu() / 0.8, dim=0)
    n = 20000
    sts = [SamplingState.new(SamplingParams(temperature=0.8), []) for _ in range(n)]
    a = Sampler(seed=1)(logits.expand(n, -1), sts).token_ids
    assert a == Sampler(seed=1)(logits.expand(n, -1), sts).token_ids
    counts = torch.bincount(torch.tensor(a), minlength=4).double()
    chi2 = float(((counts - p * n) ** 2 / (p * n)).sum())
    assert chi2 < 25.0  # df = 3
