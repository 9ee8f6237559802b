"""Entry point for the engine: `from k3serve.workers.sampler import Sampler, SamplingState, ...`.

The implementation lives in `k3serve.workers.sample` (one module per stage); this module only
re-exports its public API.
"""

from k3serve.workers.sample import (
    LogprobEntry,
    Sampler,
    SamplerOutput,
    SamplingState,
    compute_logprobs,
    gather_logprobs,
    make_generator,
    plain_greedy,
    token_ranks,
)

__all__ = [
    "LogprobEntry",
    "Sampler",
    "SamplerOutput",
    "SamplingState",
    "compute_logprobs",
    "gather_logprobs",
    "make_generator",
    "plain_greedy",
    "token_ranks",
]
