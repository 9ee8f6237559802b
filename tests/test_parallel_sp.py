"""Sequence-parallel TEP (workers/engine/parallel/seq_parallel.py): TP attention, token-sharded residual
stream, MoE by all-to-all (workers/engine/parallel/moe_a2a.py), on CPU ranks (gloo).

Greedy float64 tokens equal the single-rank engine's and the reference forward's on random configs
(AttnRes with its block state per shard, MXFP4, LatentMoE with shared experts, dense layers), with
prefix caching (a second round hits the cache) and chunked prefill (16-token steps), and the steps
include token counts not divisible by the rank count (pad rows) and steps with fewer tokens than ranks
(the replicated TP step: a last round of one request decodes alone); the collectives issued are the SP ones.
The random models are often confident (greedy tokens hide small errors), so the top-4 logprobs of every
generated position must also equal the single-rank engine's to 1e-9 (float64: only the order of the
additions differs). A permuted (EPLB-style) expert placement gives the single rank's logits, step by step.
"""

from __future__ import annotations

import multiprocessing

import pytest
from _engine_helpers import random_model_dir, reference_outputs
from test_parallel_tp import OPTS, _prompts

from k3serve.sampling_params import SamplingParams
from k3serve.workers.engine.parallel.seq_parallel import SequenceParallelK3ForwardModel
from k3serve.workers.llm import LLM
from k3serve.workers.model.testing import random_config

MAX_NEW = 5


def _run(llm: LLM, rounds) -> tuple[list[list[int]], list[list[dict[int, float]]]]:
    """Greedy tokens and the top-4 logprobs at each generated position, round by round."""
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=4)
    outs = [o.outputs[0] for prompts in rounds for o in llm.generate(prompts, sp)]
    return ([o.token_ids for o in outs],
            [[{t: lp.logprob for t, lp in pos.items()} for pos in o.logprobs] for o in outs])


def assert_logprobs_close(got, want, tol=1e-9):
    for g_seq, w_seq in zip(got, want, strict=True):
        for g, w in zip(g_seq, w_seq, strict=True):
            assert g.keys() == w.keys(), (g, w)
            assert all(abs(g[t] - w[t]) <= tol for t in g), (g, w)


@pytest.mark.parametrize("seed,tp", [(23, 2), (64, 2), (27, 4)],
                         ids=["tp2-attnres-mxfp4", "tp2-latentmoe-shared-dense", "tp4-latentmoe-shared"])
def test_sp_greedy_equals_single_rank_and_reference(tmp_path_factory, monkeypatch, seed, tp):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the spawned ranks: one thread each, not all cores each
    cfg = random_config(seed)
    d = random_model_dir(tmp_path_factory.getbasetemp(), seed)
    first, second = _prompts(seed, cfg.vocab_size)
    rounds = (first, second, [first[0][:7]])
    ref = reference_outputs(d, [p for r in rounds for p in r], MAX_NEW)
    single, single_lp = _run(LLM(str(d), **OPTS), rounds)
    llm = LLM(str(d), tensor_parallel_size=tp, enable_expert_parallel=True, enable_sequence_parallel=True, **OPTS)
    runner = llm.engine.runner
    try:
        model = runner.model
        assert isinstance(model, SequenceParallelK3ForwardModel)
        sizes, forward = [], model.forward
        model.forward = lambda b: (sizes.append(int(b.input_ids.shape[0])), forward(b))[1]
        runner.group.log = []
        got, got_lp = _run(llm, rounds)
        log, runner.group.log = runner.group.log, None
        stats = llm.engine.stats()
    finally:
        runner.close()
    assert got == single == ref
    assert_logprobs_close(got_lp, single_lp)
    assert stats["prefix_cache_hits"] > 0
    assert any(t > tp and t % tp for t in sizes)  # ragged sharded steps (pad rows on the last ranks)
    assert any(t < tp for t in sizes)  # steps too small to shard: the replicated TP path
    names = {name for name, _shape, _item in log}
    assert {"reduce_scatter", "all_gather", "all_to_all"} <= names
    assert not multiprocessing.active_children()


def test_sp_without_expert_parallel_is_a_clear_error(tmp_path_factory):
    d = random_model_dir(tmp_path_factory.getbasetemp(), 64)
    with pytest.raises(ValueError, match="enable_sequence_parallel needs enable_expert_parallel"):
        LLM(str(d), tensor_parallel_size=2, enable_sequence_parallel=True, **OPTS)
    assert not multiprocessing.active_children()  # refused before any rank started


@pytest.mark.parametrize("sp", [False, True], ids=["tp-ep-allreduce", "tep-sp-all-to-all"])
def test_permuted_expert_map_gives_the_same_logits(tmp_path_factory, sp):
    """A rebalanced (EPLB-style) logical -> physical expert placement: the single-rank engine's step plans
    (prefix caching, chunked prefill) replayed on 2 ranks (threads, real gloo) whose experts sit in a
    random permutation give the single rank's logits (float64), with the routed experts expert-parallel
    by all-reduce (TP+EP) and by all-to-all (TEP+SP)."""
    import copy
    import dataclasses
    import random

    import torch
    from test_parallel_a2a import run_ranks

    from k3serve.workers.engine.cache_layout import plan_cache_layout
    from k3serve.workers.engine.parallel.launcher import ParallelModelRunner
    from k3serve.workers.engine.parallel.shard import ExpertMap, ShardPlan, shard_weights
    from k3serve.workers.model.loader import load_model_weights

    seed, n = 64, 2
    d = random_model_dir(tmp_path_factory.getbasetemp(), seed)
    llm = LLM(str(d), **OPTS)
    runner, steps = llm.engine.runner, []
    execute = runner.execute

    def record(sched):
        out = execute(sched)
        steps.append((copy.deepcopy(sched), None if out is None else out.clone()))
        return out

    runner.execute = record
    first, second = _prompts(seed, llm.engine.model_config.vocab_size)
    for prompts in (first, second):
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    cfg, weights = load_model_weights(str(d), dtype=torch.float64, device="cpu")
    perm = list(range(cfg.num_experts))
    random.Random(seed).shuffle(perm)
    per = cfg.num_experts // n
    emap = ExpertMap(cfg.num_experts, tuple(tuple(perm[r * per:(r + 1) * per]) for r in range(n)))
    assert emap != ExpertMap.contiguous(cfg.num_experts, n)
    layout = plan_cache_layout(cfg, torch.float64, 16, tp_size=n)
    eng = llm.engine

    def rank(group):
        plan = dataclasses.replace(ShardPlan.make(cfg, group.rank, n, True, sp), expert_map=emap)
        rank_cfg, shard = shard_weights(cfg, weights, plan, torch.float64)
        r = ParallelModelRunner(rank_cfg, shard, layout, eng.num_blocks, torch.float64, group=group, plan=plan,
                                max_num_batched_tokens=OPTS["max_num_batched_tokens"],
                                max_num_seqs=eng.args.max_num_seqs, max_model_len=eng.max_model_len)
        return [r.execute(copy.deepcopy(sched)) for sched, _ in steps]

    got = run_ranks(n, rank)[0]
    assert len(steps) > 4 and any(want is not None and want.shape[0] > 1 for _, want in steps)
    for (_sched, want), logits in zip(steps, got, strict=True):
        if want is None:
            assert logits is None
        else:
            torch.testing.assert_close(logits, want, rtol=0, atol=1e-9)
