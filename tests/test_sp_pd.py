"""Sequence parallelism with P/D and with speculative decoding, for real: a TEP+SP prefill worker
(`k3serve worker --role prefill --tensor-parallel-size 2 --expert-parallel --enable-sequence-parallel`: the
residual stream sharded by token between the attention layers, workers/engine/parallel/seq_parallel.py; its
caches are TP's, each rank's KDA head slice in its own pages) feeds, over NIXL (UCX over shared memory),

* a one-rank decode worker WITH speculation (MTP, 3 draft tokens): the production shape, a TEP prefill pool
  and a speculating decode pool (speculation-only state is outside the pages NIXL exchanges), and
* a DEP2 decode worker (`--data-parallel-size 2 --enable-expert-parallel`: the mission's TEP prefill -> DEP
  decode shape; each decode rank, attention TP=1, pulls its own requests' pages, MLA from prefill rank 0 and
  each prefill rank's KDA head slice into its offset of the rank's page, k3serve/common/pd_geometry.py).

Decode block 32 = 2 x prefill block 16; the decode workers' free pages are poisoned with 0xFF (NaN) first.
Greedy float64 tokens equal the plain reference forward's on a random config (with an MTP layer) and random
prompts, and the TP=1 pair's log-probabilities too (to 1e-9). Speculation on a TP>1 (so any SP) worker is
refused with one line before any rank starts (not implemented: the drafter and the verify path are TP=1).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import re

import httpx
import pytest

from k3serve.workers.model.testing import random_config
from tests._engine_helpers import random_model_dir, reference_outputs
from tests._pd_hops import _decode, _reference_logprobs, _together, decode_hop, prefill_hop
from tests._workers import _metric, _start, worker_group

SEED = 24  # random_config(24): 3 KDA + 2 MLA layers, MoE layers 2 and 4 (4 experts), one MTP layer
SP = ["--tensor-parallel-size", "2", "--expert-parallel", "--enable-sequence-parallel"]
SPEC = json.dumps({"method": "mtp", "num_speculative_tokens": 3})
POISON = {"K3SERVE_KV_POISON_FREE_PAGES": "1"}


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    model = random_model_dir(tmp_path_factory.mktemp("sp-pd"), SEED)
    procs = {"P": _start(model, "prefill", *SP, "--block-size", "16", "--enable-prefix-caching",
                         "--max-num-batched-tokens", "32"),
             "DS": _start(model, "decode", "--block-size", "32", "--kv-transfer-timeout", "5",
                          "--speculative-config", SPEC, env_extra=POISON),
             "D2": _start(model, "decode", "--data-parallel-size", "2", "--enable-expert-parallel", "--block-size",
                          "32", "--kv-transfer-timeout", "5", env_extra=POISON)}
    with worker_group(procs, stop_timeout=15) as out:
        yield model, out


def test_sp_prefill_to_speculating_and_dep_decode_equals_reference(pool):
    model, w = pool
    vocab = random_config(SEED).vocab_size
    rng = random.Random(SEED)
    # 3 tokens and more: the sequence-parallel prefill shards every batch of at least 2 tokens; 33+ tokens are
    # chunked (max-num-batched-tokens 32); the last one reuses a prefix the prefill worker cached
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (3, 18, 45, rng.randint(60, 100))]
    prompts.append(prompts[3][:40] + [rng.randrange(vocab) for _ in range(6)])
    max_new = 8
    want = reference_outputs(model, prompts, max_new)
    for i, prompt in enumerate(prompts):
        kvp = prefill_hop(w["P"], f"ds-p{i}", prompt, max_new)
        assert kvp.tp_size == 2 and kvp.block_size == 16
        toks, lps, res = _decode(w["DS"], f"ds-d{i}", prompt, max_new, kvp)
        assert toks == want[i], (i, res)
        ref = _reference_logprobs(model, prompt, toks)
        assert max(abs(a - b) for a, b in zip(lps, ref)) < 1e-9, (i, lps, ref)
        assert res["outcome"] == "pulled" and res["pulled_tokens"] == len(prompt) - 1, (i, res)
    # into the DEP2 decode worker: the decode hops sent together, so both decode ranks pull
    kvps = [prefill_hop(w["P"], f"d2-p{i}", prompt, max_new) for i, prompt in enumerate(prompts)]
    got = _together(lambda i: decode_hop(w["D2"], f"d2-d{i}", prompts[i], max_new, kvps[i]), len(prompts))
    for i, (toks, res) in enumerate(got):
        assert toks == want[i], (i, res)
        assert res["outcome"] == "pulled" and res["pulled_tokens"] == len(prompts[i]) - 1, (i, res)
    # each worker runs the layout asked for, as its engine reports it from the runner it built: the prefill
    # worker really runs the sequence-parallel model (k3serve_parallel_layout, workers/engine/parallel/launcher.py)
    def layouts(url):
        return [dict((k, int(v)) for k, v in re.findall(r'(tp|dp|ep|sp|nnodes)="(\d+)"', m.group(1)))
                for m in re.finditer(r"^k3serve_parallel_layout\{(.*)\} 1\.0$",
                                     httpx.get(url + "/metrics", timeout=10).text, re.M)]

    assert layouts(w["P"].murl) == [dict(tp=2, dp=1, ep=1, sp=1, nnodes=1)]
    assert layouts(w["DS"].murl) == [dict(tp=1, dp=1, ep=0, sp=0, nnodes=1)]
    assert layouts(w["D2"].murl) == [dict(tp=1, dp=2, ep=1, sp=0, nnodes=1)]
    text = httpx.get(w["DS"].murl + "/metrics", timeout=10).text
    assert _metric(text, "vllm:spec_decode_num_drafts_total") > 0  # the decode side did speculate
    assert _metric(httpx.get(w["P"].murl + "/metrics", timeout=10).text, "vllm:prefix_cache_hits_total") > 0


def test_speculation_with_sequence_parallelism_is_refused_before_any_rank_starts(tmp_path_factory):
    """The engine's one-line refusal (the worker prints it as `k3serve: error: ...`, exit 1), raised while
    checking the arguments: no rank process is spawned."""
    from k3serve.workers.llm import LLM

    model = random_model_dir(tmp_path_factory.mktemp("sp-pd"), SEED)
    before = set(mp.active_children())
    with pytest.raises(ValueError, match=r"^speculative_config: not implemented with tensor_parallel_size > 1$"):
        LLM(str(model), dtype="float64", skip_tokenizer_init=True, tensor_parallel_size=2, enable_expert_parallel=True,
            enable_sequence_parallel=True, speculative_config=json.loads(SPEC))
    assert set(mp.active_children()) == before
