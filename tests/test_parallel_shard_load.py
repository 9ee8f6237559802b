"""Shard-only checkpoint reads (workers/engine/parallel/shard.py load_shard, workers/model/loader.py keep=):
every rank's shard read slice by slice from the safetensors equals the full read cut by shard_weights
(same names, shapes, dtypes, values), for random configs (MXFP4 or dense experts, tied or padded
vocabularies, MTP layers, shared experts), 2 and 4 ranks, TP-sliced or expert-parallel experts, and for a
checkpoint in the fused / stacked / size-1-dim spellings; each rank reads fewer bytes the more ranks there
are, and less than the whole checkpoint.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k3serve.workers.engine.parallel.shard import ShardPlan, load_shard, selection, shard_weights
from k3serve.workers.model.loader import load_model_weights
from k3serve.workers.model.testing import write_random_model

torch.set_num_threads(1)


def _assert_same(want: dict, got: dict) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), k


def _check_all_ranks(d, sizes=(2, 4)) -> dict[tuple[int, bool], list[int]]:
    """Shard-only == full-read-then-cut on every rank; -> bytes read per rank, by (size, expert parallel)."""
    cfg, full = load_model_weights(d, dtype=torch.float64)
    read = {}
    for size in sizes:
        for ep in (False, True):
            read[size, ep] = []
            for rank in range(size):
                rank_cfg, want = shard_weights(cfg, full, ShardPlan.make(cfg, rank, size, ep), torch.float64)
                stats = {}
                _cfg, plan, got_cfg, got = load_shard(d, torch.float64, rank, size, ep, stats=stats)
                assert (plan.rank, plan.size) == (rank, size) and got_cfg == rank_cfg
                _assert_same(want, got)
                read[size, ep].append(stats["bytes_read"])
    return read


# 23: MXFP4 (w2 shares of 16 columns: not whole scale blocks, read whole) + tied + MTP; 7: MXFP4 with 64-column
# w2, cut packed at 2 ranks (32 = one scale block each); 77: dense + tied + shared; 2: dense + q-LoRA + untied
@pytest.mark.parametrize("seed", [23, 7, 77, 2])
def test_shard_only_read_equals_full_read_then_cut(tmp_path, seed):
    d = tmp_path / "m"
    write_random_model(d, seed=seed, dtype=torch.float64)
    full = {}
    load_model_weights(d, dtype=torch.float64, stats=full)
    on_disk = sum(os.path.getsize(d / f) for f in os.listdir(d) if f.endswith(".safetensors"))
    assert 0 < full["bytes_read"] <= on_disk
    read = _check_all_ranks(d)
    cfg, _ = load_model_weights(d, dtype=torch.float64)
    if cfg.experts_mxfp4:  # the packed w2 is cut where each rank's columns are whole scale blocks
        name = f"model.layers.{cfg.moe_layer_ids[0]}.block_sparse_moe.experts.w2_packed"
        shape = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size // 2)
        for size in (2, 4):
            sel = selection(cfg, ShardPlan.make(cfg, 0, size, False), name, shape)
            assert sel.whole == bool((cfg.moe_intermediate_size // size) % 32), (size, sel)
    for ep in (False, True):
        assert max(read[2, ep]) < full["bytes_read"], read
        assert max(read[4, ep]) < min(read[2, ep]), read


def _rewrite(src, dst, transform):
    t = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(src, f), "pt") as fh:
                t.update({k: fh.get_tensor(k) for k in fh.keys()})
    os.makedirs(dst, exist_ok=True)
    save_file({k: v.contiguous() for k, v in transform(t).items()}, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(dst, "config.json"), "w") as g:
        g.write(f.read())


def test_fused_and_stacked_spellings_read_only_the_slices(tmp_path):
    """Row ranges of fused projections, whole stacked expert tensors, size-1 dims: the same shards."""
    seed = 35  # MoE (dense experts, a shared one) after two dense layers, q-LoRA MLA, full-rank KDA gate
    src = tmp_path / "src"
    write_random_model(src, seed=seed, dtype=torch.float64)
    cfg, _ = load_model_weights(src, dtype=torch.float64)
    assert cfg.num_experts and not cfg.experts_mxfp4 and cfg.q_lora_rank and cfg.use_full_rank_gate

    def fuse(t):
        for i in range(cfg.num_hidden_layers):
            a = f"model.layers.{i}.self_attn."
            if cfg.is_kda_layer(i):
                parts = [t.pop(a + n + ".weight") for n in ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj")]
                pad = torch.zeros((-sum(p.shape[0] for p in parts)) % 16, cfg.hidden_size, dtype=parts[0].dtype)
                t[a + "in_proj_qkvgfab.weight"] = torch.cat(parts + [pad])
                t[a + "conv1d.weight"] = torch.cat([t.pop(a + f"{x}_conv1d.weight") for x in "qkv"]).unsqueeze(1)
                t[a + "A_log"] = t.pop(a + "A_log").reshape(1, 1, -1, 1)
            else:
                t[a + "fused_qkv_a_g_proj.weight"] = torch.cat(
                    [t.pop(a + n + ".weight") for n in ("q_a_proj", "kv_a_proj_with_mqa", "g_proj")])
            m = f"model.layers.{i}.block_sparse_moe."
            if cfg.is_moe_layer(i):
                E = cfg.num_experts
                w13 = [torch.cat([t.pop(f"{m}experts.{e}.w1.weight"), t.pop(f"{m}experts.{e}.w3.weight")]) for e in range(E)]
                t[m + "experts.gate_up_proj"] = torch.stack(w13)
                t[m + "experts.down_proj"] = torch.stack([t.pop(f"{m}experts.{e}.w2.weight") for e in range(E)])
                s = m + "shared_experts."
                t[s + "gate_up_proj.weight"] = torch.cat([t.pop(s + "gate_proj.weight"), t.pop(s + "up_proj.weight")])
            else:
                p = f"model.layers.{i}.mlp."
                t[p + "gate_up_proj.weight"] = torch.cat([t.pop(p + "gate_proj.weight"), t.pop(p + "up_proj.weight")])
        return t

    _rewrite(src, tmp_path / "fused", fuse)
    _, a = load_model_weights(src, dtype=torch.float64)
    _, b = load_model_weights(tmp_path / "fused", dtype=torch.float64)
    _assert_same(a, b)  # the spellings are the same model
    read = _check_all_ranks(tmp_path / "fused", sizes=(2,))
    whole = {}
    load_model_weights(tmp_path / "fused", dtype=torch.float64, stats=whole)
    assert max(read[2, False]) < whole["bytes_read"]


def test_load_benchmark_smoke():
    """benchmarks/parallel_load.py runs and prints its ratios (tiny shapes, 2 ranks)."""
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "parallel_load.py"
    out = subprocess.run([sys.executable, str(bench), "--layers", "2", "--experts", "4", "--hidden", "256",
                          "--moe-intermediate", "128", "--ranks", "2"], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONSAFEPATH="1"), check=True).stdout
    rows = [line.split("|") for line in out.splitlines() if line.strip().startswith("2 ")]
    assert len(rows) == 2, out
    for r in rows:
        read_x, peak_x = (float(x) for x in r[-1].split())
        assert 0 < read_x < 0.75 and peak_x > 0, out
