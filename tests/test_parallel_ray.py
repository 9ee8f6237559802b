"""Ray as the rank launcher (workers/engine/parallel/ray_launcher.py, `distributed_executor_backend="ray"`):
TP=2 with rank 1 a Ray actor in a placement group gives the single-rank engine's and the reference's
greedy float64 tokens on a random config (prefix caching, chunked prefill); the local Ray it starts and
every rank listen on 127.0.0.1 only (checked with `ss` over this process's tree, Ray's own daemons
included); a killed rank actor fails the next step with RankFailedError within the bound.
One local Ray for the module (its start-up takes seconds), as small as it goes: 2 CPUs, no dashboard."""

from __future__ import annotations

import os
import time

import pytest
import ray  # pinned in constraints.txt, installed by scripts/install.sh
from _engine_helpers import engine_outputs, random_model_dir, reference_outputs

from k3serve.sampling_params import SamplingParams
from k3serve.workers.engine.parallel import ray_launcher
from k3serve.workers.engine.parallel.launcher import RankFailedError
from k3serve.workers.llm import LLM
from k3serve.workers.model.testing import random_config
from tests._proc_tree import _listeners, _tree

MAX_NEW = 4
OPTS = dict(dtype="float64", skip_tokenizer_init=True, enable_prefix_caching=True, max_num_batched_tokens=16,
            block_size=16, tensor_parallel_size=2)


@pytest.fixture(scope="module")
def local_ray():
    assert ray_launcher.ensure_ray(2) is True  # started here: loopback only
    try:
        yield
    finally:
        ray.shutdown()


def _rounds(seed: int, vocab: int):
    import random

    rng = random.Random(seed)
    first = [[rng.randrange(vocab) for _ in range(rng.randint(18, 36))] for _ in range(2)]
    return [first, [p[:17] + [rng.randrange(vocab)] for p in first]]


@pytest.mark.parametrize("seed,ep", [(77, True)])
def test_ray_tp2_greedy_equals_single_rank_and_reference_loopback_only(local_ray, tmp_path_factory, seed, ep):
    cfg = random_config(seed)
    d = random_model_dir(tmp_path_factory.getbasetemp(), seed)
    rounds = _rounds(seed, cfg.vocab_size)
    ref = reference_outputs(d, [p for r in rounds for p in r], MAX_NEW)
    single_opts = {k: v for k, v in OPTS.items() if k != "tensor_parallel_size"}
    single = [t for r in rounds for t in engine_outputs(LLM(str(d), **single_opts), r, MAX_NEW)]
    llm = LLM(str(d), distributed_executor_backend="ray", enable_expert_parallel=ep, **OPTS)
    try:
        (rank, handle, _), = llm.engine.runner.peers
        assert rank == 1 and isinstance(handle, ray_launcher.RayRank)
        actor_pid = ray.get(handle.actor.ping.remote())
        assert actor_pid != os.getpid()
        got = [t for r in rounds for t in engine_outputs(llm, r, MAX_NEW)]
        stats = llm.engine.stats()
        bound = _listeners(_tree(os.getpid()))
        names = {n for n, _a in bound}
        assert {"raylet", "gcs_server"} <= names and actor_pid in _tree(os.getpid()), bound
        assert all(a.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")) for _n, a in bound), bound
    finally:
        llm.engine.runner.close()
    assert got == single == ref
    assert stats["prefix_cache_hits"] > 0
    assert not ray.util.placement_group_table() or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def test_ray_killed_rank_fails_the_next_step(local_ray, tmp_path_factory):
    d = random_model_dir(tmp_path_factory.getbasetemp(), 77)
    llm = LLM(str(d), distributed_executor_backend="ray", enable_expert_parallel=True, **OPTS)
    try:
        (_rank, handle, _), = llm.engine.runner.peers
        ray.kill(handle.actor, no_restart=True)
        t0 = time.monotonic()
        with pytest.raises(RankFailedError, match=r"tensor-parallel rank 1 exited \(status lost: its Ray actor died"):
            while time.monotonic() - t0 < 10:
                llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        assert time.monotonic() - t0 < 10
    finally:
        llm.engine.runner.close()


def test_ray_group_larger_than_the_cluster_is_a_clear_error(local_ray, tmp_path_factory, monkeypatch):
    monkeypatch.setattr(ray_launcher, "PLACEMENT_TIMEOUT_S", 1.0)
    d = random_model_dir(tmp_path_factory.getbasetemp(), 2)  # a config that shards over 4 ranks
    with pytest.raises(ValueError, match=r"ray: no room for a placement group of 4 one-CPU bundles within 1 s"):
        LLM(str(d), distributed_executor_backend="ray", enable_expert_parallel=True,
            **dict(OPTS, tensor_parallel_size=4))
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
