"""Loose ends of multi-rank engines (workers/engine/parallel/): a node layout the worker refuses is refused
by the engine with the same message; each rank's torch threads are its share of the host's CPUs
(workers/engine/parallel/threads.py)."""

from __future__ import annotations

import argparse
import multiprocessing

import pytest
import torch
from _engine_helpers import engine_outputs, random_model_dir, reference_outputs

from k3serve.workers import worker
from k3serve.workers.engine.parallel import threads
from k3serve.workers.engine.parallel.nodes import layout_problem
from k3serve.workers.llm import LLM

OPTS = dict(dtype="float64", skip_tokenizer_init=True, max_num_batched_tokens=16, block_size=16)


@pytest.mark.parametrize("kw", [dict(nnodes=2), dict(nnodes=3, tensor_parallel_size=2), dict(node_rank=1)],
                         ids=["tp1-nnodes2", "tp2-nnodes3", "node-rank1-of-1"])
def test_engine_refuses_a_node_layout_as_the_worker_does(tmp_path_factory, kw):
    d = random_model_dir(tmp_path_factory.getbasetemp(), 55)
    tp, nnodes, node_rank = kw.get("tensor_parallel_size", 1), kw.get("nnodes", 1), kw.get("node_rank", 0)
    want = layout_problem(tp, nnodes, node_rank)
    assert want
    with pytest.raises(ValueError) as err:
        LLM(str(d), **kw, **OPTS)
    assert str(err.value) == want  # one line, the worker's words (below) in EngineArgs' spelling
    assert not multiprocessing.active_children()  # refused before any rank started
    p = argparse.ArgumentParser()
    worker.configure(p)
    flags = ["--model", str(d), "--tensor-parallel-size", str(tp), "--nnodes", str(nnodes),
             "--node-rank", str(node_rank)]
    said = worker.unsupported_layout(p.parse_args(flags))
    assert said == want.replace("nnodes", "--nnodes").replace("node_rank", "--node-rank").replace(
        "tensor_parallel_size", "--tensor-parallel-size")


@pytest.fixture
def keep_threads(monkeypatch):
    """Rank 0 is this process: give it back its thread count; no K3SERVE_RANK_THREADS from outside."""
    before = torch.get_num_threads()
    monkeypatch.delenv(threads.ENV, raising=False)
    yield monkeypatch
    torch.set_num_threads(before)


def test_rank_threads_are_the_host_cpu_share(keep_threads):
    keep_threads.setattr(threads, "host_cpus", lambda: 16)
    assert [threads.rank_threads(n) for n in (1, 2, 3, 8, 16, 32)] == [16, 8, 5, 2, 1, 1]
    assert threads.rank_threads(8, forced=3) == 3
    keep_threads.setenv(threads.ENV, "6")
    assert threads.rank_threads(2) == 6 and threads.rank_threads(2, forced=3) == 3
    for bad in ("0", "-2", "two"):
        keep_threads.setenv(threads.ENV, bad)
        with pytest.raises(ValueError, match=f"K3SERVE_RANK_THREADS='{bad}': must be a positive integer"):
            threads.rank_threads(2)


@pytest.mark.parametrize("layout", ["tp2", "dep2"])
def test_every_rank_runs_its_share_or_the_override(tmp_path_factory, keep_threads, layout):
    seed = 77  # random_config(77): LatentMoE, 16 experts (shardable over 2 ranks either way)
    d = random_model_dir(tmp_path_factory.getbasetemp(), seed)
    kw = (dict(tensor_parallel_size=2, enable_expert_parallel=True) if layout == "tp2"
          else dict(data_parallel_size=2, enable_expert_parallel=True))
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
    ref = reference_outputs(d, prompts, 3)
    for forced, want in ((None, threads.rank_threads(2)), (3, 3)):
        if forced is None:
            keep_threads.delenv(threads.ENV, raising=False)
        else:
            keep_threads.setenv(threads.ENV, str(forced))
        torch.set_num_threads(7)  # what rank 0 had before: replaced by its share too
        llm = LLM(str(d), **kw, **OPTS)
        try:
            assert llm.engine.runner.rank_threads == [want, want]  # each rank's report, rank 0 first
            assert torch.get_num_threads() == want
            assert engine_outputs(llm, prompts, 3) == ref
        finally:
            llm.engine.runner.close()
    assert not multiprocessing.active_children()


def test_a_malformed_override_is_refused_before_any_rank_starts(tmp_path_factory, keep_threads):
    d = random_model_dir(tmp_path_factory.getbasetemp(), 77)
    keep_threads.setenv(threads.ENV, "many")
    with pytest.raises(ValueError, match="K3SERVE_RANK_THREADS='many'"):
        LLM(str(d), tensor_parallel_size=2, **OPTS)
    assert not multiprocessing.active_children()


def test_rank_threads_benchmark_prints_both_rows_and_the_ratio(keep_threads):
    import os
    import subprocess
    import sys

    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "rank_threads.py")
    proc = subprocess.run([sys.executable, bench, "--tokens", "16", "--reps", "1"], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONSAFEPATH="1"))
    assert proc.returncode == 0, proc.stderr
    share = threads.rank_threads(2)
    assert f"ours [{share}, {share}]" in proc.stdout  # the threads the ranks reported, not the formula
    rows = {line.split("  ")[0] for line in proc.stdout.splitlines()}
    assert {"baseline / ours", f"ours: {share} (CPUs // ranks)"} <= rows
