"""A byte-level BPE trainer that writes K3's tokenizer format (`tiktoken.model` + `tokenizer_config.json`).

    ranks = train_bpe(texts, vocab_size=3584)      # bytes -> rank, ranks 0..vocab_size-1
    write_k3_tokenizer(out_dir, ranks)              # loadable by k3serve.tokenizer.K3Tokenizer.from_dir

Pre-tokenization uses Kimi's pattern (`k3serve.tokenizer.KIMI_PAT_STR`), so merges never cross the
pieces the runtime tokenizer splits on. Training counts the distinct pieces once, then merges the most
frequent adjacent pair (ties: the smallest (left, right) rank pair) with incremental pair counts and a
lazy max-heap, so each merge only touches the pieces that contain the pair. Ranks 0..255 are the single
bytes (rank == byte value); merge n gets rank 256 + n (a merge whose bytes already have a rank reuses it
and adds no rank). The 256 K3 special ids follow the ordinary ranks (`SPECIAL_TOKEN_OFFSETS`).
"""

from __future__ import annotations

import base64
import heapq
import json
import os
from collections import Counter, defaultdict
from collections.abc import Iterable

import regex

from k3serve.tokenizer import (
    CONFIG_FILE,
    KIMI_PAT_STR,
    NUM_RESERVED_SPECIAL_TOKENS,
    SPECIAL_TOKEN_OFFSETS,
    TIKTOKEN_FILE,
)


def count_pieces(texts: Iterable[str], pat_str: str = KIMI_PAT_STR) -> Counter:
    """Distinct pre-tokenized pieces (as bytes) of `texts` with their counts."""
    splitter = regex.compile(pat_str, regex.V1)
    counts: Counter = Counter()
    for text in texts:
        counts.update(splitter.findall(text))
    return Counter({piece.encode("utf-8"): n for piece, n in counts.items()})


def train_bpe_from_counts(pieces: Counter, vocab_size: int) -> dict[bytes, int]:
    """BPE ranks (bytes -> rank) with exactly `vocab_size` ranks when the data allows (>= 256)."""
    if vocab_size < 256:
        raise ValueError(f"vocab_size must be >= 256 (the byte ranks), got {vocab_size}")
    ranks = {bytes([b]): b for b in range(256)}
    vocab = {b: bytes([b]) for b in range(256)}
    words = [list(w) for w in pieces]
    freq = list(pieces.values())
    pair_count: dict[tuple[int, int], int] = defaultdict(int)
    where: dict[tuple[int, int], set[int]] = defaultdict(set)
    for wi, s in enumerate(words):
        for a, b in zip(s, s[1:]):
            pair_count[(a, b)] += freq[wi]
            where[(a, b)].add(wi)
    heap = [(-c, p) for p, c in pair_count.items()]
    heapq.heapify(heap)
    while len(ranks) < vocab_size and heap:
        negc, pair = heapq.heappop(heap)
        if pair_count.get(pair, 0) != -negc or negc == 0:
            continue  # stale heap entry
        merged = vocab[pair[0]] + vocab[pair[1]]
        new_id = ranks.get(merged)
        if new_id is None:
            new_id = ranks[merged] = len(ranks)
            vocab[new_id] = merged
        touched: dict[tuple[int, int], int] = {}
        for wi in list(where[pair]):
            s, f = words[wi], freq[wi]
            for a, b in zip(s, s[1:]):
                pair_count[(a, b)] -= f
                touched[(a, b)] = 1
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == pair[0] and s[i + 1] == pair[1]:
                    out.append(new_id)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            for a, b in zip(s, s[1:]):
                where[(a, b)].discard(wi)
            words[wi] = out
            for a, b in zip(out, out[1:]):
                pair_count[(a, b)] += f
                where[(a, b)].add(wi)
                touched[(a, b)] = 1
        for p in touched:
            c = pair_count.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, p))
            else:
                pair_count.pop(p, None)
                where.pop(p, None)
    return ranks


def train_bpe(texts: Iterable[str], vocab_size: int, pat_str: str = KIMI_PAT_STR) -> dict[bytes, int]:
    return train_bpe_from_counts(count_pieces(texts, pat_str), vocab_size)


def write_k3_tokenizer(out_dir: str, ranks: dict[bytes, int], pat_str: str = KIMI_PAT_STR) -> int:
    """Write `ranks` + K3's 256 special ids in Kimi's tiktoken format; returns the total vocab size."""
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("ranks must be exactly 0..n-1")
    n_base = len(ranks)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, TIKTOKEN_FILE), "w", encoding="ascii") as f:
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(tok).decode('ascii')} {rank}\n")
    added = {str(n_base + off): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                                 "single_word": False, "special": True}
             for off, name in sorted(SPECIAL_TOKEN_OFFSETS.items())}
    config = {"tokenizer_class": "TikTokenTokenizer", "pat_str": pat_str,
              "num_reserved_special_tokens": NUM_RESERVED_SPECIAL_TOKENS, "added_tokens_decoder": added,
              "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]"}
    with open(os.path.join(out_dir, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
        f.write("\n")
    return n_base + NUM_RESERVED_SPECIAL_TOKENS
