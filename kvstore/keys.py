"""Store keys: which worker's bytes may be loaded by which other worker.

    k3/v1/<model>/<geometry>/tp<rank>of<size>/<salt>/g<group>/<prefix hash>

* `model`: the first 16 hex digits of the model fingerprint (k3serve/common/block_hash.py:
  config plus sampled weight bytes), so two checkpoints never share entries;
* `geometry`: 16 hex digits of a digest of everything that fixes the bytes of one object — block
  size, hash unit, page bytes, layers per group, each group's kind and layer ids, dtypes, the MLA
  token width, the KDA conv and state shapes and their offsets inside a page. Pools whose geometry
  differs (another dtype, block size, TP degree or layer grouping) get disjoint keys and never load
  each other's pages;
* `tp<rank>of<size>`: the tensor-parallel shard the bytes belong to;
* `salt`: 16 hex digits of a digest of `cache_salt` ("-" without one). The salt itself is never
  written; the prefix hash already depends on it (its chain root), the tag makes entries of one salt
  removable together (`remove_by_regex`);
* `g<group>`: the cache group (one MLA group's pages, or one KDA group's state snapshot);
* `prefix hash`: the 64 hex digits of the chained hash of the prefix the object stands for: an MLA
  page at the end of its tokens (the block end, or the hash unit where a prompt's tail page stops),
  a KDA snapshot at the exact boundary it was exported at.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

KEY_VERSION = "k3/v1"


def geometry_id(layout) -> str:
    """Digest of a CacheLayout's byte geometry (workers/engine/cache_layout.py)."""
    doc = {
        "block_size": layout.block_size, "page_bytes": layout.page_bytes, "group_size": layout.group_size,
        "groups": [[g.group_id, g.kind, list(g.layer_ids)] for g in layout.groups],
        "mla": [layout.mla_token_elems, str(layout.mla_dtype), layout.mla_page_used],
        "kda": [layout.conv_channels, layout.conv_width, str(layout.conv_dtype), list(layout.ssm_shape),
                str(layout.ssm_dtype), layout.conv_bytes, layout.ssm_offset, layout.ssm_bytes],
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def salt_tag(cache_salt: str | None) -> str:
    if not cache_salt:
        return "-"
    return hashlib.sha256(b"k3serve/kvstore-salt/v1\0" + cache_salt.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class KeySpace:
    """The fixed part of a worker's keys; `key(salt, group, hash)` completes one."""

    model: str
    geometry: str
    tp_rank: int = 0
    tp_size: int = 1

    @classmethod
    def for_engine(cls, model_fingerprint: bytes, layout, hash_unit: int, tp_rank: int = 0,
                   tp_size: int = 1) -> KeySpace:
        geo = hashlib.sha256(f"{geometry_id(layout)}/unit{hash_unit}".encode()).hexdigest()[:16]
        return cls(model_fingerprint.hex()[:16], geo, tp_rank, tp_size)

    @property
    def prefix(self) -> str:
        return f"{KEY_VERSION}/{self.model}/{self.geometry}/tp{self.tp_rank}of{self.tp_size}"

    def key(self, cache_salt: str | None, group_id: int, prefix_hash: bytes) -> str:
        return f"{self.prefix}/{salt_tag(cache_salt)}/g{group_id}/{prefix_hash.hex()}"
