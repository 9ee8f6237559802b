"""Chained prefix-block hashes: the one definition shared by workers, router and store.

Canonical byte encoding (version 1), all integers little-endian:

    root   = sha256( b"k3serve/prefix-hash/v1\\0" || fingerprint[32] || u32(len(salt)) || salt_utf8 )
    unit_j = sha256( parent[32] || u32(n) || u32(tok_0) … u32(tok_{n-1})
                     || u32(num_extra) || (u32(len(extra_k)) || extra_k)… )

`parent` is `root` for the first unit and `unit_{j-1}` after that; `n` is the hash unit (every
hashed unit is full); token ids are unsigned 32-bit. `extra` keys (bytes) are reserved for
multimodal item hashes overlapping the unit (none today). Different `cache_salt`s give different
roots, so they never share a block. Never pickle: these bytes are reproducible in any process.

The key of a prefix of length L (a multiple of the unit) is `unit_{L/unit - 1}`; the key of a
block of size B ending at token e is therefore the unit hash at e without re-hashing.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable, Sequence

HASH_VERSION = b"k3serve/prefix-hash/v1\0"
DIGEST_SIZE = 32


def root_hash(model_fingerprint: bytes, cache_salt: str | None = None) -> bytes:
    if len(model_fingerprint) != DIGEST_SIZE:
        raise ValueError("model_fingerprint must be a 32-byte digest")
    salt = (cache_salt or "").encode("utf-8")
    return hashlib.sha256(HASH_VERSION + model_fingerprint + struct.pack("<I", len(salt)) + salt).digest()


def unit_hash(parent: bytes, tokens: Sequence[int], extra_keys: Iterable[bytes] = ()) -> bytes:
    extra = list(extra_keys)
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<I{len(tokens)}I", len(tokens), *tokens))
    h.update(struct.pack("<I", len(extra)))
    for e in extra:
        h.update(struct.pack("<I", len(e)))
        h.update(e)
    return h.digest()


def chain_hashes(root: bytes, token_ids: Sequence[int], unit: int, start_parent: bytes | None = None,
                 start_unit: int = 0) -> list[bytes]:
    """Hashes of every full unit of `token_ids`, from unit `start_unit` on (parent given)."""
    if unit <= 0:
        raise ValueError("hash unit must be positive")
    out: list[bytes] = []
    parent = root if start_parent is None else start_parent
    n_full = len(token_ids) // unit
    for j in range(start_unit, n_full):
        parent = unit_hash(parent, token_ids[j * unit:(j + 1) * unit])
        out.append(parent)
    return out


def model_fingerprint(model_dir: str, extra: str = "") -> bytes:
    """A 32-byte identity of a checkpoint: its config plus a sample of every weight file's bytes.

    Hashes the canonical JSON of config.json, then per `*.safetensors` file its name, size and the
    first and last MiB (header, shapes and real weight bytes), so two checkpoints with equal configs
    but different weights (e.g. different seeds) never share cache keys.
    """
    h = hashlib.sha256(b"k3serve/model-fingerprint/v1\0")
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        h.update(json.dumps(json.load(f), sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(os.listdir(model_dir)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(model_dir, name)
        size = os.path.getsize(path)
        h.update(name.encode() + b"\0" + struct.pack("<Q", size))
        with open(path, "rb") as f:
            h.update(f.read(1 << 20))
            if size > (2 << 20):
                f.seek(size - (1 << 20))
                h.update(f.read(1 << 20))
    h.update(extra.encode())
    return h.digest()
