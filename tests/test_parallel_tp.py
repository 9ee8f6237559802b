"""Tensor and expert parallelism on CPU ranks (gloo, one process per rank; workers/engine/parallel/).

Greedy float64 tokens of a TP / TP+EP engine equal the single-rank engine's and the reference forward's,
on random configs (AttnRes, MXFP4, LatentMoE with its norm, shared experts, tied and padded vocabularies),
with prefix caching (a second round over shared prefixes hits the cache) and chunked prefill (a 16-token
step budget); an unshardable layout is one clear error before any rank starts; a killed rank makes the
next step fail within the bound and no rank process is left behind.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time

import pytest
from _engine_helpers import engine_outputs, random_model_dir, reference_outputs

from k3serve.workers.engine.parallel.launcher import RankFailedError
from k3serve.workers.engine.parallel.shard import ExpertMap
from k3serve.workers.llm import LLM
from k3serve.workers.model.testing import random_config

MAX_NEW = 5
OPTS = dict(dtype="float64", skip_tokenizer_init=True, enable_prefix_caching=True, max_num_batched_tokens=16,
            block_size=16)


def _prompts(seed: int, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """Two rounds: the second shares the first round's prefixes (>= one block), so it hits the cache."""
    rng = random.Random(seed)
    first = [[rng.randrange(vocab) for _ in range(rng.randint(18, 40))] for _ in range(3)]
    second = [p[: rng.randint(17, len(p))] + [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
              for p in first]
    return first, second


def _run(llm: LLM, rounds) -> list[list[int]]:
    return [toks for prompts in rounds for toks in engine_outputs(llm, prompts, MAX_NEW)]


@pytest.mark.parametrize("seed,tp,ep", [(23, 2, False), (77, 2, True), (2, 4, True)],
                         ids=["tp2-attnres-mxfp4", "tp2-ep-latentmoe", "tp4-ep"])
def test_tp_greedy_equals_single_rank_and_reference(tmp_path_factory, seed, tp, ep):
    cfg = random_config(seed)
    d = random_model_dir(tmp_path_factory.getbasetemp(), seed)
    rounds = _prompts(seed, cfg.vocab_size)
    ref = reference_outputs(d, [p for r in rounds for p in r], MAX_NEW)
    single = _run(LLM(str(d), **OPTS), rounds)
    llm = LLM(str(d), tensor_parallel_size=tp, enable_expert_parallel=ep, **OPTS)
    try:
        assert len(llm.engine.runner.peers) == tp - 1
        got = _run(llm, rounds)
        stats = llm.engine.stats()
    finally:
        llm.engine.runner.close()
    assert got == single == ref
    assert stats["prefix_cache_hits"] > 0
    assert not multiprocessing.active_children()


def test_kda_page_per_rank_shrinks_with_tp(tmp_path_factory):
    import torch

    from k3serve.workers.engine.cache_layout import plan_cache_layout

    cfg = random_config(2)
    one, two = (plan_cache_layout(cfg, torch.float64, 16, tp_size=n) for n in (1, 2))
    assert two.ssm_shape[0] * 2 == one.ssm_shape[0] and two.conv_channels * 2 == one.conv_channels
    assert two.kda_page_used < one.kda_page_used and two.mla_page_used == one.mla_page_used


def test_unshardable_layout_is_a_clear_error(tmp_path_factory):
    seed = next(s for s in range(100) if random_config(s).kda_num_heads == 1 and random_config(s).kda_layer_ids)
    d = random_model_dir(tmp_path_factory.getbasetemp(), seed)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: this layout cannot shard the model: "
                                         r".*KDA heads \(1\) are not divisible by tensor_parallel_size=2"):
        LLM(str(d), tensor_parallel_size=2, **OPTS)
    assert not multiprocessing.active_children()  # refused before any rank started


def test_expert_map_places_every_expert_once():
    m = ExpertMap.contiguous(8, 2)
    assert m.physical == ((0, 1, 2, 3), (4, 5, 6, 7)) and m.owner(5) == (1, 1)
    assert m.local_index(1).tolist() == [-1, -1, -1, -1, 0, 1, 2, 3]
    moved = ExpertMap(4, ((3, 0), (1, 2)))  # a rebalanced placement
    assert moved.local_index(0).tolist() == [1, -1, -1, 0]
    with pytest.raises(ValueError, match="exactly once"):
        ExpertMap(4, ((0, 1), (1, 2)))


def test_killed_rank_fails_the_engine_within_the_bound(tmp_path_factory):
    d = random_model_dir(tmp_path_factory.getbasetemp(), 55)
    llm = LLM(str(d), tensor_parallel_size=2, **OPTS)
    runner = llm.engine.runner
    try:
        assert engine_outputs(llm, [[3, 4, 5, 6]], 2)
        (_rank, proc, _conn), = runner.peers
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RankFailedError, match="rank 1 exited"):
            engine_outputs(llm, [[3, 4, 5, 7]], 2)
        assert time.monotonic() - t0 < 10
        with pytest.raises(RankFailedError):  # stays failed: never a hang on the broken group
            runner.check_peers()
    finally:
        runner.close()
    assert not multiprocessing.active_children()


def test_comm_benchmark_counts_the_collectives_it_issues():
    import subprocess
    import sys

    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "parallel_comm.py")
    proc = subprocess.run([sys.executable, bench, "--tokens", "16", "--steps", "2", "--k3-tokens", "64", "--ranks", "4",
                           "--overhead-ranks", "2"], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONSAFEPATH="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "formula tp_collectives() == measured shapes: True" in proc.stdout
    assert "formula sp_collectives() == measured shapes: True" in proc.stdout
    assert "TEP+SP (implemented)" in proc.stdout and "ratio vs 1 rank" in proc.stdout
