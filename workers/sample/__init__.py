"""Token sampling: per-step Sampler, per-sequence SamplingState, logprob helpers."""

from .logprobs import compute_logprobs, gather_logprobs, token_ranks
from .sampler import Sampler
from .state import LogprobEntry, SamplerOutput, SamplingState, make_generator

__all__ = [
    "LogprobEntry",
    "Sampler",
    "SamplerOutput",
    "SamplingState",
    "compute_logprobs",
    "gather_logprobs",
    "make_generator",
    "token_ranks",
]
