"""KV event types shared by the workers (publishers) and the router (the prefix index)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KVEvent:
    """One prefix-cache change, for the router's index (published on the worker's event stream)."""

    kind: str  # "stored" | "removed"
    block_hash: bytes
    parent_hash: bytes | None
    group_id: int
    group_kind: str  # "mla" | "kda"
    num_tokens: int  # prefix length the key stands for (exact for KDA snapshots)
    block_size: int
