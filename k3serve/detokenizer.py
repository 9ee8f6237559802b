"""Incremental detokenization with stop strings.

:class:`IncrementalDetokenizer` turns a growing token-id stream into safe-to-emit text deltas:

* it never splits a UTF-8 character: bytes of an incomplete sequence are held until the sequence
  completes (invalid sequences become U+FFFD, exactly as ``bytes.decode(errors="replace")``);
* it holds back the longest suffix of the undelivered text that could be the beginning of a stop
  string, so a stop string split across tokens is never partially emitted;
* when a stop string appears, the text is cut at its start (or after its end with
  ``include_stop_str_in_output``), everything after is discarded, ``stopped_by`` is set, and later
  pushes emit nothing. If several stop strings match, the one that is complete first (smallest end
  offset; on a tie the longer one) wins, i.e. what a token-by-token stream would see.

The concatenation of all returned deltas always equals ``.text``.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence


class IncrementalDetokenizer:
    """Stateful detokenizer for one output sequence.

    ``tokenizer`` needs ``token_bytes(id) -> bytes`` and ``is_special(id) -> bool`` (see
    :class:`k3serve.tokenizer.K3Tokenizer`). Special tokens contribute their literal text
    unless ``skip_special_tokens``.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: Sequence[str] | str = (),
                 include_stop_str_in_output: bool = False):
        if isinstance(stop, str):
            stop = [stop]
        stop = list(stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stopped_by: str | None = None
        self.text = ""
        self.num_tokens = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""  # decoded text not yet emitted (only ever a held-back stop prefix between pushes)
        self._flushed = False

    @property
    def finished(self) -> bool:
        return self.stopped_by is not None or self._flushed

    def push(self, token_ids: Iterable[int]) -> str:
        """Consume new token ids; return the newly emittable text (possibly empty)."""
        if self.finished:
            return ""
        chunks = []
        for i in token_ids:
            self.num_tokens += 1
            if self.skip_special_tokens and self.tokenizer.is_special(i):
                continue
            chunks.append(self.tokenizer.token_bytes(i))
        self._pending += self._decoder.decode(b"".join(chunks))
        return self._emit(final=False)

    def flush(self) -> str:
        """End of stream (e.g. finish by length): emit incomplete bytes (as U+FFFD) and held-back text."""
        if self.finished:
            return ""
        self._pending += self._decoder.decode(b"", final=True)
        delta = self._emit(final=True)
        self._flushed = True
        return delta

    def _emit(self, final: bool) -> str:
        pending = self._pending
        hit = self._find_stop(pending)
        if hit is not None:
            start, s = hit
            cut = start + len(s) if self.include_stop_str_in_output else start
            delta = pending[:cut]
            self.stopped_by = s
            self._pending = ""
        else:
            keep = 0 if final else self._holdback(pending)
            delta = pending[: len(pending) - keep]
            self._pending = pending[len(pending) - keep:]
        self.text += delta
        return delta

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for s in self.stop:
            i = text.find(s)
            if i >= 0:
                key = (i + len(s), -len(s), s)
                if best is None or key < best:
                    best = key
        if best is None:
            return None
        end, neg_len, s = best
        return end + neg_len, s

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        keep = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:k]):
                    keep = k
                    break
        return keep


class DeferredDetokenizer:
    """An :class:`IncrementalDetokenizer` without stop strings whose text is decoded only when it is read.

    ``push`` collects the ids and returns ``""``; ``text``, ``flush`` and ``num_tokens`` first hand the collected
    ids to the incremental detokenizer in one push. Without stop strings nothing is held back, so ``text`` read at
    any point is what the token-by-token detokenizer would hold then (incomplete UTF-8 bytes still wait for the rest
    or the flush). For an engine whose outputs are built rarely (an offline ``LLM.generate`` builds each request's
    output once, at its end: LLMEngine.final_outputs_only) the per-token decode work of every step goes away; the
    pushed deltas are not returned (the engine reads ``text``)."""

    stopped_by = None  # no stop strings

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._inner = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self._ids: list[int] = []

    def _drain(self) -> None:
        if self._ids:
            ids, self._ids = self._ids, []
            self._inner.push(ids)

    @property
    def finished(self) -> bool:
        return self._inner.finished

    @property
    def text(self) -> str:
        self._drain()
        return self._inner.text

    @property
    def num_tokens(self) -> int:
        return self._inner.num_tokens + len(self._ids)

    def push(self, token_ids: Iterable[int]) -> str:
        if not self._inner.finished:
            self._ids.extend(token_ids)
        return ""

    def flush(self) -> str:
        self._drain()
        return self._inner.flush()
