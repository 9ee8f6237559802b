"""Logprobs in OpenAI's two wire shapes (chat `logprobs.content[]`, completions `tokens/token_logprobs`).

Input per generated position: the chosen token id and a `{token_id: Logprob}` dict holding the
chosen token and the top-k alternatives (k = what the request asked for).
"""

from __future__ import annotations

import math
from collections.abc import Callable


class TokenText:
    """Token id → (text, raw bytes), from a tokenizer with `token_bytes(id) -> bytes`."""

    def __init__(self, tokenizer):
        self._tok = tokenizer

    def bytes(self, token_id: int) -> bytes:
        return self._tok.token_bytes(int(token_id))

    def __call__(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")


def _lp(value: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number.
    return max(float(value), -9999.0) if not math.isnan(float(value)) else -9999.0


def _top(entries: dict, k: int) -> list[tuple[int, object]]:
    items = list(entries.items())
    if any(getattr(lp, "rank", None) is not None for _, lp in items):
        items.sort(key=lambda kv: (kv[1].rank is None, kv[1].rank if kv[1].rank is not None else 0))
    else:
        items.sort(key=lambda kv: -kv[1].logprob)
    return items[:k]


def _text(token_id: int, lp, token_text: Callable[[int], str]) -> str:
    dec = getattr(lp, "decoded_token", None) if lp is not None else None
    return dec if dec is not None else token_text(token_id)


def chat_logprobs(token_ids: list[int], logprobs: list[dict], top_k: int, token_text: TokenText) -> list[dict]:
    """Items of a chat choice's `logprobs.content` for the given positions."""
    content = []
    for tid, entries in zip(token_ids, logprobs):
        chosen = entries.get(tid)
        text = _text(tid, chosen, token_text)
        top = [{"token": _text(t, lp, token_text), "logprob": _lp(lp.logprob),
                "bytes": list(token_text.bytes(t))} for t, lp in _top(entries, top_k)]
        content.append({"token": text, "logprob": _lp(chosen.logprob) if chosen is not None else -9999.0,
                        "bytes": list(token_text.bytes(tid)), "top_logprobs": top})
    return content


class CompletionLogprobs:
    """Accumulates the completions-API logprobs object across deltas (text offsets keep running)."""

    def __init__(self, top_k: int, token_text: TokenText, start_offset: int = 0):
        self.top_k = top_k
        self.token_text = token_text
        self.offset = start_offset

    def add(self, token_ids: list[int], logprobs: list[dict]) -> dict:
        """The logprobs object for these positions; advances the running text offset."""
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, entries in zip(token_ids, logprobs):
            chosen = entries.get(tid)
            text = _text(tid, chosen, self.token_text)
            out["tokens"].append(text)
            out["token_logprobs"].append(_lp(chosen.logprob) if chosen is not None else None)
            out["top_logprobs"].append({_text(t, lp, self.token_text): _lp(lp.logprob)
                                        for t, lp in _top(entries, self.top_k)} if self.top_k else None)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def merge_completion_logprobs(parts: list[dict]) -> dict | None:
    if not parts:
        return None
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for p in parts:
        for k in out:
            out[k].extend(p[k])
    return out
