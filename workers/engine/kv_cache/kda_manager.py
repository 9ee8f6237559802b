"""KDAManager: the KDA (linear-attention) cache groups — request state and prefix snapshots.

Per request and KDA group, one private *running* state block (conv window + recurrent state after
`num_computed_tokens`), updated in place. Snapshots for the prefix cache are never the running
block: the state at a retained boundary p is exported during the forward pass that crosses p (the
KDA ops' checkpoint arguments) into a fresh block keyed at exactly p. So a retained snapshot is
never extended in place (copy-before-extend), and a chunk is never split at a cacheable boundary.

Retention (which boundaries get snapshots):
* `0`: the prompt's replay boundary floor((prefill_end - 1) / unit) · unit, plus the Marconi
  junction when `selective` is on;
* `N`: also every multiple of N tokens;
* `"dense"`: also every block boundary.
With `selective` (Marconi, "cache on second hit"), a request whose MLA hit exceeds its KDA hit by
at least a unit records the junction (the MLA-reached boundary) and snapshots there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from k3serve.workers.engine.cache_layout import CacheGroup
from k3serve.workers.engine.kv_cache.block_pool import Block, BlockPool


@dataclass
class SnapshotStats:
    """Counted by the KDA manager: boundaries exported into the prefix cache."""

    stored: int = 0


class KDAManager:
    def __init__(self, groups: list[CacheGroup], pool: BlockPool, block_size: int, unit: int,
                 hash_at: Callable, enable_caching: bool, retention: int | str, selective: bool):
        self.groups = groups
        self.gids = [g.group_id for g in groups]
        self.pool = pool
        self.B = block_size
        self.unit = unit
        self.hash_at = hash_at
        self.enable_caching = enable_caching
        self.retention = retention
        self.selective = selective
        self.stats = SnapshotStats()
        self._step = block_size if retention == "dense" else retention

    def find_hit(self, req, upto: int) -> tuple[int, list[Block] | None]:
        """Deepest snapshot at or below `upto` present in every KDA group: (tokens, blocks)."""
        u, cached, gids = self.unit, self.pool.cached, self.gids
        p = (upto // u) * u
        while p >= u:
            h = self.hash_at(req, p)
            if h is not None:
                blks = [cached.get((h, g)) for g in gids]
                if all(b is not None and b.key_tokens.get((h, g)) == p for b, g in zip(blks, gids)):
                    return p, blks
            p -= u
        return 0, None

    def set_retained_boundaries(self, req, junction: int) -> None:
        req.retained_boundaries = set()
        if not self.enable_caching:
            return
        u = self.unit
        replay = (req.prefill_end - 1) // u * u
        if replay > 0:
            req.retained_boundaries.add(replay)
        if junction > 0:
            req.shared_prefix_boundary = junction
            req.retained_boundaries.add(junction)

    def checkpoint_positions(self, req, start: int, end: int) -> list[int]:
        """Boundaries in (start, end] to export this step (not already held by someone)."""
        if not self.enable_caching:
            return []
        step = self._step
        if end - start == 1 and end not in req.retained_boundaries and not (step and end % step == 0):
            return []  # the decode fast path: one token crossing no boundary
        ps = {p for p in req.retained_boundaries if start < p <= end}
        if step:
            first = (start // step + 1) * step
            ps.update(range(first, end + 1, step))
        out = []
        cached = self.pool.cached
        for p in sorted(ps):
            h = self.hash_at(req, p)
            if h is None:
                continue
            if all((h, g) in cached for g in self.gids):
                continue  # someone already holds this snapshot
            out.append(p)
        return out

    def export(self, req, p: int, step: int) -> tuple[list[Block], bytes, bytes | None]:
        """Allocate and key one snapshot block per KDA group at boundary p (filled in-pass)."""
        snap = self.pool.allocate(len(self.gids))
        h = self.hash_at(req, p)
        parent = self.hash_at(req, p - self.unit)
        for b, g in zip(snap, self.gids):
            self.pool.register(b, (h, g), p, step, parent)
        self.stats.stored += 1
        return snap, h, parent
