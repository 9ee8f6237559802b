"""The longest *joint* usable store hit at hash-unit precision (design k3-model-and-cache.md §4.3).

A prefix of length p is usable from the store only if every cache group can be rebuilt at p:
* every MLA group has the pages of blocks `start/B .. ceil(p/B)-1`: full blocks under the hash at
  their end, and — when p ends mid-block — the tail page under the hash at some unit p' >= p inside
  that block (a prompt tail page, saved at the boundary it reached);
* every KDA group has a state snapshot keyed at exactly p.
One key per (group, hash) holds all of that group's layer pages as one object (kvstore/keys.py), so
a present key is complete; a KDA snapshot whose MLA pages were evicted never counts, nor MLA pages
without a snapshot at a reachable boundary.

`probe(pairs)` answers, for a list of (group_id, hash), which are present (one batched existence
call per phase). Two phases: MLA full blocks, then the KDA snapshots and MLA tail pages up to one
block past the MLA chain.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

Probe = Callable[[list[tuple[int, bytes]]], list[bool]]


@dataclass
class StoreHit:
    tokens: int = 0  # joint usable prefix length (0: none beyond `start`)
    # what to load: (group, block index, hash of its key) per MLA page, (group, hash) per KDA snapshot
    mla_pages: list[tuple[int, int, bytes]] = field(default_factory=list)
    kda_snapshots: list[tuple[int, bytes]] = field(default_factory=list)
    probed: int = 0  # keys asked about


def find_joint_hit(hashes: Sequence[bytes], *, block_size: int, unit: int, max_len: int, start: int,
                   mla_groups: Sequence[int], kda_groups: Sequence[int], probe: Probe) -> StoreHit:
    """`hashes[i]` is the prefix hash at (i+1)·unit; `start` (a multiple of the block size) is the
    hit already available locally; the result's tokens are > start, or 0."""
    B, u = block_size, unit
    if B % u or start % B:
        raise ValueError("block_size must be a multiple of unit, and start of block_size")
    limit = min(max_len, len(hashes) * u)

    def h(p: int) -> bytes:
        return hashes[p // u - 1]

    out = StoreHit()
    # phase 1: consecutive full MLA blocks after `start`
    nfull = start // B
    if mla_groups:
        ends = list(range(start + B, limit + 1, B))
        pairs = [(g, h(e)) for e in ends for g in mla_groups]
        present = probe(pairs) if pairs else []
        out.probed += len(pairs)
        ng = len(mla_groups)
        for i, _e in enumerate(ends):
            if not all(present[i * ng:(i + 1) * ng]):
                break
            nfull += 1
        reach = min(limit, (nfull + 1) * B)  # a tail page may extend the chain into the next block
    else:
        reach = limit
    # phase 2: KDA snapshots at every unit in (start, reach]; MLA tail pages inside block nfull
    units = list(range(start + u, reach + 1, u))
    tails = [p for p in units if p > nfull * B and p % B] if mla_groups else []
    pairs = [(g, h(p)) for p in units for g in kda_groups] + [(g, h(p)) for p in tails for g in mla_groups]
    present = probe(pairs) if pairs else []
    out.probed += len(pairs)
    nk, nm = len(kda_groups), len(mla_groups)
    kda_at = {p for i, p in enumerate(units) if all(present[i * nk:(i + 1) * nk])} if nk else set(units)
    off = len(units) * nk
    tail_at = [p for i, p in enumerate(tails) if all(present[off + i * nm:off + (i + 1) * nm])]
    mla_reach = max(tail_at, default=nfull * B) if mla_groups else reach
    best = max((p for p in kda_at if p <= mla_reach), default=0)
    if best <= start:
        return out
    out.tokens = best
    for bi in range(start // B, -(-best // B)):
        end = (bi + 1) * B
        if bi < nfull:
            key_p = end
        else:  # the tail page: the smallest saved tail boundary covering `best`
            key_p = min(p for p in tail_at if p >= best)
        out.mla_pages.extend((g, bi, h(key_p)) for g in mla_groups)
    out.kda_snapshots = [(g, h(best)) for g in kda_groups]
    return out
