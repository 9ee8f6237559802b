"""Routing policies: pick the worker for a request (the names of operator/crd.py's `router.policy`).

    policy = make_policy("hybrid-prefix", weights=Weights())
    choice = policy.choose(candidates, hits, prompt_len)     # Choice(worker, hit, reason)

* `hybrid-prefix` (default): cost = prefill_weight · (prompt − usable hit) + load_weight · load, where the
  usable hit is min(MLA hit, deepest KDA snapshot at or below it) (router/prefix_index.py) and load is
  the prefill work the router already queued there (the uncached prompt tokens of its requests that have
  not produced a first token yet) plus `request_tokens` per running or waiting request. Lowest cost wins; ties go to the lower load, then round-robin.
* `prefix`: the same cost with the attention-only (MLA) hit — what today's routers score; the baseline
  that over-predicts reuse on a hybrid model.
* `least-loaded`: the lowest load; `round-robin`; `random`.
"""

from __future__ import annotations

import itertools
import random as _random
from dataclasses import dataclass

from k3serve.router.prefix_index import Hit

POLICIES = ("hybrid-prefix", "prefix", "least-loaded", "round-robin", "random")


@dataclass
class Weights:
    prefill_weight: float = 1.0  # per uncached prompt token
    load_weight: float = 1.0  # per token of load
    request_tokens: int = 32  # load of one running/waiting request, in prefill-token equivalents


@dataclass
class Choice:
    worker: object
    hit: Hit
    reason: str  # prefix-hit | load | round-robin | random | only


def load_of(w, weights: Weights) -> float:
    running = max(w.inflight, int(w.load.get("running", 0))) + int(w.load.get("waiting", 0))
    return w.inflight_tokens + weights.request_tokens * running


class Policy:
    name = ""
    uses_hits = False

    def __init__(self, weights: Weights | None = None, seed: int | None = None):
        self.weights = weights or Weights()
        self._rr = itertools.count()
        self._rng = _random.Random(seed)

    def choose(self, candidates: list, hits: dict[int, Hit], prompt_len: int) -> Choice:
        if len(candidates) == 1:
            w = candidates[0]
            return Choice(w, hits.get(w.slot, Hit(0, 0)), "only")
        return self._choose(candidates, hits, prompt_len)

    def _choose(self, candidates, hits, prompt_len) -> Choice:  # pragma: no cover - abstract
        raise NotImplementedError


class _CostPolicy(Policy):
    uses_hits = True
    attr = "usable"

    def _choose(self, candidates, hits, prompt_len):
        wt = self.weights
        rr = next(self._rr)
        best = None
        min_load = min(load_of(w, wt) for w in candidates)
        for i, w in enumerate(candidates):
            hit = hits.get(w.slot, Hit(0, 0))
            reuse = getattr(hit, self.attr)
            load = load_of(w, wt)
            key = (wt.prefill_weight * (prompt_len - reuse) + wt.load_weight * load, load,
                   (i - rr) % len(candidates))
            if best is None or key < best[0]:
                best = (key, w, hit, reuse, load)
        _, w, hit, reuse, load = best
        reason = "prefix-hit" if reuse > 0 else ("load" if load > min_load or min_load > 0 else "round-robin")
        return Choice(w, hit, reason)


class HybridPrefix(_CostPolicy):
    name = "hybrid-prefix"
    attr = "usable"


class AttentionPrefix(_CostPolicy):
    name = "prefix"
    attr = "mla"


class LeastLoaded(Policy):
    name = "least-loaded"

    def _choose(self, candidates, hits, prompt_len):
        rr = next(self._rr)
        n = len(candidates)
        i, w = min(enumerate(candidates), key=lambda iw: (load_of(iw[1], self.weights), (iw[0] - rr) % n))
        return Choice(w, hits.get(w.slot, Hit(0, 0)), "load")


class RoundRobin(Policy):
    name = "round-robin"

    def _choose(self, candidates, hits, prompt_len):
        w = sorted(candidates, key=lambda c: c.address)[next(self._rr) % len(candidates)]
        return Choice(w, hits.get(w.slot, Hit(0, 0)), "round-robin")


class Random(Policy):
    name = "random"

    def _choose(self, candidates, hits, prompt_len):
        w = self._rng.choice(candidates)
        return Choice(w, hits.get(w.slot, Hit(0, 0)), "random")


_BY_NAME = {c.name: c for c in (HybridPrefix, AttentionPrefix, LeastLoaded, RoundRobin, Random)}


def make_policy(name: str, weights: Weights | None = None, seed: int | None = None) -> Policy:
    try:
        return _BY_NAME[name](weights, seed)
    except KeyError:
        raise ValueError(f"unknown policy {name!r} (one of {', '.join(POLICIES)})") from None
