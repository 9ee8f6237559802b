"""Prompt-lookup n-gram drafting (no extra weights): propose the tokens that followed the latest earlier
occurrence of the sequence's own suffix.

    proposer = NgramProposer(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=5)
    drafts = proposer.propose(token_ids)     # a list of 0..k token ids

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the last n tokens are looked up among the
earlier positions of the sequence (an occurrence may overlap the suffix but is not the suffix itself);
the first n that matches wins (the longest match), its latest occurrence wins among several, and the
proposal is the up-to-k tokens that followed it (fewer when the occurrence ends near the end of the
sequence). No match: no proposal. The argument names follow vLLM's `speculative_config`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NgramProposer:
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    def __post_init__(self):
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")

    def match(self, token_ids: Sequence[int]) -> tuple[int, int] | None:
        """(n, start) of the chosen earlier occurrence of the length-n suffix, or None."""
        seq = list(token_ids)
        T = len(seq)
        for n in range(min(self.prompt_lookup_max, T - 1), self.prompt_lookup_min - 1, -1):
            suffix = seq[T - n:]
            for start in range(T - n - 1, -1, -1):
                if seq[start : start + n] == suffix:
                    return n, start
        return None

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        m = self.match(token_ids)
        if m is None:
            return []
        n, start = m
        follow = start + n
        return [int(t) for t in list(token_ids)[follow : follow + self.num_speculative_tokens]]
