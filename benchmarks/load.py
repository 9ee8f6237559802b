"""Sustained load against `k3serve up`: N concurrent streams for a duration; 0 failed and 0 lost expected.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/load.py [--streams 64] [--duration 300] [--workers 2]
    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/load.py --base-url http://127.0.0.1:8000   # an existing platform

Each stream sends streaming completions back to back (random token-id prompts, `ignore_eos`, a fixed
`max_tokens`), so every answer must carry exactly `max_tokens` tokens: a request that errors is *failed*,
one that ends short or without `[DONE]` is *lost*. Reports requests, failed, lost, TTFT p50/p99, E2E p99
and throughput. Without `--base-url` it starts `k3serve up --workers N` itself and stops it afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from k3serve.bench import Req, _one, _pct  # noqa: E402


async def _drive(url: str, model: str, streams: int, duration: float, max_tokens: int, seed: int):
    import httpx

    results = []
    end = time.monotonic() + duration
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:
        async def stream(k: int) -> None:
            rng = random.Random(seed * 1000 + k)
            while time.monotonic() < end:
                req = Req(k, 0, prompt=[rng.randint(10, 250) for _ in range(rng.randint(8, 96))],
                          max_tokens=max_tokens)
                results.append(await _one(client, url, model, req, {}, 600.0))

        await asyncio.gather(*(stream(k) for k in range(streams)))
    return results


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default=None)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    up = None
    url = a.base_url
    if url is None:
        logs = tempfile.mkdtemp(prefix="k3-load-")
        up = subprocess.Popen([sys.executable, "-m", "k3serve.cli", "up", "--workers", str(a.workers), "--port", "0",
                               "--log-dir", logs], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, PYTHONSAFEPATH="1"))
        for line in up.stdout:
            m = re.search(r"API is at (http://\S+)/v1", line)
            if m:
                url = m.group(1)
                break
        if url is None:
            print("k3serve up did not start")
            return 1
    import httpx

    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    try:
        t0 = time.monotonic()
        results = asyncio.run(_drive(url, model, a.streams, a.duration, a.max_tokens, a.seed))
        wall = time.monotonic() - t0
    finally:
        if up is not None:
            up.send_signal(signal.SIGINT)
            up.wait(60)
    failed = [r for r in results if not r.ok]
    lost = [r for r in results if r.ok and r.output_tokens != a.max_tokens]
    ok = [r for r in results if r.ok and r.output_tokens == a.max_tokens]
    ttft = [r.ttft for r in ok]
    print(f"{a.streams} streams for {wall:.0f}s against {url}: {len(results)} requests, {len(failed)} failed, "
          f"{len(lost)} lost")
    print(f"  TTFT p50 {_pct(ttft, 50) * 1000:.0f} ms  p99 {_pct(ttft, 99) * 1000:.0f} ms;  E2E p99 "
          f"{_pct([r.e2e for r in ok], 99) * 1000:.0f} ms;  {sum(r.output_tokens for r in ok) / wall:.1f} output tok/s")
    for r in failed[:3]:
        print(f"  failed: {r.error}")
    return 0 if not failed and not lost else 1


if __name__ == "__main__":
    raise SystemExit(main())
