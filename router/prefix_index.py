"""The router's prefix index: every worker's prefix cache, rebuilt from its KV event stream.

    index = PrefixIndex()
    slot = index.add_worker("w0")
    index.apply(slot, kv_event_batch)          # KvEventGap -> drop and re-subscribe (index.reset(slot))
    hits = index.predict(unit_hashes, prompt_len, unit, slots)   # {slot: Hit(usable, mla)}

Worker-side rules mirrored here (workers/engine/kv_cache_manager.py `find_hit`): with block size B and
hash unit u, the MLA hit is the run of consecutive full blocks present in every MLA group, never reaching
the prompt's last token, plus (u < B) the deepest unit boundary inside the first missing block that is
keyed; the KDA hit is the deepest unit boundary at or below the MLA hit whose snapshot is present in
every KDA group. The usable hit is min(MLA, KDA) = the KDA hit when the worker has KDA groups.

Message numbering follows worker.proto (the same rules as `k3serve/kv_events/index.py: KvEventIndex`):
a snapshot starts a fresh view; a live batch must continue the sequence, else `KvEventGap`.

Layout for speed (a decision is O(prompt units) dictionary lookups, whatever the number of workers):
one global `hash -> bitmask of workers` per group kind, where a worker's bit is set iff it holds that
hash in all of its groups of that kind; per worker `hash -> bitmask of its group ids present`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3serve.kv_events.index import KvEventGap

__all__ = ["Hit", "KvEventGap", "PrefixIndex"]

_STORED, _REMOVED = 1, 2  # worker.proto KvEvent.Kind


@dataclass
class Hit:
    usable: int  # tokens the worker can really skip: min(MLA hit, deepest KDA snapshot at or below it)
    mla: int  # the attention-only hit (what an attention-only router would predict)
    store: int = 0  # the part of `usable` beyond the worker's own cache that the Mooncake store supplies


@dataclass
class _View:
    name: str
    have: dict[bytes, int] = field(default_factory=dict)  # hash -> bitmask of group ids present
    group_kind: dict[int, str] = field(default_factory=dict)  # group id -> "mla" | "kda"
    kind_mask: dict[str, int] = field(default_factory=lambda: {"mla": 0, "kda": 0})
    block_size: int = 0
    instance_id: str | None = None
    last_sequence: int | None = None  # None until a snapshot started
    complete: bool = False
    events_applied: int = 0


class PrefixIndex:
    def __init__(self) -> None:
        self._views: dict[int, _View] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._masks: dict[str, dict[bytes, int]] = {"mla": {}, "kda": {}}

    # -- workers -------------------------------------------------------------------------------
    def add_worker(self, name: str) -> int:
        slot = self._free_slots.pop() if self._free_slots else self._next_slot
        if slot == self._next_slot:
            self._next_slot += 1
        self._views[slot] = _View(name)
        return slot

    def remove_worker(self, slot: int) -> None:
        self.reset(slot)
        del self._views[slot]
        self._free_slots.append(slot)

    def reset(self, slot: int) -> None:
        """Forget what `slot` holds (before a re-subscription: the next snapshot rebuilds it)."""
        v = self._views[slot]
        for h in list(v.have):
            self._set(slot, v, h, 0)
        self._views[slot] = _View(v.name)

    def ready(self, slot: int) -> bool:
        v = self._views.get(slot)
        return v is not None and v.complete

    def block_size(self, slot: int) -> int:
        return self._views[slot].block_size

    def last_sequence(self, slot: int) -> int | None:
        return self._views[slot].last_sequence

    def keys(self, slot: int) -> set[tuple[bytes, int]]:
        """The (block_hash, group_id) keys `slot` holds (tests compare them with the worker's cache)."""
        out = set()
        for h, gm in self._views[slot].have.items():
            g = 0
            while gm:
                if gm & 1:
                    out.add((h, g))
                gm >>= 1
                g += 1
        return out

    def num_keys(self, slot: int) -> int:
        return sum(bin(gm).count("1") for gm in self._views[slot].have.values())

    # -- events --------------------------------------------------------------------------------
    def apply(self, slot: int, msg) -> None:
        """Apply one `KvEventBatch` message of the worker in `slot`."""
        v = self._views[slot]
        if msg.snapshot:
            if v.last_sequence is None or v.complete or msg.instance_id != v.instance_id:
                if v.have:
                    self.reset(slot)
                    v = self._views[slot]
                v.complete = False
            elif msg.sequence != v.last_sequence:
                raise KvEventGap(f"snapshot chunk with sequence {msg.sequence} inside snapshot {v.last_sequence}")
            v.instance_id = msg.instance_id
            v.last_sequence = msg.sequence
            self._events(slot, v, msg.events)
            v.complete = msg.snapshot_complete
            return
        if v.last_sequence is None or not v.complete:
            raise KvEventGap("live batch before a complete snapshot")
        if msg.instance_id != v.instance_id:
            raise KvEventGap(f"worker instance changed ({v.instance_id} -> {msg.instance_id})")
        if msg.sequence - len(msg.events) != v.last_sequence:
            raise KvEventGap(f"expected events after {v.last_sequence}, got "
                             f"{msg.sequence - len(msg.events) + 1}..{msg.sequence}")
        self._events(slot, v, msg.events)
        v.last_sequence = msg.sequence

    def _events(self, slot: int, v: _View, events) -> None:
        for e in events:
            gid = e.group_id
            kind = v.group_kind.get(gid)
            if kind is None:
                kind = v.group_kind[gid] = e.group_kind
                v.kind_mask[kind] = v.kind_mask.get(kind, 0) | (1 << gid)
                self._refresh_kind(slot, v, kind)
            if e.block_size:
                v.block_size = e.block_size
            h = bytes(e.block_hash)
            gm = v.have.get(h, 0)
            if e.kind == _STORED:
                new = gm | (1 << gid)
            elif e.kind == _REMOVED:
                new = gm & ~(1 << gid)
            else:
                raise ValueError(f"KV event kind {e.kind} is not STORED or REMOVED")
            if new != gm:
                self._set(slot, v, h, new)
            v.events_applied += 1

    def _set(self, slot: int, v: _View, h: bytes, gm: int) -> None:
        if gm:
            v.have[h] = gm
        else:
            v.have.pop(h, None)
        bit = 1 << slot
        for kind, km in v.kind_mask.items():
            if not km:
                continue
            masks = self._masks.setdefault(kind, {})
            cur = masks.get(h, 0)
            new = (cur | bit) if (gm & km) == km else (cur & ~bit)
            if new != cur:
                if new:
                    masks[h] = new
                else:
                    del masks[h]

    def _refresh_kind(self, slot: int, v: _View, kind: str) -> None:
        # a group of this kind appeared: a hash is complete only if present in it too
        for h, gm in v.have.items():
            self._set(slot, v, h, gm)

    # -- prediction ----------------------------------------------------------------------------
    def predict(self, hashes: list[bytes], prompt_len: int, unit: int, slots: list[int]) -> dict[int, Hit]:
        """The hit each worker in `slots` would find for a prompt of `prompt_len` tokens whose unit hashes
        (hash at (i+1)*unit = hashes[i], `k3serve/common/block_hash.py`) are `hashes`."""
        out: dict[int, Hit] = {}
        by_block: dict[int, int] = {}
        for s in slots:
            v = self._views.get(s)
            if v is None or not v.complete or not v.block_size or v.block_size % unit:
                out[s] = Hit(0, 0)
                continue
            by_block[v.block_size] = by_block.get(v.block_size, 0) | (1 << s)
        for B, group in by_block.items():
            out.update(self._predict_group(hashes, prompt_len, unit, B, group))
        return out

    def _predict_group(self, hashes, prompt_len, u, B, group) -> dict[int, Hit]:
        mla_masks, kda_masks = self._masks["mla"], self._masks["kda"]
        max_len = prompt_len - 1
        nh = len(hashes)
        mla_hit: dict[int, int] = {}
        # workers without MLA groups: hit limited only by the hashes
        has_mla = 0
        for s in _bits(group):
            if self._views[s].kind_mask.get("mla"):
                has_mla |= 1 << s
            else:
                mla_hit[s] = min(max_len // u, nh) * u
        alive, j = has_mla, 1
        step = B // u
        while alive and j * B <= max_len and j * step <= nh:
            m = mla_masks.get(hashes[j * step - 1], 0) & alive
            for s in _bits(alive & ~m):
                mla_hit[s] = (j - 1) * B
            alive = m
            j += 1
        for s in _bits(alive):
            mla_hit[s] = (j - 1) * B
        if u < B:  # mid-block probe of the first missing block
            by_full: dict[int, int] = {}
            for s, full in mla_hit.items():
                if (has_mla >> s) & 1:
                    by_full[full] = by_full.get(full, 0) | (1 << s)
            for full, ws in by_full.items():
                for k in range(B // u - 1, 0, -1):
                    p = full + k * u
                    if not ws or p > max_len or p // u > nh:
                        continue
                    m = mla_masks.get(hashes[p // u - 1], 0) & ws
                    for s in _bits(m):
                        mla_hit[s] = p
                    ws &= ~m
        # KDA: deepest snapshot at or below each worker's MLA hit
        usable: dict[int, int] = {}
        pending: dict[int, int] = {}  # position -> workers whose search starts there
        for s, mh in mla_hit.items():
            if self._views[s].kind_mask.get("kda"):
                p = (mh // u) * u
                if p >= u:
                    pending[p] = pending.get(p, 0) | (1 << s)
                else:
                    usable[s] = 0
            else:
                usable[s] = mh
        if pending:
            active = 0
            p = max(pending)
            while p >= u:
                active |= pending.get(p, 0)
                if active:
                    m = kda_masks.get(hashes[p // u - 1], 0) & active
                    if m:
                        for s in _bits(m):
                            usable[s] = p
                        active &= ~m
                p -= u
            for s in _bits(active):
                usable[s] = 0
        return {s: Hit(min(usable.get(s, 0), mla_hit[s]), mla_hit[s]) for s in mla_hit}


def _bits(mask: int):
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low
