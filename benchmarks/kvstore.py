"""The Mooncake store tier: TTFT of a shared prefix (cold, local hit, host-tier hit, store hit from
another worker) and store throughput against a memcpy of the same bytes, all in one run.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/kvstore.py [--prefix 8192] [--reps 5] [--quick]

Needs root: it runs inside a private network namespace (Mooncake clients listen on all interfaces;
k3serve/kvstore/netns.py) with a real `mooncake_master` on loopback.

* TTFT (`tiny` preset, float32, dense retention): one request of `--prefix` shared tokens plus a
  16-token suffix, `max_tokens=1`, timed from `add_request` to its first token. Rows: `cold` (empty
  caches), `local` (the same engine after serving the prefix), `host tier` (the device pool holds one
  request, the prefix was evicted to `--kv-offload-memory`), `store` (a fresh engine with empty local
  caches; the prefix was computed by another worker process and saved to the store). Each engine
  first serves a 16-token warm-up prompt. `device hit` / `tier hit`: prompt tokens found in the device
  cache / supplied by the row's tier; `bytes/hit`: what the tier moved for that request. `vs cold` = cold TTFT / row TTFT. The store deadline is 1 s here
  (`DEADLINE_MS`) so a loaded machine measures the load rather than a skipped lookup.
* Throughput, for the `tiny` layout and `k3-rank` (K3's per-rank state at TP8: 12 KDA heads x 128,
  conv kernel 4, bf16 conv + fp32 state, MLA 512+64 in bf16, block 768; 6 KDA + 2 MLA layers): the
  objects of one `--prefix`-token request (a group's page at every layer position per key) are put by
  a holder process (whose segment stores them) and read back by this one with one `batch_get_into`;
  the baseline is one contiguous torch copy of the same byte count. `ratio` = memcpy time / store time.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import types

sys.path.insert(0, os.path.dirname(__file__))
from _util import print_table  # noqa: E402

DEADLINE_MS = 1000  # the store's wait bound here (a 2-core box under load; the serving default is 50)


def _layout(name: str):
    import torch

    from k3serve.workers.engine.cache_layout import plan_cache_layout

    if name == "tiny":
        from k3serve.workers.model.config import K3Config
        from k3serve.workers.model.paths import ensure_tiny_model

        return plan_cache_layout(K3Config.from_pretrained(ensure_tiny_model()), torch.float32)
    cfg = types.SimpleNamespace(mla_layer_ids=[3, 7], kda_layer_ids=[0, 1, 2, 4, 5, 6], kv_lora_rank=512,
                                qk_rope_head_dim=64, kda_num_heads=12, kda_head_dim=128, conv_kernel_size=4)
    return plan_cache_layout(cfg, torch.bfloat16, block_size=768)


def _objects(layout, tokens: int) -> int:
    """Store objects of one request of `tokens` tokens: a page per MLA group per block, a snapshot per KDA group."""
    return len(layout.mla_groups) * math.ceil(tokens / layout.block_size) + len(layout.kda_groups)


# -- throughput -----------------------------------------------------------------------------------
def _holder(conn, address: str, name: str, n: int, size: int, segment: int):
    import torch

    from k3serve.kvstore.client import StoreClient

    c = StoreClient(address, segment_bytes=segment)
    assert c.connect(), "holder: no master"
    buf = torch.randint(0, 256, (n, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    c.register(buf.data_ptr(), buf.numel())
    t0 = time.perf_counter()
    codes = c.batch_put_from([f"bench/{name}/{i}" for i in range(n)], [buf[i].data_ptr() for i in range(n)], [size] * n)
    put_s = time.perf_counter() - t0
    assert all(x == 0 for x in codes), codes[:4]
    conn.send(put_s)
    conn.recv()
    c.close()


def throughput(address: str, name: str, tokens: int, reps: int) -> list:
    import torch

    from k3serve.kvstore.client import StoreClient

    torch.set_num_threads(1)
    layout = _layout(name)
    n, size = _objects(layout, tokens), layout.group_size * layout.page_bytes
    total = n * size
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_holder, args=(child, address, name, n, size, total + (64 << 20)), daemon=True)
    proc.start()
    c = StoreClient(address, segment_bytes=0)  # holds nothing: every byte comes from the holder
    assert c.connect()
    try:
        put_s = parent.recv()
        out = torch.zeros(n, size, dtype=torch.uint8)
        c.register(out.data_ptr(), out.numel())
        keys = [f"bench/{name}/{i}" for i in range(n)]
        times = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            got = c.batch_get_into(keys, [out[j].data_ptr() for j in range(n)], [size] * n)
            dt = time.perf_counter() - t0
            assert got == [size] * n, got[:4]
            if i:
                times.append(dt)
        want = torch.randint(0, 256, (n, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
        assert torch.equal(out, want), "store bytes differ from what the holder put"
        a, b = torch.empty(total, dtype=torch.uint8), torch.randint(0, 256, (total,), dtype=torch.uint8)
        mc = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            a.copy_(b)
            if i:
                mc.append(time.perf_counter() - t0)
        t, m = statistics.median(times), statistics.median(mc)
        return [name, tokens, n, size, total, round(put_s * 1e3, 2), round(t * 1e3, 2), round(total / t / 2**30, 2),
                round(m * 1e3, 2), round(total / m / 2**30, 2), round(m / t, 3)]
    finally:
        parent.send("done")
        proc.join(30)
        c.close()


# -- TTFT -------------------------------------------------------------------------------------------
def _ttft(llm, prompt: list[int]) -> float:
    from k3serve.sampling_params import SamplingParams

    eng = llm.engine
    rid = eng.next_request_id()
    t0 = time.perf_counter()
    eng.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while True:
        for out in eng.step():
            if out.request_id == rid and out.outputs[0].token_ids:
                dt = time.perf_counter() - t0
                while eng.has_unfinished_requests():
                    eng.step()
                return dt


def _engine(model: str, prefix: int, **kw):
    from k3serve.workers.llm import LLM

    return LLM(model, dtype="float32", skip_tokenizer_init=True, max_model_len=prefix + 64,
               max_num_batched_tokens=prefix + 64, enable_prefix_caching=True,
               prefix_cache_retention_interval="dense", **kw)


def _stat(llm, key: str) -> float:
    return float(llm.engine.stats().get(key, 0) or 0)


def _shutdown(llm) -> None:
    """Close the engine's connectors (the store client unmounts its segment)."""
    if llm.engine.connector is not None:
        llm.engine.connector.worker.shutdown()


def _store_producer(conn, model: str, prefix: int, address: str, prompt: list[int]):
    llm = _engine(model, prefix, kv_store=address, kv_store_deadline_ms=DEADLINE_MS)
    _ttft(llm, prompt)
    time.sleep(0.5)  # the step's puts run on the save lane
    conn.send(_stat(llm, "kv_store_bytes_put"))
    conn.recv()  # keep its segment alive until the reader is done
    _shutdown(llm)


def ttft_rows(address: str, prefix: int, reps: int) -> list:
    import random

    from k3serve.workers.model.paths import ensure_tiny_model

    model = str(ensure_tiny_model())
    rng = random.Random(0)

    def prompt_with(shared):
        return shared + [rng.randrange(1, 500) for _ in range(16)]

    rows = []
    cold, local, host, store = [], [], [], []
    b_host = b_store = 0.0
    hits = {"cold": (0.0, 0.0), "local": (0.0, 0.0), "host tier": (0.0, 0.0), "store": (0.0, 0.0)}  # device, tier
    ctx = mp.get_context("spawn")
    for _rep in range(reps):
        X = [rng.randrange(1, 500) for _ in range(prefix)]
        # cold and local
        llm = _engine(model, prefix)
        _ttft(llm, [rng.randrange(1, 500) for _ in range(16)])  # warm-up (one-time costs), unrelated tokens
        cold.append(_ttft(llm, prompt_with(X)))
        before = _stat(llm, "prefix_cache_hits")
        local.append(_ttft(llm, prompt_with(X)))
        hits["local"] = (_stat(llm, "prefix_cache_hits") - before, 0.0)
        _shutdown(llm)
        # host tier: a device pool for about one request, so serving Y evicts X to host memory
        probe = llm.engine
        per_block = probe.layout.bytes_per_block
        # one request's pages plus its retained KDA snapshots (dense retention: one per block and KDA
        # group); a pool without room for them drops the snapshots, and nothing could be reused
        L = probe.layout
        need = L.min_blocks_for(prefix + 64, True) + len(L.kda_groups) * -(-prefix // L.block_size) + 2
        llm = _engine(model, prefix, kv_cache_memory=need * per_block, kv_offload_memory=4 * need * per_block)
        _ttft(llm, prompt_with(X))
        for _ in range(2):  # unrelated prompts of the same size: every page of X is evicted to the host
            _ttft(llm, prompt_with([rng.randrange(1, 500) for _ in range(prefix)]))
        before, hb = _stat(llm, "kv_offload_loaded_bytes"), _stat(llm, "kv_offload_hit_tokens")
        hd = _stat(llm, "prefix_cache_hits")
        host.append(_ttft(llm, prompt_with(X)))
        b_host = _stat(llm, "kv_offload_loaded_bytes") - before
        hits["host tier"] = (_stat(llm, "prefix_cache_hits") - hd, _stat(llm, "kv_offload_hit_tokens") - hb)
        _shutdown(llm)
        # store: another worker process computes X, this fresh engine loads it
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_store_producer, args=(child, model, prefix, address, prompt_with(X)), daemon=True)
        proc.start()
        parent.recv()
        llm = _engine(model, prefix, kv_store=address, kv_store_deadline_ms=DEADLINE_MS)
        svc = _store_service(llm)
        svc.wait_available(15)
        _ttft(llm, [rng.randrange(1, 500) for _ in range(16)])  # the same warm-up as the cold engine
        hd = _stat(llm, "prefix_cache_hits")
        store.append(_ttft(llm, prompt_with(X)))
        b_store = _stat(llm, "kv_store_bytes_got")
        hits["store"] = (_stat(llm, "prefix_cache_hits") - hd, _stat(llm, "kv_store_hit_tokens"))
        _shutdown(llm)
        parent.send("done")
        proc.join(60)
    c = statistics.median(cold)
    for name, ts, b in (("cold", cold, 0), ("local", local, 0), ("host tier", host, b_host),
                        ("store", store, b_store)):
        t = statistics.median(ts)
        rows.append(["tiny", prefix, name, int(hits[name][0]), int(hits[name][1]), round(t * 1e3, 1), int(b),
                     round(c / t, 2)])
    return rows


def _store_service(llm):
    from k3serve.kvstore.connector import find_store

    s = find_store(llm.engine)
    if s is None:
        raise SystemExit("kvstore benchmark: the engine has no store tier (EngineArgs.kv_store not wired)")
    return s.service


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a 256-token prefix, one repetition")
    args = ap.parse_args(argv)
    if args.quick:
        args.prefix, args.reps = 256, 1

    from k3serve.kvstore.master import MooncakeMaster
    from k3serve.kvstore.netns import enter_private_netns

    enter_private_netns()
    os.environ.setdefault("GLOG_minloglevel", "2")
    with tempfile.TemporaryDirectory() as tmp, MooncakeMaster(log_path=os.path.join(tmp, "master.log")) as m:
        rows = ttft_rows(m.address, args.prefix, args.reps)
        print_table(["config", "prefix", "served from", "device hit", "tier hit", "TTFT ms", "bytes/hit", "vs cold"],
                    rows)
        trows = [throughput(m.address, name, args.prefix, max(3, args.reps)) for name in ("tiny", "k3-rank")]
        print_table(["layout", "tokens", "objects", "object B", "total B", "put ms", "get ms", "get GiB/s",
                     "memcpy ms", "memcpy GiB/s", "ratio"], trows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
