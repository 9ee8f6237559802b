"""`k3serve bench`: load an OpenAI-compatible server and report latency percentiles (like `vllm bench serve`).

    k3serve bench --base-url http://127.0.0.1:8000 --dataset random --num-prompts 100 \\
        --random-input-len 256 --random-output-len 32 --max-concurrency 1,8,32 --result-file out.json
    k3serve bench --dataset agentic --sessions 16 --turns 4 --shared-prefix-len 512 --request-rate 4

Datasets:
* `random`: prompts of random token ids (`/v1/completions` with token-id prompts), input length uniform in
  [len·(1−r), len·(1+r)] for `--random-range-ratio r`, output length likewise, `ignore_eos` so every
  request produces exactly its output length.
* `agentic`: multi-turn sessions (`/v1/chat/completions`): every session starts with the same system prompt
  (`--shared-prefix-len` words) plus its own task; each turn appends the previous answer and a new user
  message, so turn k shares the whole conversation so far with turn k−1. Turns of one session run in order.

Load: `--max-concurrency N` (a comma-separated list sweeps it), `--request-rate R` (Poisson arrivals, req/s;
default: all at once, bounded by the concurrency). Reported per run: TTFT, TPOT (per output token after the
first), ITL (between streamed chunks), E2E, each as mean and p50/p90/p99 in ms; request and token
throughput; prompt tokens served from the prefix cache (`usage.prompt_tokens_details.cached_tokens`);
failures. `--result-file` writes the runs as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

_WORDS = ("cache state layer token prefix block route worker decode prefill model stream tool call agent "
          "plan step query answer result memory latency graph kernel tensor shard expert batch queue").split()


@dataclass
class Req:
    session: int
    turn: int
    prompt: list[int] | None = None  # random dataset: token ids
    messages: list[dict] | None = None  # agentic dataset (filled when the turn starts)
    user: str = ""
    max_tokens: int = 16
    branch: int = 0  # agentic: parallel branches of one turn (tool calls explored at once); 0 continues


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""
    error: str = ""


def _lens(rng, mean: int, ratio: float, n: int) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_dataset(n: int, input_len: int, output_len: int, ratio: float, seed: int,
                   token_range: tuple[int, int] = (10, 250)) -> list[list[Req]]:
    rng = random.Random(seed)
    ins, outs = _lens(rng, input_len, ratio, n), _lens(rng, output_len, ratio, n)
    return [[Req(i, 0, prompt=[rng.randint(*token_range) for _ in range(a)], max_tokens=b)]
            for i, (a, b) in enumerate(zip(ins, outs))]


def _text(rng, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def agentic_dataset(sessions: int, turns: int, shared_prefix_len: int, task_len: int, turn_len: int,
                    output_len: int, seed: int, branches: int = 1) -> list[list[Req]]:
    """`branches` > 1: every turn after the first is sent as that many parallel requests that differ only in
    their last user message (an agent exploring tool calls at once); the conversation continues from branch 0."""
    rng = random.Random(seed)
    system = "You are an agent. Tools and rules: " + _text(random.Random(seed ^ 0x5EED), shared_prefix_len)
    out = []
    for s in range(sessions):
        task = f"Task {s}: " + _text(rng, task_len)
        reqs = []
        for t in range(turns):
            for b in range(1 if t == 0 else max(1, branches)):
                user = task if t == 0 else f"Step {t}.{b}: " + _text(rng, turn_len)
                reqs.append(Req(s, t, messages=[{"role": "system", "content": system}], user=user,
                                max_tokens=output_len, branch=b))
        out.append(reqs)
    return out


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    f = int(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def summarize(results: list[Result], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    ms = 1000.0

    def stats(xs):
        return {"mean": sum(xs) / len(xs) * ms if xs else 0.0, "p50": _pct(xs, 50) * ms, "p90": _pct(xs, 90) * ms,
                "p99": _pct(xs, 99) * ms}

    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": wall,
        "request_throughput": len(ok) / wall if wall else 0.0,
        "output_throughput": sum(r.output_tokens for r in ok) / wall if wall else 0.0,
        "total_token_throughput": (prompt + sum(r.output_tokens for r in ok)) / wall if wall else 0.0,
        "prompt_tokens": prompt, "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "ttft_ms": stats([r.ttft for r in ok]), "tpot_ms": stats(tpot),
        "itl_ms": stats([x for r in ok for x in r.itl]), "e2e_ms": stats([r.e2e for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


async def _one(client, base_url: str, model: str, req: Req, headers: dict, timeout: float,
               extra_body: dict | None = None) -> Result:
    if req.prompt is not None:
        url = base_url + "/v1/completions"
        body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "ignore_eos": True,
                "temperature": 0.0}
    else:
        url = base_url + "/v1/chat/completions"
        body = {"model": model, "messages": req.messages, "max_tokens": req.max_tokens, "temperature": 0.0}
    body.update(stream=True, stream_options={"include_usage": True}, **(extra_body or {}))
    res = Result(ok=False)
    t0 = time.perf_counter()
    last = None
    parts = []
    try:
        async with client.stream("POST", url, json=body, headers=headers, timeout=timeout) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message"))[:200]
                    return res
                if chunk.get("usage"):
                    u = chunk["usage"]
                    res.prompt_tokens, res.output_tokens = u["prompt_tokens"], u["completion_tokens"]
                    res.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                for ch in chunk.get("choices") or []:
                    d = ch.get("delta") or {}
                    piece = ch.get("text") if "text" in ch else (d.get("content") or d.get("reasoning_content") or "")
                    if not piece and not d.get("tool_calls") and "text" not in ch:
                        continue  # chat: the role chunk or a finish-only chunk (completions: a special token
                        # skipped from the text still arrives as a chunk)
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    parts.append(piece or "")
    except Exception as e:  # noqa: BLE001 - any transport failure is one failed request
        res.error = f"{type(e).__name__}: {e}"[:200]
        return res
    res.e2e = time.perf_counter() - t0
    res.text = "".join(parts)
    res.ok = last is not None or res.output_tokens > 0
    if not res.ok:
        res.error = "no output"
    return res


class _Bar:
    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled = total, 0, enabled

    def step(self) -> None:
        self.done += 1
        if self.enabled:
            w = 30
            k = w * self.done // max(self.total, 1)
            sys.stderr.write(f"\r  [{'#' * k}{'.' * (w - k)}] {self.done}/{self.total}")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


async def run_load(base_url: str, model: str, sessions: list[list[Req]], *, concurrency: int,
                   request_rate: float = float("inf"), seed: int = 0, api_key: str | None = None,
                   timeout: float = 600.0, progress: bool = True,
                   extra_body: dict | None = None) -> tuple[list[Result], float]:
    """Run every session (its turns in order) under the concurrency limit / arrival rate; (results, wall s).
    `extra_body`: fields added to every request (e.g. a `cache_salt` that keeps runs' caches apart)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    bar = _Bar(sum(len(s) for s in sessions), progress)
    results: list[Result] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        async def one(req: Req, history: list[dict]) -> Result:
            if req.messages is not None:
                req.messages = [*req.messages[:1], *history, {"role": "user", "content": req.user}]
            async with sem:
                res = await _one(client, base_url, model, req, headers, timeout, extra_body)
            results.append(res)
            bar.step()
            return res

        async def session(reqs: list[Req]) -> None:
            history: list[dict] = []
            i = 0
            while i < len(reqs):  # the requests of one turn (its branches) run at once
                j = i + 1
                while j < len(reqs) and reqs[j].turn == reqs[i].turn and reqs[j].session == reqs[i].session:
                    j += 1
                turn = reqs[i:j]
                outs = await asyncio.gather(*(one(r, history) for r in turn))
                main = turn[0]
                if main.messages is not None:
                    history += [{"role": "user", "content": main.user}, {"role": "assistant", "content": outs[0].text}]
                i = j

        t0 = time.perf_counter()
        tasks = []
        for s in sessions:
            tasks.append(asyncio.ensure_future(session(s)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (without /v1)")
    p.add_argument("--model", default=None, help="default: the first model the server lists")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", choices=["random", "agentic"], default="random")
    p.add_argument("--num-prompts", type=int, default=100, help="random: requests")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=32)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--sessions", type=int, default=16, help="agentic: sessions")
    p.add_argument("--turns", type=int, default=4, help="agentic: turns per session")
    p.add_argument("--shared-prefix-len", type=int, default=400, help="agentic: words of the shared system prompt")
    p.add_argument("--task-len", type=int, default=60, help="agentic: words of a session's first message")
    p.add_argument("--turn-len", type=int, default=20, help="agentic: words of each later user message")
    p.add_argument("--output-len", type=int, default=16, help="agentic: max_tokens per turn")
    p.add_argument("--branches", type=int, default=1, help="agentic: parallel requests per later turn")
    p.add_argument("--max-concurrency", default="8", help="N or N1,N2,... (a sweep)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="req/s (Poisson); default: no pacing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--result-file", default=None, help="write the runs as JSON")
    p.add_argument("--no-progress", action="store_true")


def _table(run: dict) -> str:
    rows = [f"  concurrency {run['max_concurrency']}: {run['completed']} ok, {run['failed']} failed in "
            f"{run['duration_s']:.1f}s — {run['request_throughput']:.2f} req/s, "
            f"{run['output_throughput']:.1f} output tok/s, cached {run['cached_prompt_tokens']}/{run['prompt_tokens']} "
            "prompt tokens"]
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = run[k]
        rows.append(f"    {k[:-3].upper():5s} mean {s['mean']:9.1f}  p50 {s['p50']:9.1f}  p90 {s['p90']:9.1f}  "
                    f"p99 {s['p99']:9.1f} ms")
    for e in run["errors"]:
        rows.append(f"    error: {e}")
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    import httpx

    try:
        levels = [int(x) for x in str(args.max_concurrency).split(",") if x.strip()]
        if not levels or min(levels) < 1:
            raise ValueError
    except ValueError:
        print(f"k3serve bench: --max-concurrency: expected N or N1,N2,... (positive), got {args.max_concurrency!r}",
              file=sys.stderr)
        return 2
    base = args.base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model
    if model is None:
        try:
            model = httpx.get(base + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            print(f"k3serve bench: cannot list the models at {base}/v1/models: {e}", file=sys.stderr)
            return 2
    runs = []
    for c in levels:
        if args.dataset == "random":
            data = random_dataset(args.num_prompts, args.random_input_len, args.random_output_len,
                                  args.random_range_ratio, args.seed)
        else:
            data = agentic_dataset(args.sessions, args.turns, args.shared_prefix_len, args.task_len, args.turn_len,
                                   args.output_len, args.seed, args.branches)
        print(f"k3serve bench: {args.dataset}, {sum(len(s) for s in data)} requests, concurrency {c}, "
              f"rate {args.request_rate}", flush=True)
        results, wall = asyncio.run(run_load(base, model, data, concurrency=c, request_rate=args.request_rate,
                                             seed=args.seed, api_key=args.api_key, timeout=args.timeout,
                                             progress=not args.no_progress))
        summary = {"max_concurrency": c, "request_rate": args.request_rate, **summarize(results, wall)}
        print(_table(summary), flush=True)
        runs.append(summary)
    if args.result_file:
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump({"base_url": base, "model": model, "dataset": args.dataset, "args": _jsonable(vars(args)),
                       "runs": runs}, f, indent=2)
    return 1 if any(r["failed"] for r in runs) else 0


def _jsonable(d: dict) -> dict:
    return {k: (v if isinstance(v, (int, float, str, bool, type(None))) and v != float("inf") else str(v))
            for k, v in d.items()}


__all__ = ["Req", "Result", "agentic_dataset", "random_dataset", "run_load", "summarize"]
