"""Per-sequence deltas: the unit that front ends (HTTP server, gRPC worker, router) stream.

The engine reports cumulative `RequestOutput`s; `DeltaTracker.update()` turns each into the
`SeqDelta`s of the sequences that changed since the previous call. The router rebuilds the same
`SeqDelta`s from the worker's gRPC messages, so the response builders (chat_output,
completion_output) work unchanged behind either.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SeqDelta:
    """New output of one sequence.

    token_ids: new token ids; text: new text (the engine's detokenized text, never retracted);
    logprobs: one `{token_id: Logprob}` dict per new token when requested, else None;
    finish_reason / stop_reason: set on the sequence's last delta.
    """

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class DeltaTracker:
    """Cumulative RequestOutputs of ONE request → list[SeqDelta] (only changed sequences)."""

    def __init__(self) -> None:
        self._tokens: dict[int, int] = {}
        self._chars: dict[int, int] = {}
        self._done: set[int] = set()
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def update(self, out) -> list[SeqDelta]:
        self.prompt_tokens = len(out.prompt_token_ids)
        self.cached_tokens = int(out.num_cached_tokens or 0)
        deltas = []
        for c in out.outputs:
            if c.index in self._done:
                continue
            nt, nc = self._tokens.get(c.index, 0), self._chars.get(c.index, 0)
            new_ids = list(c.token_ids[nt:])
            text = c.text or ""
            new_text = text[nc:] if len(text) >= nc else ""
            lps = list(c.logprobs[nt:]) if c.logprobs is not None else None
            if not new_ids and not new_text and c.finish_reason is None:
                continue
            self._tokens[c.index] = len(c.token_ids)
            self._chars[c.index] = max(nc, len(text))
            if c.finish_reason is not None:
                self._done.add(c.index)
            deltas.append(SeqDelta(c.index, new_ids, new_text, lps, c.finish_reason, c.stop_reason))
        return deltas

    def num_generated(self) -> int:
        return sum(self._tokens.values())
