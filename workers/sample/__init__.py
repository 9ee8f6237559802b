"""Token sampling: per-step Sampler, per-sequence SamplingState, logprob helpers."""

from .logprobs import compute_logprobs, gather_logprobs, token_ranks
from .sampler import Sampler, plain_greedy
from .state import LogprobEntry, SamplerOutput, SamplingState, make_generator

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
