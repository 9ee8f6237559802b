"""Test helper (not a test module): FakeEngine with a scripted prefix cache that emits KV events
like LLMEngine (`subscribe_kv_events`, `kv_cache_snapshot`), for the KV-event stream tests."""

from __future__ import annotations

import hashlib
import random

import _serve_fakes as fakes

from k3serve.kv_events.types import KVEvent

BLOCK = 16
GROUPS = ((0, "mla"), (1, "kda"))


class CacheFake(fakes.FakeEngine):
    """Each step (and each `mutate(n)`) stores or removes random keys and reports every change to the
    listeners on the calling (engine) thread. `cached`: key (hash, group_id) -> KVEvent."""

    def __init__(self, tokenizer, *, seed: int = 0, changes_per_step: tuple[int, int] = (0, 6), **kw):
        super().__init__(tokenizer, **kw)
        self.rng = random.Random(seed)
        self.changes_per_step = changes_per_step
        self.cached: dict[tuple[bytes, int], KVEvent] = {}
        self.listeners: list = []
        self.num_events = 0
        self._keys: list[tuple[bytes, int]] = []  # the keys of `cached`, for O(1) random removal
        self._n = 0

    def subscribe_kv_events(self, fn):
        self.listeners.append(fn)
        return lambda: self.listeners.remove(fn) if fn in self.listeners else None

    def kv_cache_snapshot(self) -> list[KVEvent]:
        return [KVEvent("stored", e.block_hash, e.parent_hash, e.group_id, e.group_kind, e.num_tokens, e.block_size)
                for e in self.cached.values()]

    def _emit(self, ev: KVEvent) -> None:
        self.num_events += 1
        for fn in list(self.listeners):
            fn(ev)

    def mutate(self, n: int) -> None:
        for _ in range(n):
            if self._keys and self.rng.random() < 0.4:
                i = self.rng.randrange(len(self._keys))
                self._keys[i], self._keys[-1] = self._keys[-1], self._keys[i]
                old = self.cached.pop(self._keys.pop())
                self._emit(KVEvent("removed", old.block_hash, old.parent_hash, old.group_id, old.group_kind,
                                   old.num_tokens, old.block_size))
            else:
                self._n += 1
                gid, kind = GROUPS[self._n % 2]
                h = hashlib.sha256(str(self._n).encode()).digest()
                parent = None if self._n % 3 == 0 else hashlib.sha256(str(self._n - 1).encode()).digest()
                ev = KVEvent("stored", h, parent, gid, kind, 8 * self.rng.randint(1, 20), BLOCK)
                self.cached[(h, gid)] = ev
                self._keys.append((h, gid))
                self._emit(ev)

    def step(self):
        outs = super().step()
        self.mutate(self.rng.randint(*self.changes_per_step))
        return outs

    def cache_tokens(self) -> dict[tuple[bytes, int], int]:
        return {k: e.num_tokens for k, e in self.cached.items()}
