"""Eviction scorers: which free cached block the pool reuses first (pluggable, kind-free).

A scorer sees every key the pool adds (`on_register`) and drops (`on_drop`) and picks a victim
among the free blocks (`pick`). The front of the free queue is an unhashed block when there is one
(reused first by every scorer).

* `LRUScorer` ("lru"): the front of the queue — least recently freed cached block.
* `ComputePerByteScorer` ("compute-per-byte", Marconi-style): among free cached *leaves* (blocks no
  other cached key extends: evicting an inner page would strand every deeper key of its chain),
  the lowest normalised recency + normalised prefill tokens saved. What a block saves is told by
  its groups' roles, given by the coordinator: a block of a *state* group (a KDA snapshot keyed at
  prefix length p) saves p tokens and is always a leaf; a block of a *sequence* group (an MLA page)
  saves the length of a state keyed with the same hash (a snapshot ending inside it), else 0 (a
  dangling chain tail goes first). All pages have the same byte size, so tokens saved is per byte.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from k3serve.workers.engine.kv_cache.block_pool import Block, BlockKey, BlockPool

EVICTION_POLICIES = ("lru", "compute-per-byte")


class EvictionScorer:
    name = "base"

    def pick(self, pool: BlockPool) -> Block:
        return next(iter(pool.free.values()))

    def on_register(self, block: Block, key: BlockKey, parent: bytes | None) -> None:
        pass

    def on_drop(self, block: Block, key: BlockKey, parent: bytes | None) -> None:
        pass


class LRUScorer(EvictionScorer):
    name = "lru"


class ComputePerByteScorer(EvictionScorer):
    name = "compute-per-byte"

    def __init__(self, state_groups: set[int] | None = None):
        self.state_groups: set[int] = set(state_groups or ())
        self.children: dict[BlockKey, int] = {}  # (parent hash, group) -> cached keys extending it
        self.state_hashes: dict[bytes, int] = {}  # hash -> state-group keys holding it

    def set_state_groups(self, groups: set[int]) -> None:
        self.state_groups = set(groups)

    def on_register(self, block, key, parent) -> None:
        if parent is not None:
            pk = (parent, key[1])
            self.children[pk] = self.children.get(pk, 0) + 1
        if key[1] in self.state_groups:
            self.state_hashes[key[0]] = self.state_hashes.get(key[0], 0) + 1

    def on_drop(self, block, key, parent) -> None:
        if parent is not None:
            pk = (parent, key[1])
            if self.children.get(pk, 0) <= 1:
                self.children.pop(pk, None)
            else:
                self.children[pk] -= 1
        if key[1] in self.state_groups:
            if self.state_hashes.get(key[0], 0) <= 1:
                self.state_hashes.pop(key[0], None)
            else:
                self.state_hashes[key[0]] -= 1

    def _is_state(self, b: Block) -> bool:
        return b.keys[0][1] in self.state_groups

    def _is_leaf(self, b: Block) -> bool:
        return self._is_state(b) or all(self.children.get(k, 0) == 0 for k in b.keys)

    def _value(self, b: Block) -> int:
        if self._is_state(b):
            return max(b.key_tokens.values(), default=0)
        best = 0
        for (h, _gid), n in b.key_tokens.items():
            if h in self.state_hashes:
                best = max(best, n)
        return best

    def pick(self, pool: BlockPool) -> Block:
        first = next(iter(pool.free.values()))
        if not first.keys:
            return first
        cands = [b for b in pool.free.values() if b.keys and self._is_leaf(b)]
        if not cands:
            return first
        lo = min(b.last_used for b in cands)
        hi = max(b.last_used for b in cands)
        vals = {b.block_id: self._value(b) for b in cands}
        vmax = max(vals.values()) or 1

        def score(b: Block) -> tuple[float, int]:
            rec = (b.last_used - lo) / (hi - lo) if hi > lo else 1.0
            return rec + vals[b.block_id] / vmax, b.last_used

        return min(cands, key=score)


def make_scorer(name: str) -> EvictionScorer:
    if name == "lru":
        return LRUScorer()
    if name == "compute-per-byte":
        return ComputePerByteScorer()
    raise ValueError(f"prefix_cache_eviction: must be 'lru' or 'compute-per-byte' (got {name!r})")
