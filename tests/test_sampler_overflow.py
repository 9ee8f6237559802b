"""A top_k beyond int64 (the offline API does not bound it) must not overflow the sampler's int64 tensor:
it keeps every token, exactly as top_k disabled (a top_k >= 2^63 once killed the engine thread)."""

import torch

from k3serve.sampling_params import SamplingParams
from k3serve.workers.sampler import Sampler, SamplingState


def test_huge_top_k_is_top_k_disabled():
    x = torch.log_softmax(torch.randn(3, 50, dtype=torch.float64, generator=torch.Generator().manual_seed(1)), -1)
    draws = {}
    for top_k in (0, 50, 2**63, 2**80):
        sampler = Sampler(seed=0)
        states = [SamplingState.new(SamplingParams(temperature=1.0, top_k=top_k, seed=7 + i), [1], eos_token_id=None)
                  for i in range(3)]
        draws[top_k] = [sampler(x, states).token_ids for _ in range(20)]
    assert draws[2**63] == draws[2**80] == draws[50] == draws[0]
