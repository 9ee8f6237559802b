"""DEP decode on CPU ranks: wall time per decode step of B concurrent requests, 1 rank vs DEP on M ranks.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/dep_decode.py [--requests 8] [--tokens 32] [--ranks 2,4] [--threads 1]
                                                               [--two-node]

The same B requests (random prompts, greedy, ignore_eos) run on the single-rank engine (the baseline) and on
`LLM(..., data_parallel_size=M, enable_expert_parallel=True)` (workers/engine/parallel/dp_front.py: B/M
requests per rank, the routed experts by all-to-all), in the same run, on a random LatentMoE config
(random_config(29): KDA + MLA, 16 experts, shared experts). Per setup: the mean wall time of a decode step
(every request past its prefill), the ratio vs 1 rank, the part of it the leader spends outside its own
rank's engine step (the pipes to the other ranks: send, outputs and KV events back), the all-to-all bytes
rank 0 sends per decode step (counted from the collectives' shapes, workers/engine/parallel/group.py log),
and whether the greedy tokens equal the baseline's. This machine's ranks share its few cores and talk over
loopback gloo: the ratios are the CPU cost of the process model and collectives here, not a GPU figure.
Every process (the baseline, each rank) runs --threads torch threads.

--two-node adds, per M, DEP M as a group over 2 "nodes" on 127.0.0.1 ("DEPM 2xM/2": this process is node 0
with ranks 0..M/2-1, a `k3serve worker --node-rank 1` process runs the others, which the front drives over
their TCP links, answers in msgpack: workers/engine/parallel/nodes.py, dp_wire.py), so the front ms/step
column compares the remote ranks' link with the local ranks' pipes on the same machine.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from k3serve.sampling_params import SamplingParams
from k3serve.workers.llm import LLM
from k3serve.workers.model.testing import random_config, write_random_model

SEED = 29


def run(engine, prompts, tokens: int, log: list | None = None) -> tuple[list[list[int]], list[float], float, int]:
    """(tokens per request, decode-step wall times, seconds the DP front spent outside rank 0's step, bytes
    rank 0 sent by all-to-all in the decode steps: `log` is its RankGroup's collective log)."""
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, sp.clone())
    local = getattr(engine, "local", None)
    inner = [0.0]
    if local is not None:  # time rank 0's own engine step inside the front's
        step = local.step

        def timed():
            t = time.perf_counter()
            try:
                return step()
            finally:
                inner[0] += time.perf_counter() - t

        local.step = timed
    done, times, produced = {}, [], {f"r{i}": 0 for i in range(len(prompts))}
    outside, a2a = 0.0, 0
    while len(done) < len(prompts):
        decoding = all(n > 0 for n in produced.values())
        inner[0] = 0.0
        seen = len(log) if log is not None else 0
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        if decoding:
            times.append(dt)
            outside += dt - inner[0] if local is not None else 0.0
            a2a += sum(n * _prod(shape) for name, shape, n in (log or [])[seen:] if name == "all_to_all")
        for o in outs:
            produced[o.request_id] = len(o.outputs[0].token_ids)
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    if local is not None:
        local.step = step
    return [done[f"r{i}"] for i in range(len(prompts))], times, outside, a2a


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per request")
    ap.add_argument("--ranks", default="2,4", help="DEP sizes to run (comma-separated)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (K3SERVE_RANK_THREADS)")
    ap.add_argument("--two-node", action="store_true", help="also DEP M over 2 nodes (M/2 ranks each) per M")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    os.environ["K3SERVE_RANK_THREADS"] = str(a.threads)  # every DP rank's count (workers/engine/parallel/threads.py)
    cfg = random_config(SEED)
    rng = random.Random(SEED)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(rng.randint(16, 48))] for _ in range(a.requests)]
    opts = dict(dtype="float32", skip_tokenizer_init=True, max_num_seqs=max(8, a.requests))
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "model"
        write_random_model(d, seed=SEED)
        base_tokens, base_times, _, _ = run(LLM(str(d), **opts).engine, prompts, a.tokens)
        base = sum(base_times) / len(base_times)
        print(f"config: random_config({SEED}) experts={cfg.num_experts} moe_layers={len(cfg.moe_layer_ids)} "
              f"requests={a.requests} new_tokens={a.tokens} threads/process={a.threads}")
        print(f"{'setup':<10} {'ms/step':>9} {'ratio vs 1 rank':>16} {'front ms/step':>14} {'a2a KiB/step':>13}  "
              "greedy == 1 rank")
        print(f"{'1 rank':<10} {base * 1e3:>9.2f} {1.0:>16.2f} {'-':>14} {'-':>13}  -")
        sizes = [int(x) for x in a.ranks.split(",") if x]
        for m, nodes in [(k, n) for k in sizes for n in ((1, 2) if a.two_node and k % 2 == 0 else (1,))]:
            node, extra = (_start_node(d, m, a.threads) if nodes == 2 else (None, {}))
            try:
                llm = LLM(str(d), data_parallel_size=m, enable_expert_parallel=True, **extra, **opts)
                engine = llm.engine
                log = engine.runner.group.log = []
                try:
                    toks, times, outside, a2a = run(engine, prompts, a.tokens, log)
                finally:
                    engine.close()
            finally:
                if node is not None:
                    try:
                        node.wait(15)
                    except subprocess.TimeoutExpired:
                        node.kill()
            mean = sum(times) / len(times)
            name = f"DEP{m}" + (f" 2x{m // 2}" if nodes == 2 else "")
            print(f"{name:<10} {mean * 1e3:>9.2f} {mean / base:>16.2f} {outside / len(times) * 1e3:>14.2f} "
                  f"{a2a / len(times) / 1024:>13.1f}  {toks == base_tokens}")
    return 0


def _start_node(model_dir, m: int, threads: int):
    """Node 1 of a 2-node DEP m group on 127.0.0.1: (its process, the LLM arguments of node 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "k3serve.cli", "worker", "--model", str(model_dir), "--data-parallel-size", str(m),
           "--enable-expert-parallel", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
           "--master-port", str(port), "--metrics-port", "0", "--num-threads", str(threads), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONSAFEPATH="1"), stdout=subprocess.DEVNULL)
    return proc, dict(nnodes=2, master_addr="127.0.0.1", master_port=port)


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


if __name__ == "__main__":
    sys.exit(main())
