"""BlockPool: block ids, reference counts, the prefix-cache key map, eviction order, KV events.

The pool knows nothing about cache-group kinds: a block is bytes with a reference count and the
keys it is cached under. Which free cached block is reused first is the eviction scorer's choice
(workers/engine/kv_cache/eviction.py); the scorer sees every key added and dropped.

Block 0 is the null block and is never handed out. Free blocks sit in one ordered queue: unhashed
blocks go to the front when freed (reused first), hashed blocks to the back (LRU order).

Keys are `(hash: bytes, group_id: int)`. A block may carry several keys (an MLA block keyed at a
mid-block prompt boundary and later at its full end); `key_tokens[key]` is the prefix length it
stands for, `key_parent[key]` the parent unit/block hash (what the router's index chains on).
Every key added or dropped is queued as a `CacheEvent` in `events`; the engine drains the queue
once per step (`drain_events`). `on_evict(block)` is called when a cached block is about to be
reused, before its keys are dropped (connectors copy it out: copy-on-evict).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from k3serve.workers.engine.kv_cache.eviction import EvictionScorer, make_scorer

BlockKey = tuple[bytes, int]


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    keys: list[BlockKey] = field(default_factory=list)
    key_tokens: dict[BlockKey, int] = field(default_factory=dict)  # key -> prefix length it stands for
    key_parent: dict[BlockKey, bytes | None] = field(default_factory=dict)  # key -> parent hash
    last_used: int = 0
    cached_step: int = -1  # engine step at which the newest key was registered

    @property
    def is_hashed(self) -> bool:
        return bool(self.keys)


@dataclass(frozen=True)
class CacheEvent:
    """A key added ("stored") or dropped ("removed"); plain data, queued until the step ends."""

    kind: str
    key: BlockKey
    block_id: int
    num_tokens: int
    parent: bytes | None


@dataclass
class PoolStats:
    """Counted by the pool: cached blocks whose keys were dropped to reuse the page, per group."""

    evicted: int = 0
    evicted_by_group: dict[int, int] = field(default_factory=dict)


class NoFreeBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, *, eviction: str | EvictionScorer = "lru", block_size: int = 16,
                 record_events: bool = False):
        if num_blocks < 2:
            raise ValueError("the pool needs at least 2 blocks (block 0 is the null block)")
        self.scorer = make_scorer(eviction) if isinstance(eviction, str) else eviction
        self.eviction = self.scorer.name
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self.cached: dict[BlockKey, Block] = {}
        self.clock = 0
        self.stats = PoolStats()
        self.record_events = record_events
        self.events: list[CacheEvent] = []
        self.on_evict: Callable[[Block], None] | None = None

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_evicted(self) -> int:
        return self.stats.evicted

    def usage(self) -> float:
        """Fraction of blocks referenced by running requests (cached-but-free counts as free)."""
        return 1.0 - self.num_free / self.num_usable

    def lookup(self, key: BlockKey) -> Block | None:
        return self.cached.get(key)

    # -- allocation ----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[Block]:
        if n > len(self.free):
            raise NoFreeBlocks(f"need {n} blocks, {len(self.free)} free")
        out = []
        for _ in range(n):
            b = self.scorer.pick(self)
            del self.free[b.block_id]
            if b.keys:
                if self.on_evict is not None:
                    self.on_evict(b)
                self._drop_keys(b)
            b.ref_cnt = 1
            b.last_used = self._tick()
            out.append(b)
        return out

    def allocate_one(self) -> Block:
        return self.allocate(1)[0]

    def touch(self, blocks: list[Block]) -> None:
        t = self._tick()
        for b in blocks:
            if b.ref_cnt == 0:
                del self.free[b.block_id]
            b.ref_cnt += 1
            b.last_used = t

    def free_blocks(self, blocks: list[Block]) -> None:
        """Drop one reference from each block, in the given order (pass tail-first)."""
        for b in blocks:
            if b.block_id == 0:
                continue
            assert b.ref_cnt > 0, f"double free of block {b.block_id}"
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free[b.block_id] = b
                if not b.keys:
                    self.free.move_to_end(b.block_id, last=False)

    # -- the prefix-cache map ------------------------------------------------------------------
    def register(self, block: Block, key: BlockKey, num_tokens: int, step: int,
                 parent: bytes | None = None) -> bool:
        """Key `block` by `key` (prefix length `num_tokens`). False if the key exists elsewhere."""
        existing = self.cached.get(key)
        if existing is not None:
            return existing is block
        self.cached[key] = block
        block.keys.append(key)
        block.key_tokens[key] = num_tokens
        block.key_parent[key] = parent
        block.cached_step = step
        self.scorer.on_register(block, key, parent)
        if self.record_events:
            self.events.append(CacheEvent("stored", key, block.block_id, num_tokens, parent))
        return True

    def drop_block(self, block: Block) -> None:
        """Forget a block's keys without reusing it (its bytes turned out invalid)."""
        if block.keys:
            self._drop_keys(block, evicted=False)

    def _drop_keys(self, b: Block, evicted: bool = True) -> None:
        if evicted:
            st = self.stats
            st.evicted += 1
            gid = b.keys[0][1]
            st.evicted_by_group[gid] = st.evicted_by_group.get(gid, 0) + 1
        for key in b.keys:
            self.scorer.on_drop(b, key, b.key_parent.get(key))
            if self.cached.get(key) is b:
                del self.cached[key]
                if self.record_events:
                    self.events.append(CacheEvent("removed", key, b.block_id, b.key_tokens.get(key, 0),
                                                  b.key_parent.get(key)))
        b.keys.clear()
        b.key_tokens.clear()
        b.key_parent.clear()

    def drain_events(self) -> list[CacheEvent]:
        out, self.events = self.events, []
        return out

    def _tick(self) -> int:
        self.clock += 1
        return self.clock
