"""MLAManager: the MLA (full-attention) cache groups — append-only paged block tables.

Per request and MLA group, one block table covering every computed token. Prefix-cache keys: each
full block at its end (dense), each hash unit inside a block when the unit is smaller than the
block (fine-grained: a hit can end at any unit), and a block at a mid-block KDA snapshot boundary
(so the MLA side reaches the snapshot). Lookup (design doc §3.2): left to right over full blocks,
then a probe of the first missing block at unit precision, deepest first.
"""

from __future__ import annotations

from collections.abc import Callable

from k3serve.workers.engine.cache_layout import CacheGroup
from k3serve.workers.engine.kv_cache.block_pool import Block, BlockPool


class MLAManager:
    def __init__(self, groups: list[CacheGroup], pool: BlockPool, block_size: int, unit: int,
                 hash_at: Callable, enable_caching: bool):
        self.groups = groups
        self.gids = [g.group_id for g in groups]
        self.pool = pool
        self.B = block_size
        self.unit = unit
        self.hash_at = hash_at
        self.enable_caching = enable_caching
        self.on_stored: Callable | None = None  # (request, [(block_id, key, num_tokens, parent)])

    def find_hit(self, req, max_len: int) -> tuple[int, list[list[Block]], list[Block] | None]:
        """(hit tokens, full blocks [block index][group], blocks holding the mid-block hit or None)."""
        B, u, pool, gids = self.B, self.unit, self.pool, self.gids
        full: list[list[Block]] = []
        while (len(full) + 1) * B <= max_len:
            h = self.hash_at(req, (len(full) + 1) * B)
            if h is None:
                break
            blks = [pool.cached.get((h, g)) for g in gids]
            if any(b is None for b in blks):
                break
            full.append(blks)
        hit, partial = len(full) * B, None
        if u < B:
            for k in range(B // u - 1, 0, -1):
                p = len(full) * B + k * u
                h = self.hash_at(req, p) if p <= max_len else None
                if h is None:
                    continue
                blks = [pool.cached.get((h, g)) for g in gids]
                if all(b is not None for b in blks):
                    partial, hit = blks, p
                    break
        return hit, full, partial

    def blocks_needed(self, have: int, end: int) -> int:
        """New blocks per group to cover `end` tokens when `have` blocks are held."""
        return max(0, -(-end // self.B) - have)

    def register(self, req, tables: list[list[Block]], st, start: int, end: int, step: int) -> None:
        """Key the request's computed pages: fine units in (start, end], full blocks up to end."""
        if not self.enable_caching:
            return
        stored = [] if self.on_stored is not None else None
        B, u, pool = self.B, self.unit, self.pool
        if u < B:
            st.registered_units = max(st.registered_units, start // u)
            while (st.registered_units + 1) * u <= end:
                q = (st.registered_units + 1) * u
                st.registered_units += 1
                if q % B == 0:
                    continue  # the full-block key below covers it
                h = self.hash_at(req, q)
                if h is None:
                    break
                parent = self.hash_at(req, (q - 1) // B * B)
                for blks, g in zip(tables, self.gids):
                    if pool.register(blks[(q - 1) // B], (h, g), q, step, parent) and stored is not None:
                        stored.append((blks[(q - 1) // B].block_id, (h, g), q, parent))
        if st.loading:
            return  # pages past the local hit are keyed once the connector's load is confirmed
        while (st.registered_full + 1) * B <= end:
            i = st.registered_full
            h = self.hash_at(req, (i + 1) * B)
            if h is None:
                break
            parent = self.hash_at(req, i * B)
            for blks, g in zip(tables, self.gids):
                if pool.register(blks[i], (h, g), (i + 1) * B, step, parent) and stored is not None:
                    stored.append((blks[i].block_id, (h, g), (i + 1) * B, parent))
            st.registered_full += 1
        if stored:
            self.on_stored(req, stored)

    def register_boundary(self, req, tables: list[list[Block]], p: int, h: bytes, step: int) -> None:
        """Key the page holding position p-1 at the mid-block boundary p (a KDA snapshot's)."""
        parent = self.hash_at(req, (p - 1) // self.B * self.B)
        for blks, g in zip(tables, self.gids):
            self.pool.register(blks[(p - 1) // self.B], (h, g), p, step, parent)
