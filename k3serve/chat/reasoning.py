"""Token-level reasoning helpers (usage accounting, reasoning-end detection) on K3 output ids.

Marker sequences are ``[<|open|>] encode(NAME) [<|sep|>]`` / ``[<|close|>] encode(NAME) [<|sep|>]``
(3 tokens with the real K3 vocabulary, where each channel name is one token).
"""

from __future__ import annotations

from collections.abc import Sequence


def marker_ids(tokenizer, kind: str, name: str) -> list[int]:
    """Token ids of ``<|open|>NAME<|sep|>`` (kind="open") or ``<|close|>NAME<|sep|>`` (kind="close")."""
    first = tokenizer.special_id("<|open|>" if kind == "open" else "<|close|>")
    return [first, *tokenizer.encode(name), tokenizer.special_id("<|sep|>")]


def _find(ids: Sequence[int], pat: list[int], start: int = 0) -> int:
    n = len(pat)
    for i in range(start, len(ids) - n + 1):
        if list(ids[i:i + n]) == pat:
            return i
    return -1


def _rfind(ids: Sequence[int], pat: list[int]) -> int:
    n = len(pat)
    for i in range(len(ids) - n, -1, -1):
        if list(ids[i:i + n]) == pat:
            return i
    return -1


def is_reasoning_end(tokenizer, ids: Sequence[int]) -> bool:
    """True iff the most recent think marker in ``ids`` is the close (safe on multi-turn prompts)."""
    return _rfind(ids, marker_ids(tokenizer, "close", "think")) > _rfind(ids, marker_ids(tokenizer, "open", "think"))


def count_reasoning_tokens(tokenizer, output_ids: Sequence[int], thinking: bool) -> int:
    """Number of generated tokens inside the think channel.

    Thinking off -> 0. Otherwise counting starts at the first output token (an echoed think opener is
    not counted) and stops at the first ``<|close|>think<|sep|>`` or ``<|open|>response<|sep|>``;
    with neither, every output token is reasoning (truncated).
    """
    if not thinking:
        return 0
    start = 0
    opener = marker_ids(tokenizer, "open", "think")
    if list(output_ids[:len(opener)]) == opener:
        start = len(opener)
    ends = [i for i in (_find(output_ids, marker_ids(tokenizer, "close", "think"), start),
                        _find(output_ids, marker_ids(tokenizer, "open", "response"), start)) if i >= 0]
    return (min(ends) if ends else len(output_ids)) - start
