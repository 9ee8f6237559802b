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


@dataclass(frozen=True)
class MarkerGuard:
    """Keeps a K3 chat output from spelling an XTML marker with ordinary tokens.

    Every marker begins with "<|", so a constrained chat row may not form "<|" from ordinary tokens:
    `always` (packed like XGrammar's bitmask rows) clears the ordinary tokens containing "<|", and
    `after_lt` additionally clears those starting with "|", for when the previous token ended with "<"
    (`ends_lt`). The text parser (k3serve/chat/parsers.py) therefore only ever sees markers that are the
    special tokens. A row the guard would leave empty keeps XGrammar's mask (the request's own grammar
    demands the text).
    """

    always: object  # torch.Tensor[W] int32
    after_lt: object  # torch.Tensor[W] int32
    ends_lt: frozenset[int]

    @classmethod
    def build(cls, tokenizer, vocab_size: int) -> MarkerGuard:
        import numpy as np
        import torch

        words = (vocab_size + 31) // 32
        keep = np.ones(words * 32, dtype=bool)
        keep_after_lt = np.ones(words * 32, dtype=bool)
        ends_lt = set()
        for i in range(tokenizer.num_base_tokens):
            b = tokenizer.token_bytes(i)
            if b"<|" in b:
                keep[i] = keep_after_lt[i] = False
            elif b.startswith(b"|"):
                keep_after_lt[i] = False
            if b.endswith(b"<"):
                ends_lt.add(i)

        def pack(bits):
            return torch.from_numpy(np.packbits(bits, bitorder="little").view("<i4").copy())

        return cls(pack(keep), pack(keep_after_lt), frozenset(ends_lt))

    def apply(self, row, last_token: int | None) -> None:
        """AND the guard into one bitmask row (Tensor[W] int32, CPU) in place, unless that empties it."""
        guarded = row & (self.after_lt if last_token in self.ends_lt else self.always)
        if bool(guarded.any()):
            row.copy_(guarded)
