"""A synthetic agentic trace: many sessions, several turns, one shared system prompt + tool list.

Turn 0 of session s is `shared + first_message[s]`; turn t > 0 replays the previous turn's prompt,
appends the model's reply to it (its greedy output tokens) and then the turn's new text (a tool result
or user message). So every turn's prompt extends the previous one — the access pattern prefix caching
is for — and all sessions share the first `len(shared)` tokens.

Plain data only; token ids are drawn from a seeded `random.Random`, so the same arguments give the
same trace on every machine.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class AgenticTrace:
    """`shared`: token ids every session starts with. `new_text[s][t]`: ids appended at turn t of
    session s (turn 0: the first user message). `output_tokens`: tokens generated per turn."""

    shared: list[int]
    new_text: list[list[list[int]]]
    output_tokens: int

    @property
    def num_sessions(self) -> int:
        return len(self.new_text)

    @property
    def num_turns(self) -> int:
        return len(self.new_text[0]) if self.new_text else 0

    def prompt(self, session: int, turn: int, previous_prompt: list[int] | None,
               previous_output: list[int] | None) -> list[int]:
        """The prompt of `turn` of `session`; turn > 0 needs the previous turn's prompt and output."""
        if turn == 0:
            return self.shared + self.new_text[session][0]
        if previous_prompt is None or previous_output is None:
            raise ValueError("turn > 0 needs the previous prompt and output")
        return previous_prompt + previous_output + self.new_text[session][turn]

    def prompt_lengths(self, session: int) -> list[int]:
        """Prompt length of every turn of `session` (outputs are exactly `output_tokens` long)."""
        out, n = [], len(self.shared)
        for t, text in enumerate(self.new_text[session]):
            n += len(text) + (self.output_tokens if t else 0)
            out.append(n)
        return out

    def total_prompt_tokens(self) -> int:
        return sum(sum(self.prompt_lengths(s)) for s in range(self.num_sessions))

    def max_length(self) -> int:
        """Longest sequence (last prompt + its output) over all sessions."""
        return max(self.prompt_lengths(s)[-1] for s in range(self.num_sessions)) + self.output_tokens

    def working_set_blocks(self, block_size: int, snapshot_blocks: int) -> int:
        """Blocks that hold every session's final state at once: the shared prefix's full MLA pages
        (once), each session's remaining MLA pages, and one KDA snapshot (`snapshot_blocks` pages)
        per session. A cache smaller than this must evict something a later turn could reuse."""
        shared_full = len(self.shared) // block_size
        total = shared_full
        for s in range(self.num_sessions):
            end = self.prompt_lengths(s)[-1] + self.output_tokens
            total += math.ceil(end / block_size) - shared_full + snapshot_blocks
        return total


def make_trace(sessions: int, turns: int, shared_len: int, new_min: int, new_max: int, output_tokens: int,
               seed: int = 0, token_lo: int = 10, token_hi: int = 500) -> AgenticTrace:
    """A seeded trace; each turn's new text is `new_min..new_max` ids drawn from [token_lo, token_hi)."""
    if sessions < 1 or turns < 1:
        raise ValueError("need at least one session and one turn")
    if not 0 < new_min <= new_max or shared_len < 0 or output_tokens < 1:
        raise ValueError("need 0 < new_min <= new_max, shared_len >= 0 and output_tokens >= 1")
    rng = random.Random(seed)

    def text(n: int) -> list[int]:
        return [rng.randrange(token_lo, token_hi) for _ in range(n)]

    shared = text(shared_len)
    new_text = [[text(rng.randint(new_min, new_max)) for _ in range(turns)] for _ in range(sessions)]
    return AgenticTrace(shared, new_text, output_tokens)
