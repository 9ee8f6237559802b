"""K3 tokenizer: Kimi's tiktoken format (byte-level BPE ranks + 256 reserved special ids).

On-disk format (what Kimi checkpoints ship, loaded fully offline):

* ``tiktoken.model``: one ``<base64 token bytes> <rank>`` pair per line (tiktoken's
  ``load_tiktoken_bpe`` format). Ranks are the ordinary token ids ``0 .. n_base-1``.
* ``tokenizer_config.json``: ``added_tokens_decoder`` maps ``"<id>"`` to ``{"content": NAME, ...}``
  for the named special tokens. Kimi reserves the 256 ids ``n_base .. n_base+255`` for specials;
  ids without an entry are named ``<|reserved_token_{id}|>``. Our checkpoints also store the
  pre-tokenization regex as ``pat_str``; when absent, Kimi's pattern (:data:`KIMI_PAT_STR`) is used.

:func:`write_tokenizer_files` writes a tiny but real tokenizer in that format (256 byte ranks plus a
few BPE merges learned from a built-in sample) for synthetic checkpoints and tests.
"""

from __future__ import annotations

import base64
import json
import os
from collections import Counter
from collections.abc import Iterable

import regex
import tiktoken

TIKTOKEN_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
NUM_RESERVED_SPECIAL_TOKENS = 256

# Kimi's pre-tokenization pattern (``pat_str`` of Kimi-K2 / Kimi-Linear / K3 ``tokenization_kimi.py``):
# o200k's pattern with a leading Han-run alternative and Han removed from the letter classes.
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# Named specials by offset from n_base (the K3 layout: with n_base = 163584, <|media_pad|> is 163605,
# the config's media_placeholder_token_id). `<|kimi_image_placeholder|>` at offset 22 is OUR choice:
# real K3 checkpoints keep it as plain text that vLLM expands; we give it one id.
SPECIAL_TOKEN_OFFSETS: dict[int, str] = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    6: "[start_header_id]",
    7: "[end_header_id]",
    9: "[EOT]",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    22: "<|kimi_image_placeholder|>",
    65: "<osagent_mode>",
    254: "[UNK]",
    255: "[PAD]",
}

END_OF_MSG = "<|end_of_msg|>"

_SAMPLE_TEXT = """\
The quick brown fox jumps over the lazy dog. A serving system streams tokens to the user while
the scheduler keeps the cache warm. The model reads the prompt, then it writes the answer one
token at a time; the detokenizer turns those tokens back into text that the client can read.
Hello, world! This is a short test of the tokenizer, and it is only used in the tests.
It's what they're doing: we've seen that you'll need the thing I'd like to show.

def render(messages, tools=None):
    tokens = []
    for message in messages:
        if message["role"] == "user":
            tokens.extend(encode(message["content"]))
    return tokens

class Cache:
    def __init__(self, size: int) -> None:
        self.size = size
        self.blocks = [0] * size

for i in range(10):
    print(f"step {i}: {i * i}")

今天天气很好，我们一起去公园散步。模型把提示词转换成词元，然后逐个生成回答。
中文文本和英文文本混合在一起，分词器需要正确处理汉字、标点符号和数字 12345。
人工智能正在改变世界，服务系统需要高效地处理每一个请求。
"""


def _byte_ranks() -> dict[bytes, int]:
    return {bytes([b]): b for b in range(256)}


def _learn_merges(text: str, pat_str: str, num_merges: int) -> dict[bytes, int]:
    """Deterministic byte-level BPE on ``text``: returns ranks 0..255+num_merges (bytes -> rank).

    Each step merges the most frequent adjacent pair (ties: the smallest (left, right) rank pair).
    When the sample runs out of pairs, fixed synthetic merges (token + printable ASCII byte) fill
    the rest, so the result always has exactly ``256 + num_merges`` ranks.
    """
    ranks = _byte_ranks()
    vocab = {rank: tok for tok, rank in ranks.items()}
    splitter = regex.compile(pat_str, regex.V1)
    words = Counter(tuple(piece.encode("utf-8")) for piece in splitter.findall(text))
    seqs = {w: list(w) for w in words}
    added = 0
    while added < num_merges:
        pairs: Counter = Counter()
        for w, count in words.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merged = vocab[best[0]] + vocab[best[1]]
        new_id = ranks.get(merged)
        if new_id is None:
            new_id = len(ranks)
            ranks[merged] = new_id
            vocab[new_id] = merged
            added += 1
        for w in words:
            s, out, i = seqs[w], [], 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    out.append(new_id)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    left = 256
    while added < num_merges:  # synthetic fill: deterministic, each part has a lower rank
        for b in range(0x20, 0x7F):
            if added >= num_merges:
                break
            merged = vocab[left] + bytes([b])
            if merged not in ranks:
                ranks[merged] = len(ranks)
                vocab[ranks[merged]] = merged
                added += 1
        left += 1
    return ranks


def write_tokenizer_files(out_dir: str, num_merges: int = 64) -> int:
    """Write ``tiktoken.model`` + ``tokenizer_config.json`` into ``out_dir`` (created if needed).

    The BPE has the 256 single-byte ranks (rank == byte value) and then ``num_merges`` merges learned
    deterministically from a small built-in English/code/Chinese sample; the 256 special ids follow.
    Returns the total vocab size ``256 + num_merges + 256``.
    """
    if not isinstance(num_merges, int) or num_merges < 0:
        raise ValueError(f"num_merges must be a non-negative int, got {num_merges!r}")
    ranks = _learn_merges(_SAMPLE_TEXT, KIMI_PAT_STR, num_merges)
    n_base = len(ranks)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, TIKTOKEN_FILE), "w", encoding="ascii") as f:
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(tok).decode('ascii')} {rank}\n")
    added = {
        str(n_base + off): {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for off, name in sorted(SPECIAL_TOKEN_OFFSETS.items())
    }
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "pat_str": KIMI_PAT_STR,
        "num_reserved_special_tokens": NUM_RESERVED_SPECIAL_TOKENS,
        "added_tokens_decoder": added,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
    }
    with open(os.path.join(out_dir, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
        f.write("\n")
    return n_base + NUM_RESERVED_SPECIAL_TOKENS


def load_ranks(path: str) -> dict[bytes, int]:
    """Parse a ``tiktoken.model`` file (no caching, unlike tiktoken's loader)."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: malformed rank line") from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be exactly 0..{len(ranks) - 1}")
    return ranks


class K3Tokenizer:
    """Kimi-format tokenizer over ``tiktoken.Encoding``.

    Ids ``0 .. num_base_tokens-1`` are ordinary BPE tokens; ``num_base_tokens .. vocab_size-1`` are the
    256 specials. :meth:`encode` never produces a special id (a control token's literal text in user
    input becomes ordinary tokens); callers that need a marker use :meth:`special_id`.
    """

    def __init__(self, ranks: dict[bytes, int], special_names: dict[int, str], pat_str: str = KIMI_PAT_STR,
                 name: str = "k3"):
        self.num_base_tokens = len(ranks)
        self.pat_str = pat_str
        self.special_tokens: dict[str, int] = {}
        for i in range(self.num_base_tokens, self.num_base_tokens + NUM_RESERVED_SPECIAL_TOKENS):
            self.special_tokens[special_names.get(i, f"<|reserved_token_{i}|>")] = i
        if len(self.special_tokens) != NUM_RESERVED_SPECIAL_TOKENS:
            raise ValueError("special token names must be unique")
        self._special_names = {i: s for s, i in self.special_tokens.items()}
        self.vocab_size = self.num_base_tokens + NUM_RESERVED_SPECIAL_TOKENS
        self._enc = tiktoken.Encoding(
            name=name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=self.special_tokens
        )
        self.eos_token_id = self.special_tokens[END_OF_MSG] if END_OF_MSG in self.special_tokens else (
            self.num_base_tokens + 1)
        self.bos_token_id = self.special_tokens.get("[BOS]", self.num_base_tokens)
        self.pad_token_id = self.special_tokens.get("[PAD]", self.vocab_size - 1)

    @classmethod
    def from_dir(cls, path: str) -> K3Tokenizer:
        """Load ``tiktoken.model`` and (optional) ``tokenizer_config.json`` from directory ``path``."""
        ranks = load_ranks(os.path.join(path, TIKTOKEN_FILE))
        n_base = len(ranks)
        config: dict = {}
        cfg_path = os.path.join(path, CONFIG_FILE)
        if os.path.exists(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                config = json.load(f)
        names: dict[int, str] = {}
        for key, meta in (config.get("added_tokens_decoder") or {}).items():
            i = int(key)
            if not n_base <= i < n_base + NUM_RESERVED_SPECIAL_TOKENS:
                raise ValueError(f"{cfg_path}: special id {i} outside the reserved range "
                                 f"[{n_base}, {n_base + NUM_RESERVED_SPECIAL_TOKENS})")
            names[i] = meta["content"] if isinstance(meta, dict) else str(meta)
        if not config.get("added_tokens_decoder"):
            names = {n_base + off: name for off, name in SPECIAL_TOKEN_OFFSETS.items()}
        return cls(ranks, names, config.get("pat_str") or KIMI_PAT_STR, name=os.path.basename(path) or "k3")

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str) -> list[int]:
        """Ordinary tokens only (``disallowed_special=()``): specials' literal text is plain text."""
        return self._enc.encode_ordinary(text)

    def special_id(self, name: str) -> int:
        """Id of a special token by its literal name, e.g. ``special_id("<|open|>")``; KeyError if unknown."""
        try:
            return self.special_tokens[name]
        except KeyError:
            raise KeyError(f"unknown special token {name!r}") from None

    def is_special(self, token_id: int) -> bool:
        return self.num_base_tokens <= token_id < self.vocab_size

    def _check(self, ids: Iterable[int]) -> list[int]:
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} outside the vocabulary [0, {self.vocab_size})")
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (a special gives its literal name in UTF-8)."""
        (token_id,) = self._check([token_id])
        return self._enc.decode_single_token_bytes(token_id)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Concatenated raw bytes of ``ids`` (specials as their literal text)."""
        return self._enc.decode_bytes(self._check(ids))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """UTF-8 text of ``ids`` (invalid sequences become U+FFFD); optionally drops special ids."""
        ids = self._check(ids)
        if skip_special_tokens:
            ids = [i for i in ids if i < self.num_base_tokens]
        return self._enc.decode_bytes(ids).decode("utf-8", errors="replace")

    def special_name(self, token_id: int) -> str | None:
        """Literal name of a special id, or None for an ordinary token."""
        return self._special_names.get(token_id)
