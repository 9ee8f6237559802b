"""Routing decision latency of the router's prefix index: 64 workers x 100k indexed blocks (issue target: p99 <= 1 ms).

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/router_decision.py [--workers 64] [--blocks 100000]

Builds a PrefixIndex (router/prefix_index.py) as the workers' KV events would: every worker caches 200
documents of 500 blocks (block 16 tokens, hash unit 16), drawn from a shared pool so that workers overlap,
with a KDA snapshot every 4 blocks. Then times `decide()` = usable-hit prediction for all 64 workers +
the hybrid-prefix policy's choice, for prompts that follow a cached document to a random depth and then
diverge (up to 8k tokens). Prints p50/p90/p99 in microseconds, and separately the cost of hashing the
prompt (k3serve/common/block_hash.py), which the router does once per request. The baseline in the same
run is the obvious implementation: per worker, walk the prompt's blocks in that worker's own dict.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from k3serve.common.block_hash import chain_hashes, root_hash  # noqa: E402
from k3serve.router.policy import Weights, make_policy  # noqa: E402
from k3serve.router.prefix_index import PrefixIndex  # noqa: E402

B = 16


class _Ev:
    __slots__ = ("kind", "block_hash", "group_id", "group_kind", "block_size")

    def __init__(self, h, gid, gkind):
        self.kind, self.block_hash, self.group_id, self.group_kind, self.block_size = 1, h, gid, gkind, B


def _pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p / 100))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=100_000, help="indexed MLA blocks per worker")
    ap.add_argument("--doc-blocks", type=int, default=500)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    docs_per_worker = max(1, a.blocks // a.doc_blocks)
    pool = docs_per_worker * 4  # each document is cached by ~1/4 of... shared across workers
    t0 = time.perf_counter()
    docs = [[rng.randbytes(32) for _ in range(a.doc_blocks)] for _ in range(pool)]
    index = PrefixIndex()
    slots, held = [], []
    for w in range(a.workers):
        s = index.add_worker(f"w{w}")
        view = index._views[s]
        mine = rng.sample(range(pool), docs_per_worker)
        evs = []
        for d in mine:
            for j, h in enumerate(docs[d]):
                evs.append(_Ev(h, 0, "mla"))
                if j % 4 == 3:
                    evs.append(_Ev(h, 1, "kda"))
        index._events(s, view, evs)
        view.complete, view.last_sequence, view.instance_id = True, 0, "bench"
        slots.append(s)
        held.append(mine)
    build_s = time.perf_counter() - t0
    keys = sum(index.num_keys(s) for s in slots)
    workers = [SimpleNamespace(slot=s, address=f"w{s}", inflight=rng.randint(0, 4), inflight_tokens=0, load={})
               for s in slots]
    policy = make_policy("hybrid-prefix", Weights())

    reqs = []
    for _ in range(a.requests):
        w = rng.randrange(a.workers)
        d = docs[rng.choice(held[w])]
        depth = rng.randint(1, a.doc_blocks)
        hashes = d[:depth] + [rng.randbytes(32) for _ in range(rng.randint(0, 8))]
        reqs.append(hashes)
    import gc

    gc.collect()
    gc.freeze()  # the index is long-lived: keep it out of the collector's generations (the router does the same)
    times, base = [], []
    views = [index._views[s] for s in slots]
    for hashes in reqs:
        n = len(hashes) * B + 1
        t = time.perf_counter()
        hits = index.predict(hashes, n, B, slots)
        policy.choose(workers, hits, n)
        times.append(time.perf_counter() - t)
        # baseline: per worker, its own dict, block by block (then the KDA walk down)
        t = time.perf_counter()
        best = None
        for v in views:
            m = 0
            while m < len(hashes) and v.have.get(hashes[m], 0) & 1:
                m += 1
            k = m
            while k > 0 and not (v.have.get(hashes[k - 1], 0) & 2):
                k -= 1
            if best is None or k > best:
                best = k
        base.append(time.perf_counter() - t)
    tok = [rng.randrange(500) for _ in range(8192)]
    root = root_hash(b"\0" * 32)
    t = time.perf_counter()
    for _ in range(20):
        chain_hashes(root, tok, B)
    hash_ms = (time.perf_counter() - t) / 20 * 1000
    us = 1e6
    print(f"index: {a.workers} workers x {a.blocks} MLA blocks (+ KDA every 4): {keys} keys, built in {build_s:.1f}s")
    print(f"decision (predict all workers + hybrid-prefix choice), {a.requests} prompts up to "
          f"{a.doc_blocks * B} tokens:")
    print(f"  ours:     p50 {_pct(times, 50) * us:7.1f} us  p90 {_pct(times, 90) * us:7.1f} us  "
          f"p99 {_pct(times, 99) * us:7.1f} us")
    print(f"  baseline: p50 {_pct(base, 50) * us:7.1f} us  p90 {_pct(base, 90) * us:7.1f} us  "
          f"p99 {_pct(base, 99) * us:7.1f} us  (per-worker dict walk)")
    print(f"  ratio baseline/ours at p99: {_pct(base, 99) / _pct(times, 99):.1f}x")
    print(f"hashing an 8192-token prompt (unit {B}): {hash_ms:.2f} ms (once per request)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
