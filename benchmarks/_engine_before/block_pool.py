"""BlockPool: block ids, reference counts, the prefix-cache key map, and eviction order.

Block 0 is the null block and is never handed out. Free blocks sit in one ordered queue; the
front is evicted first. Unhashed blocks go to the front when freed (reused first); hashed blocks
go to the back (LRU among cached content). With `eviction="compute-per-byte"` the victim among
free cached blocks is instead the one with the lowest Marconi-style score: normalised recency
plus normalised compute saved per byte held (a KDA snapshot keyed at prefix length p saves p
tokens of prefill; an MLA page saves its block's tokens).

Keys are `(hash: bytes, group_id: int)`. A block may carry several keys (an MLA block can be
keyed at a mid-block prompt boundary and later at its full end); a KDA state block carries
exactly one key, whose `num_tokens` says which prefix length the state represents.
Every key added or dropped is reported to `event_sink(kind, key, block, num_tokens)` for the
router's prefix index (kind "stored" | "removed").
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

BlockKey = tuple[bytes, int]


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    keys: list[BlockKey] = field(default_factory=list)
    key_tokens: dict[BlockKey, int] = field(default_factory=dict)  # key -> prefix length it stands for
    key_parent: dict[BlockKey, bytes | None] = field(default_factory=dict)  # key -> parent unit/block hash
    last_used: int = 0
    cached_step: int = -1  # engine step at which the newest key was registered
    kind: str = ""  # "mla" | "kda" while it holds cached content

    @property
    def is_hashed(self) -> bool:
        return bool(self.keys)


class NoFreeBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, *, eviction: str = "lru", block_size: int = 16,
                 event_sink: Callable[[str, BlockKey, Block, int], None] | None = None):
        if eviction not in ("lru", "compute-per-byte"):
            raise ValueError(f"prefix_cache_eviction: must be 'lru' or 'compute-per-byte' (got {eviction!r})")
        if num_blocks < 2:
            raise ValueError("the pool needs at least 2 blocks (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.eviction = eviction
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self.cached: dict[BlockKey, Block] = {}
        self.event_sink = event_sink
        self.clock = 0
        self.num_evicted_kda = 0
        self.num_evicted = 0  # cached blocks whose keys were dropped to reuse the page
        self.children: dict[BlockKey, int] = {}  # (parent hash, group) -> cached keys extending it
        self.kda_hashes: dict[bytes, int] = {}  # hash -> number of KDA groups holding a snapshot of it

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

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
            b = self._pick_victim()
            del self.free[b.block_id]
            self._drop_keys(b)
            b.ref_cnt = 1
            b.last_used = self._tick()
            out.append(b)
        return out

    def _pick_victim(self) -> Block:
        first = next(iter(self.free.values()))
        if self.eviction == "lru" or not first.is_hashed:
            return first
        # Only leaves are candidates: a KDA snapshot, or an MLA page no other cached page extends
        # (evicting an inner MLA page would strand every deeper key of its chain).
        cands = [b for b in self.free.values() if b.is_hashed and self._is_leaf(b)]
        if not cands:
            return first
        lo = min(b.last_used for b in cands)
        hi = max(b.last_used for b in cands)
        vmax = max(self._value(b) for b in cands) or 1

        def score(b: Block) -> float:
            rec = (b.last_used - lo) / (hi - lo) if hi > lo else 1.0
            return rec + self._value(b) / vmax

        return min(cands, key=lambda b: (score(b), b.last_used))

    def _is_leaf(self, b: Block) -> bool:
        return b.kind == "kda" or all(self.children.get(k, 0) == 0 for k in b.keys)

    def _value(self, b: Block) -> int:
        """Prefill tokens a cached page saves (pages all have the same byte size).

        A KDA snapshot at prefix length p saves p tokens. An MLA leaf page only saves anything
        together with a KDA snapshot ending inside it (same hash in a KDA group): it is worth that
        snapshot's length, and 0 when nothing depends on it (a dangling chain tail goes first).
        """
        if b.kind == "kda":
            return max(b.key_tokens.values(), default=0)
        best = 0
        for (h, _gid), n in b.key_tokens.items():
            if h in self.kda_hashes:
                best = max(best, n)
        return best

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
                if not b.is_hashed:
                    self.free.move_to_end(b.block_id, last=False)

    # -- the prefix-cache map ------------------------------------------------------------------
    def register(self, block: Block, key: BlockKey, num_tokens: int, kind: str, step: int,
                 parent: bytes | None = None) -> bool:
        """Key `block` by `key` (prefix length `num_tokens`). False if the key exists elsewhere."""
        existing = self.cached.get(key)
        if existing is not None:
            return existing is block
        self.cached[key] = block
        block.keys.append(key)
        block.key_tokens[key] = num_tokens
        block.key_parent[key] = parent
        block.kind = kind
        if parent is not None:
            pk = (parent, key[1])
            self.children[pk] = self.children.get(pk, 0) + 1
        if kind == "kda":
            self.kda_hashes[key[0]] = self.kda_hashes.get(key[0], 0) + 1
        block.cached_step = step
        if self.event_sink:
            self.event_sink("stored", key, block, num_tokens)
        return True

    def _drop_keys(self, b: Block) -> None:
        if not b.keys:
            return
        self.num_evicted += 1
        if b.kind == "kda":
            self.num_evicted_kda += 1
        for key in b.keys:
            parent = b.key_parent.get(key)
            if parent is not None:
                pk = (parent, key[1])
                if self.children.get(pk, 0) <= 1:
                    self.children.pop(pk, None)
                else:
                    self.children[pk] -= 1
            if b.kind == "kda":
                if self.kda_hashes.get(key[0], 0) <= 1:
                    self.kda_hashes.pop(key[0], None)
                else:
                    self.kda_hashes[key[0]] -= 1
            if self.cached.get(key) is b:
                del self.cached[key]
                if self.event_sink:
                    self.event_sink("removed", key, b, b.key_tokens.get(key, 0))
        b.keys.clear()
        b.key_tokens.clear()
        b.key_parent.clear()
        b.kind = ""

    def _tick(self) -> int:
        self.clock += 1
        return self.clock
