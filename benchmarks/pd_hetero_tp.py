"""One request's P/D pull from a tensor-parallel prefill worker (every rank's pages read directly: one READ per
prefill rank, then one notification) vs from a one-rank prefill worker (one READ carrying the notification),
into the same decode worker, measured in the same run.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/pd_hetero_tp.py [--tokens 512] [--requests 12] [--decode-tp 1]

Real `k3serve worker` processes on the tiny preset (float32, token ids only): prefill TP=1 and TP=2 (block 16),
decode TP=`--decode-tp` (block 32), UCX over shared memory. Each request is a fresh random prompt (no prefix
hit anywhere), prefilled on one prefill worker, then decoded with max_tokens=1. "pull ms" is the decode
worker's own k3serve_kv_transfer_seconds (post to the last READ done; with a multi-rank decode worker, until
every rank's share is in), "hop ms" the decode call end to end (handshake excluded: one warm-up request per
pair first), "MiB" the bytes pulled per request. The alternative this design rejects, rank 0 gathering the
other ranks' state before one READ, would add a copy of their share through rank 0 per request (and one
NIC's bandwidth for all ranks on a GPU node); it is not built, so it is not a row here.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from _util import print_table  # noqa: E402


def _start(model: str, role: str, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "k3serve.cli", "worker", "--model", model, "--role", role, "--grpc-port", "0",
           "--metrics-port", "0", "--dtype", "float32", "--skip-tokenizer-init", "--num-threads", "1",
           "--max-model-len", "4096", "--log-level", "warning", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONSAFEPATH="1"))


def _ready(proc: subprocess.Popen, timeout: float = 300.0) -> tuple[str, str]:
    deadline, lines = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"ready grpc=(\S+) metrics=(\S+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return m.group(1), m.group(2)
    raise RuntimeError("worker did not start:\n" + "".join(lines))


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")
               or line.startswith(name + " "))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--decode-tp", type=int, default=1)
    args = ap.parse_args()

    import grpc
    import httpx

    from k3serve.proto import worker_pb2 as pb
    from k3serve.proto import worker_pb2_grpc as pb_grpc
    from k3serve.proto.convert import sampling_to_proto
    from k3serve.workers.model.config import K3Config
    from k3serve.workers.model.paths import ensure_tiny_model

    model = str(ensure_tiny_model())
    vocab = K3Config.from_pretrained(model).vocab_size
    procs = {"tp1": _start(model, "prefill", "--block-size", "16"),
             "tp2": _start(model, "prefill", "--block-size", "16", "--tensor-parallel-size", "2"),
             "decode": _start(model, "decode", "--block-size", "32", "--tensor-parallel-size", str(args.decode_tp))}
    try:
        addr = {k: _ready(p) for k, p in procs.items()}
        stubs = {k: pb_grpc.WorkerStub(grpc.insecure_channel(a[0])) for k, a in addr.items()}
        murl = addr["decode"][1]
        sp = sampling_to_proto(dict(temperature=0.0, max_tokens=1, ignore_eos=True))
        rng = random.Random(0)
        rows, base = [], None
        for src in ("tp1", "tp2"):
            hops, pulls, nbytes = [], [], []
            for i in range(args.requests + 1):  # request 0: the handshake with this prefill worker
                prompt = [rng.randrange(vocab) for _ in range(args.tokens)]
                kvp = list(stubs[src].Generate(pb.GenerateRequest(
                    request_id=f"{src}-{i}-p", prompt_token_ids=prompt, sampling_params=sp,
                    kv_transfer_params=pb.KvTransferParams(do_remote_decode=True)), timeout=120))[-1].kv_transfer_params
                kvp.do_remote_prefill = True
                before = httpx.get(murl + "/metrics", timeout=10).text
                t0 = time.perf_counter()
                last = list(stubs["decode"].Generate(pb.GenerateRequest(
                    request_id=f"{src}-{i}", prompt_token_ids=prompt, sampling_params=sp, kv_transfer_params=kvp),
                    timeout=120))[-1]
                hop = time.perf_counter() - t0
                after = httpx.get(murl + "/metrics", timeout=10).text
                res = last.kv_transfer_result
                if res.outcome != "pulled":
                    raise RuntimeError(f"{src} request {i} was not pulled: {res}")
                if i:
                    hops.append(hop)
                    pulls.append(_metric(after, "k3serve_kv_transfer_seconds_sum")
                                 - _metric(before, "k3serve_kv_transfer_seconds_sum"))
                    nbytes.append(res.bytes)
            pull, hop = statistics.median(pulls), statistics.median(hops)
            base = base or (pull, hop)
            rows.append([f"prefill {src} -> decode tp{args.decode_tp}", len(pulls), f"{statistics.mean(nbytes) / 2**20:.2f}",
                         f"{pull * 1e3:.2f}", f"{hop * 1e3:.1f}", f"{min(hops) * 1e3:.1f}-{max(hops) * 1e3:.1f}",
                         f"{pull / base[0]:.2f}", f"{hop / base[1]:.2f}"])
        print(f"tiny preset, float32, {args.tokens}-token prompts, medians")
        print_table(["pair", "requests", "MiB", "pull ms", "hop ms", "hop range", "pull x tp1", "hop x tp1"], rows)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
