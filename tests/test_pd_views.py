"""workers/kv_transfer/views.py with real NIXL (two agents, UCX shared memory): the prepared descriptor
lists of both views move exactly the right bytes, and the §5.5 zero-fill leaves every byte of the loaded
pages either received or zero — on random layouts, decode block = r x prefill block, poisoned (0xFF)
destination pages, prompts shorter than a block."""

from __future__ import annotations

import math
import random
import types

import pytest
import torch

from k3serve.common.pd_geometry import plan_pd_mapping
from k3serve.workers.engine.cache_layout import KVCacheTensors, plan_cache_layout
from k3serve.workers.kv_transfer.agent import TransferAgent, ucx_environment
from k3serve.workers.kv_transfer.views import DescriptorSide, PageGeometry, plan_request, zero_unreceived


def _layout(rng, block):
    nl = rng.randint(2, 6)
    kinds = [rng.random() < 0.6 for _ in range(nl)]  # True: KDA
    kinds[0], kinds[-1] = True, False
    cfg = types.SimpleNamespace(
        mla_layer_ids=[i for i, k in enumerate(kinds) if not k], kda_layer_ids=[i for i, k in enumerate(kinds) if k],
        kv_lora_rank=rng.choice([8, 16, 32]), qk_rope_head_dim=rng.choice([4, 8]), kda_num_heads=rng.randint(1, 3),
        kda_head_dim=rng.choice([4, 8, 16]), conv_kernel_size=rng.choice([2, 4]))
    return plan_cache_layout(cfg, rng.choice([torch.float32, torch.float64, torch.bfloat16]), block_size=block)


@pytest.fixture(scope="module")
def agents():
    a, b = TransferAgent("test-views-prefill"), TransferAgent("test-views-decode")
    yield a, b
    a.close()
    b.close()


def test_ucx_environment_is_loopback_only():
    assert ucx_environment(None) == {"UCX_MEM_EVENTS": "no", "UCX_TLS": "self,sm"}
    assert ucx_environment("mlx5_0:1") == {"UCX_MEM_EVENTS": "no", "UCX_NET_DEVICES": "mlx5_0:1"}


@pytest.mark.parametrize("seed", range(6))
def test_pull_moves_exactly_the_mapped_bytes_and_zero_fills_the_rest(agents, seed):
    rng = random.Random(seed)
    pblock = rng.choice([16, 32])
    r = rng.choice([1, 2, 4])
    lp, ld = _layout(random.Random(seed), pblock), _layout(random.Random(seed), pblock * r)
    n_tokens = rng.choice([1, pblock - 1, pblock, pblock + 1, rng.randint(2, 5 * pblock * r)])
    nb_p, nb_d = 4 + math.ceil(n_tokens / pblock) * len(lp.groups), 4 + math.ceil(n_tokens / ld.block_size) * len(ld.groups)
    src, dst = KVCacheTensors(lp, nb_p), KVCacheTensors(ld, nb_d)
    g = torch.Generator().manual_seed(seed)
    for t in src.pages:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
    for t in dst.pages:
        t.fill_(0xFF)
    pa, da = agents
    pa.register([(t.data_ptr(), t.nbytes) for t in src.pages])
    da.register([(t.data_ptr(), t.nbytes) for t in dst.pages])
    peer = da.add_peer(pa.metadata())
    gp, gd = PageGeometry.of(lp, nb_p), PageGeometry.of(ld, nb_d)
    assert PageGeometry.from_json(gp.to_json()) == gp
    mapping = plan_pd_mapping(gp.side(), gd.side(), 0)
    assert mapping.block_ratio == r
    sub = pblock * gp.mla_token_bytes
    ls = DescriptorSide(gd, [t.data_ptr() for t in dst.pages], mapping, sub, local=True)
    rs = DescriptorSide(gp, [t.data_ptr() for t in src.pages], mapping, sub, local=False)
    lh, rh = da.prep_local(ls.descs), da.prep_remote(peer, rs.descs)
    # one request: random distinct blocks on each side
    pfree, dfree = rng.sample(range(1, nb_p), nb_p - 1), rng.sample(range(1, nb_d), nb_d - 1)
    mla_pairs, mla_loaded, kda_pairs, kda_d = {}, {}, {}, {}
    for grp in lp.groups:
        if grp.kind == "mla":
            pb = [pfree.pop() for _ in range(math.ceil(n_tokens / pblock))]
            db = [dfree.pop() for _ in range(math.ceil(n_tokens / ld.block_size))]
            mla_pairs[grp.group_id] = mapping.mla_block_pairs(pb, db)
            mla_loaded[grp.group_id] = db
        else:
            kda_pairs[grp.group_id] = (pfree.pop(), dfree.pop())
            kda_d[grp.group_id] = kda_pairs[grp.group_id][1]
    plan = plan_request(ls, rs, gd.groups, mla_pairs, kda_pairs)
    x = da.read(lh, plan.local_ids, rh, plan.remote_ids, notif=b"req-%d" % seed)
    while (state := x.poll()) == "PROC":
        pass
    x.release()
    assert state == "DONE"
    zero_unreceived(dst.pages, gd, ls, mla_loaded, n_tokens, kda_d)
    # the target learned of the completion
    got = {}
    for _ in range(1000):
        got = pa.notifs()
        if got:
            break
    assert got == {"test-views-decode": [b"req-%d" % seed]}

    # expected pages, built with the typed views of cache_layout.py (independent of the descriptors)
    want = KVCacheTensors(ld, nb_d)
    for t in want.pages:
        t.fill_(0xFF)
    for grp in ld.groups:
        for j in range(len(grp.layer_ids)):
            if grp.kind == "mla":
                w, s = want.mla_view(j), src.mla_view(j)
                for blk in mla_loaded[grp.group_id]:
                    want.pages[j][blk].zero_()
                for q, (pb_, db_, k) in enumerate(mla_pairs[grp.group_id]):
                    ntok = min(pblock, n_tokens - q * pblock)
                    w[db_, k * pblock: k * pblock + ntok] = s[pb_, :ntok]
            else:
                pb_, db_ = kda_pairs[grp.group_id]
                want.pages[j][db_].zero_()
                want.conv_view(j)[db_] = src.conv_view(j)[pb_]
                want.ssm_view(j)[db_] = src.ssm_view(j)[pb_]
    for j in range(ld.group_size):
        assert torch.equal(dst.pages[j], want.pages[j]), f"position {j}"
    assert plan.bytes_by_view["mla"] == sum(len(mla_pairs[grp.group_id]) * len(grp.layer_ids) * sub
                                            for grp in lp.mla_groups)
    assert plan.num_descriptors == sum(len(mla_pairs[grp.group_id]) * len(grp.layer_ids) for grp in lp.mla_groups) \
        + 4 * sum(len(grp.layer_ids) for grp in lp.kda_groups)
    # untouched pages keep their poison (nothing else was written)
    touched = {b for v in mla_loaded.values() for b in v} | set(kda_d.values())
    untouched = [b for b in range(nb_d) if b not in touched]
    assert all(bool((dst.pages[j][untouched] == 0xFF).all()) for j in range(ld.group_size))
    da.release_dlist(lh)
    da.release_dlist(rh)
    pa.close()  # deregisters and forgets peers; the agents serve the next case
    da.close()


def test_benchmark_runs_and_prints_its_table():
    """benchmarks/pd_transfer.py at its smallest settings (the numbers themselves are not asserted)."""
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "pd_transfer.py")
    proc = subprocess.run([sys.executable, script, "--tokens", "256", "--reps", "1", "--configs", "tiny"],
                          env=dict(os.environ, PYTHONSAFEPATH="1"), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("tiny")]
    assert [r[2] for r in rows] == ["scattered", "contiguous"] and all(float(r[8]) > 0 for r in rows)


_NETWORK_MODE = r'''
import multiprocessing as mp, os, sys
import numpy as np, torch
from k3serve.workers.kv_transfer.agent import TransferAgent
from tests._proc_tree import _listening_sockets

def child(conn):
    t = torch.arange(256, dtype=torch.uint8).repeat(64)
    a = TransferAgent("net-src", devices="lo")
    a.register([(t.data_ptr(), t.nbytes)])
    conn.send((a.metadata(), t.data_ptr(), os.getpid()))
    conn.recv()  # blocked: only NIXL's progress thread serves the READ

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    p, c = ctx.Pipe()
    pr = ctx.Process(target=child, args=(c,))
    pr.start()
    md, base, cpid = p.recv()
    d = torch.zeros(16384, dtype=torch.uint8)
    a = TransferAgent("net-dst", devices="lo")
    a.register([(d.data_ptr(), d.nbytes)])
    peer = a.add_peer(md)
    lh = a.prep_local(np.array([[d.data_ptr(), d.nbytes, 0]], dtype=np.uint64))
    rh = a.prep_remote(peer, np.array([[base, d.nbytes, 0]], dtype=np.uint64))
    x = a.read(lh, [0], rh, [0])
    while (s := x.poll()) == "PROC":
        pass
    assert s == "DONE" and torch.equal(d, torch.arange(256, dtype=torch.uint8).repeat(64))
    assert "UCX_TLS" not in os.environ and os.environ["UCX_NET_DEVICES"] == "lo"
    socks = _listening_sockets(cpid) + _listening_sockets(os.getpid())
    assert socks and all(addr in ("0100007F", "0000000000000000FFFF00000100007F") for _, addr in socks), socks
    p.send("done")
    pr.join()
    print("network mode ok")
'''


def test_network_mode_over_lo_binds_loopback_only(tmp_path):
    """--kv-transfer-devices lo: UCX over TCP on the loopback device (no UCX_TLS), the target served by
    NIXL's progress thread while its main thread is blocked, every socket on 127.0.0.1."""
    import os
    import subprocess
    import sys

    script = tmp_path / "net_mode.py"
    script.write_text(_NETWORK_MODE)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    env.pop("UCX_TLS", None)
    proc = subprocess.run([sys.executable, str(script)], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "network mode ok" in proc.stdout, proc.stdout + proc.stderr


def test_registered_host_pages_move_onto_huge_pages_in_place():
    """TransferAgent.register collapses the page tensors onto transparent huge pages (contents kept);
    where the kernel allows it (THP not 'never', Linux >= 6.1), the aligned interior really is collapsed."""
    import os
    import platform

    from k3serve.workers.kv_transfer.agent import back_with_huge_pages

    t = torch.randint(0, 256, (9 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    before = t.clone()
    done = back_with_huge_pages([(t.data_ptr(), t.nbytes)])
    assert torch.equal(t, before)
    assert done % (2 << 20) == 0 and done <= t.nbytes
    mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read() if os.path.exists(
        "/sys/kernel/mm/transparent_hugepage/enabled") else "[never]"
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    if "[never]" not in mode and (major, minor) >= (6, 1):
        assert done >= 6 << 20  # at least the 2 MiB-aligned interior minus the two partial ends
