"""P/D transfer speed: one request's MLA pages + KDA state pulled with NIXL READ between two processes,
against a plain memcpy of the same number of bytes measured in the same run.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/pd_transfer.py [--tokens 1024,8192,32768] [--reps 20]

Two page pools (workers/engine/cache_layout.py layouts) live in two processes: a "prefill" child that
fills its pages with random bytes and a "decode" parent that pulls through the connector's own code
(workers/kv_transfer/: the UCX environment, prepared descriptor lists of both views, one
make_prepped_xfer per request) into scattered (random) or contiguous block ids, then checks a sample of
the transferred ranges against the source bytes.
Configs: `tiny` (the tiny preset, float32) and `k3-rank` (K3's per-rank state at TP8: 12 KDA heads x 128,
conv kernel 4, bf16 conv + fp32 recurrent state, MLA latent 512 + 64 rope in bf16, block 768 as on
the GPU; 6 KDA + 2 MLA layers). Baselines, measured in the same run: `memcpy`, one single-threaded
contiguous copy of the request's byte count (torch, 1 thread, like the UCX path; `ratio` = memcpy time /
transfer time), and `ranges`, the request's own descriptor ranges copied page to page inside one process
(ctypes.memmove per descriptor; `ratio ranges` = that time / transfer time).
"""

from __future__ import annotations

import argparse
import ctypes
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.dirname(__file__))
from _util import print_table  # noqa: E402


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


def _num_blocks(layout, max_tokens: int) -> int:
    return 2 + len(layout.mla_groups) * math.ceil(max_tokens / layout.block_size) + len(layout.kda_groups) + 8


def _fill(pages, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    for t in pages:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))


def _prefill_child(conn, name: str, max_tokens: int):
    import torch

    from k3serve.workers.engine.cache_layout import KVCacheTensors
    from k3serve.workers.kv_transfer.agent import TransferAgent
    from k3serve.workers.kv_transfer.views import PageGeometry

    torch.set_num_threads(1)
    layout = _layout(name)
    kv = KVCacheTensors(layout, _num_blocks(layout, max_tokens))
    _fill(kv.pages, 1234)
    agent = TransferAgent(f"bench-prefill-{name}")
    agent.register([(t.data_ptr(), t.nbytes) for t in kv.pages])
    conn.send((agent.metadata(), [t.data_ptr() for t in kv.pages], PageGeometry.of(layout, kv.num_blocks).to_json()))
    conn.recv()  # done
    agent.close()


def run_config(name: str, tokens: list[int], reps: int) -> list[list]:
    import numpy as np
    import torch

    from k3serve.common.pd_geometry import plan_pd_mapping
    from k3serve.workers.engine.cache_layout import KVCacheTensors
    from k3serve.workers.kv_transfer.agent import TransferAgent
    from k3serve.workers.kv_transfer.views import DescriptorSide, PageGeometry, plan_request

    torch.set_num_threads(1)
    layout = _layout(name)
    max_tokens = max(tokens)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_prefill_child, args=(child, name, max_tokens), daemon=True)
    proc.start()
    rows = []
    try:
        md, rbases, rgeom_json = parent.recv()
        rgeom = PageGeometry.from_json(rgeom_json)
        kv = KVCacheTensors(layout, _num_blocks(layout, max_tokens))
        geom = PageGeometry.of(layout, kv.num_blocks)
        agent = TransferAgent(f"bench-decode-{name}")
        agent.register([(t.data_ptr(), t.nbytes) for t in kv.pages])
        peer = agent.add_peer(md)
        mapping = plan_pd_mapping(rgeom.side(), geom.side(), 0)
        sub = rgeom.block_size * rgeom.mla_token_bytes
        lside = DescriptorSide(geom, [t.data_ptr() for t in kv.pages], mapping, sub, local=True)
        rside = DescriptorSide(rgeom, rbases, mapping, sub, local=False)
        t0 = time.perf_counter()
        lh, rh = agent.prep_local(lside.descs), agent.prep_remote(peer, rside.descs)
        prep_ms = (time.perf_counter() - t0) * 1e3
        # expected source bytes (the child filled its pages from the same seed)
        src = [torch.empty_like(t) for t in kv.pages]
        _fill(src, 1234)
        rng = np.random.default_rng(0)
        for n, placement in [(n, p) for n in tokens for p in ("scattered", "contiguous")]:
            nb = math.ceil(n / layout.block_size)
            if placement == "scattered":  # random block ids on both sides: NIXL can merge nothing
                ids = rng.permutation(np.arange(1, kv.num_blocks))
                rids = rng.permutation(np.arange(1, kv.num_blocks))
            else:  # consecutive ids (a fresh pool allocates in order): adjacent pages merge
                ids = rids = np.arange(1, kv.num_blocks)
            mla_pairs, kda_pairs, take, at = {}, {}, {}, 0
            for g in layout.groups:
                k = nb if g.kind == "mla" else 1
                take[g.group_id] = (rids[at:at + k].tolist(), ids[at:at + k].tolist())
                at += k
                if g.kind == "mla":
                    mla_pairs[g.group_id] = mapping.mla_block_pairs(*take[g.group_id])
                else:
                    kda_pairs[g.group_id] = (take[g.group_id][0][0], take[g.group_id][1][0])
            plan = plan_request(lside, rside, geom.groups, mla_pairs, kda_pairs)
            total = sum(plan.bytes_by_view.values())
            times = []
            for i in range(reps + 2):
                t0 = time.perf_counter()
                x = agent.read(lh, plan.local_ids, rh, plan.remote_ids)
                while (s := x.poll()) == "PROC":
                    pass
                dt = time.perf_counter() - t0
                x.release()
                assert s == "DONE", s
                if i >= 2:
                    times.append(dt)
            # every transferred byte arrived
            for (lo_desc, ro_desc) in zip(plan.local_ids[:: max(1, len(plan.local_ids) // 64)],
                                          plan.remote_ids[:: max(1, len(plan.remote_ids) // 64)]):
                la, ll, _ = lside.descs[lo_desc]
                ra, _rl, _ = rside.descs[ro_desc]
                j = next(j for j, b in enumerate(rbases) if b <= ra < b + src[j].nbytes)
                jl = next(j for j, t in enumerate(kv.pages) if t.data_ptr() <= la < t.data_ptr() + t.nbytes)
                got = kv.pages[jl].view(-1)[la - kv.pages[jl].data_ptr(): la - kv.pages[jl].data_ptr() + ll]
                want = src[j].view(-1)[ra - rbases[j]: ra - rbases[j] + ll]
                assert torch.equal(got, want), "a transferred range differs from the source"
            # the same ranges copied inside one process (ctypes.memmove per descriptor pair)
            sside = DescriptorSide(rgeom, [t.data_ptr() for t in src], mapping, sub, local=False)
            pairs = [(int(lside.descs[i][0]), int(sside.descs[k][0]), int(lside.descs[i][1]))
                     for i, k in zip(plan.local_ids, plan.remote_ids)]
            mv = []
            for i in range(reps + 2):
                t0 = time.perf_counter()
                for d, s_, ln in pairs:
                    ctypes.memmove(d, s_, ln)
                if i >= 2:
                    mv.append(time.perf_counter() - t0)
            a, b = torch.empty(total, dtype=torch.uint8), torch.randint(0, 256, (total,), dtype=torch.uint8)
            mc = []
            for i in range(reps + 2):
                t0 = time.perf_counter()
                a.copy_(b)
                if i >= 2:
                    mc.append(time.perf_counter() - t0)
            t, m, v = statistics.median(times), statistics.median(mc), statistics.median(mv)
            rows.append([name, n, placement, plan.bytes_by_view["mla"], plan.bytes_by_view["kda_conv"],
                         plan.bytes_by_view["kda_ssm"], plan.num_descriptors, round(t * 1e3, 3),
                         round(total / t / 1e9, 2), round(m * 1e3, 3), round(total / m / 1e9, 2), round(m / t, 2),
                         round(v * 1e3, 3), round(v / t, 2), round(prep_ms, 1)])
        agent.release_dlist(lh)
        agent.release_dlist(rh)
        agent.close()
    finally:
        parent.send("done")
        proc.join(10)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1024,8192,32768")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--configs", default="tiny,k3-rank")
    args = ap.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for name in args.configs.split(","):
        rows += run_config(name, tokens, args.reps)
    print_table(["config", "tokens", "blocks", "mla B", "kda_conv B", "kda_ssm B", "descs", "xfer ms", "xfer GB/s",
                 "memcpy ms", "memcpy GB/s", "ratio", "ranges ms", "ratio ranges", "prep ms"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
