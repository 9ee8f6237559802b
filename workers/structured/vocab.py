"""XGrammar's view of the K3 vocabulary (k3serve/tokenizer.py, docs/chat-format.md section 1).

* Ordinary ids `0 .. n_base-1` are their raw tiktoken bytes (VocabType.RAW: no byte-level remapping).
* The four XTML markers `<|open|>`, `<|close|>`, `<|sep|>`, `<|end_of_msg|>` are given private byte
  strings that are not valid UTF-8 (0xFF + name). No text region of a grammar (JSON strings, regexes,
  free text) can ever match them, and no run of ordinary tokens can spell them; grammars place them
  only through token elements (`{"type": "token", "token": id}`). `<|end_of_msg|>` is the stop token.
* Every other special id, and any padding id past the tokenizer (model vocab > tokenizer vocab), is
  empty, which XGrammar treats as special: never allowed in a constrained output.
"""

from __future__ import annotations

from dataclasses import dataclass

MARKER_NAMES = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")


@dataclass(frozen=True)
class Markers:
    """Token ids of the XTML markers and the end of turn."""

    open: int
    close: int
    sep: int
    end_of_msg: int

    @classmethod
    def from_tokenizer(cls, tokenizer) -> Markers:
        return cls(*(tokenizer.special_id(n) for n in MARKER_NAMES))


def encoded_vocab(tokenizer, vocab_size: int) -> list[bytes]:
    """One byte string per id `0 .. vocab_size-1` (see the module docstring)."""
    if vocab_size < tokenizer.num_base_tokens:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {tokenizer.num_base_tokens} "
                         "ordinary tokens")
    markers = {tokenizer.special_id(n): n for n in MARKER_NAMES}
    out: list[bytes] = []
    for i in range(vocab_size):
        if i < tokenizer.num_base_tokens:
            out.append(tokenizer.token_bytes(i))
        elif i in markers:
            out.append(b"\xff" + markers[i].encode("ascii"))
        else:
            out.append(b"")
    return out


def tokenizer_info(tokenizer, vocab_size: int):
    """xgrammar.TokenizerInfo for `tokenizer` with masks of width `vocab_size` (the logits' width)."""
    import xgrammar as xgr

    return xgr.TokenizerInfo(encoded_vocab(tokenizer, vocab_size), xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=[tokenizer.special_id("<|end_of_msg|>")], add_prefix_space=False)
