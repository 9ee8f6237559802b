"""Speculative decoding in the engine (workers/engine/spec/): greedy with speculation == greedy without ==
the reference forward (float64, token for token), on random configs and prompts, with prefix caching,
chunked prefill and batching on, for both KDA rollback schemes, k in {1, 3}, with three drafters:

* `ngram` and `mtp` (the checkpoint's MTP layer, here UNTRAINED: random weights) — the real proposers;
  on random models they are rarely right, so they mostly exercise rejection;
* an oracle drafter (test-only) that knows the reference continuation and corrupts each draft with
  probability 1/3, so accepted runs of every length 0..k and rejections at every position happen.

Also: a commit crossing a retained prefix-cache boundary leaves the exact snapshot (a resend of
prompt + output hits a snapshot written by a commit and still continues as the reference), preemption
(drafts dropped), stops inside an accepted run, the MTP drafter == workers/model/mtp.py `mtp_propose`,
logprobs, and the bad-input errors.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _engine_helpers import random_model_dir, reference_outputs, tight_kv_budget

from k3serve.sampling_params import SamplingParams
from k3serve.workers.engine.spec.config import speculative_config_from
from k3serve.workers.llm import LLM
from k3serve.workers.model.testing import random_config

MTP_SEEDS = [s for s in range(40) if random_config(s).num_nextn_predict_layers > 0][:4]
MAX_NEW = 20  # reference tokens per prompt; engines generate FIRST of them, the resend checks the rest
FIRST = 14


class OracleDrafter:
    """Drafts the reference continuation, each draft replaced by a random token with probability 1/3."""

    needs_hidden = False

    def __init__(self, refs: dict[tuple[int, ...], list[int]], k: int, vocab: int, seed: int):
        self.refs, self.k, self.vocab, self.seed = refs, k, vocab, seed

    def observe(self, req, start, hidden, verified):
        pass

    def propose(self, req) -> list[int]:
        seq = req.all_token_ids
        for prompt, ref in self.refs.items():  # the reference sequence this one is a prefix of
            full = list(prompt) + ref
            if len(seq) < len(full) and full[:len(seq)] == seq:
                rng = random.Random(hash((self.seed, len(seq), prompt)))
                nxt = full[len(seq):len(seq) + self.k]
                return [t if rng.random() > 1 / 3 else rng.randrange(self.vocab) for t in nxt]
        return []

    def drop(self, request_id):
        pass


_CACHE: dict = {}


def _setup(tmp_path_factory, seed: int):
    """Model dir, prompts (with shared prefixes and repeats, so the prefix cache hits and n-grams match),
    and the reference's greedy continuations; once per seed."""
    if seed not in _CACHE:
        d = random_model_dir(tmp_path_factory.mktemp(f"spec{seed}"), seed)
        cfg = random_config(seed)
        rng = random.Random(seed)
        V = cfg.vocab_size
        base = [rng.randrange(V) for _ in range(rng.randint(12, 24))]
        motif = [rng.randrange(V) for _ in range(4)]
        prompts = [base + [rng.randrange(V) for _ in range(rng.randint(2, 10))],
                   base + motif * 3,
                   (motif + [rng.randrange(V)]) * 4,
                   [rng.randrange(V) for _ in range(rng.randint(3, 30))]]
        _CACHE[seed] = (d, cfg, prompts, reference_outputs(d, prompts, MAX_NEW))
    return _CACHE[seed]


def _llm(d, spec, **kw) -> LLM:
    kw.setdefault("max_num_batched_tokens", 24)  # chunked prefill; verify chunks share steps with prefills
    # snapshots every 8 tokens (a unit of 8): verify commits cross retained boundaries often
    return LLM(str(d), dtype="float64", skip_tokenizer_init=True, enable_prefix_caching=True, prefix_match_unit=8,
               prefix_cache_retention_interval=8, speculative_config=spec, **kw)


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def _record_commits(llm) -> list[tuple[str, int]]:
    """(request id, absolute boundary) of every snapshot a rollback commit wrote."""
    seen: list[tuple[str, int]] = []
    kv = llm.engine.kv_manager
    orig = kv.commit_spec

    def wrapped(req, start, verified):
        out = orig(req, start, verified)
        seen.extend((req.request_id, start + off) for off, _blocks in out)
        return out

    kv.commit_spec = wrapped
    return seen


CASES = [(rb, k, drafter) for drafter in ("oracle", "ngram", "mtp") for rb in ("multi_slot", "recover_ssm")
         for k in (1, 3)]


@pytest.mark.parametrize("rollback,k,drafter", CASES)
def test_greedy_with_speculation_equals_reference(tmp_path_factory, rollback, k, drafter):
    seed = MTP_SEEDS[CASES.index((rollback, k, drafter)) % len(MTP_SEEDS)]
    d, cfg, prompts, ref = _setup(tmp_path_factory, seed)
    spec = {"method": "mtp" if drafter == "mtp" else "ngram", "num_speculative_tokens": k, "rollback": rollback}
    if drafter == "ngram":
        spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
    llm = _llm(d, spec)
    if drafter == "oracle":
        llm.engine.proposer = OracleDrafter({tuple(p): r for p, r in zip(prompts, ref)}, k, cfg.vocab_size, seed)
    commits = _record_commits(llm)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(FIRST))]
    assert out == [r[:FIRST] for r in ref]
    st = llm.engine.stats()
    assert st["spec_decode_num_draft_tokens"] > 0
    assert st["spec_decode_num_draft_tokens"] >= st["spec_decode_num_accepted_tokens"]
    if drafter == "oracle":  # both outcomes, at every position
        assert st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"]
        assert all(n > 0 for n in st["spec_decode_num_accepted_tokens_per_pos"])
        assert commits, "no commit crossed a retained boundary"
    # resend prompt + output: the hit reaches a snapshot of the first run; the continuation is the reference's
    resend = [p + r[:FIRST] for p, r in zip(prompts, ref)]
    outs = llm.generate(resend, _greedy(MAX_NEW - FIRST))
    assert [o.outputs[0].token_ids for o in outs] == [r[FIRST:] for r in ref]
    assert all(o.num_cached_tokens >= 8 for o in outs)
    if drafter == "oracle":
        first_ids = {rid for rid, _p in commits}
        assert any(o.num_cached_tokens in {p for _r, p in commits} for o in outs), (commits, first_ids)


@pytest.mark.parametrize("rollback", ["multi_slot", "recover_ssm"])
def test_preemption_drops_drafts(tmp_path_factory, rollback):
    seed = MTP_SEEDS[1]
    d, cfg, prompts, ref = _setup(tmp_path_factory, seed)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "rollback": rollback}
    kw = dict(enable_prefix_caching=True, speculative_config=spec, block_size=8)
    lay = LLM(str(d), dtype="float64", skip_tokenizer_init=True, max_model_len=64, **kw).engine.layout
    extra = len(lay.kda_groups) * (3 if rollback == "multi_slot" else 0)  # the spec slots of one request
    budget = tight_kv_budget(d, 64, 3 + extra, **kw)
    llm = LLM(str(d), dtype="float64", skip_tokenizer_init=True, kv_cache_memory=budget, max_num_batched_tokens=24,
              max_model_len=64, **kw)
    llm.engine.proposer = OracleDrafter({tuple(p): r for p, r in zip(prompts, ref)}, 3, cfg.vocab_size, seed)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(MAX_NEW))]
    assert out == ref
    st = llm.engine.stats()
    assert st["num_preemptions"] > 0 and st["spec_decode_num_accepted_tokens"] > 0


class TwinDrafter:
    """The MTP drafter's two forms on the same engine: both observe every step; the graph form's drafts are used
    and must equal the eager form's (preemption, prefix-cache hits: entries missing, recomputed, rows reused)."""

    needs_hidden = True

    def __init__(self, eager, graph):
        self.eager, self.graph, self.compared = eager, graph, 0

    def observe_batch(self, items):
        self.eager.observe_batch(items)
        self.graph.observe_batch(items)

    def propose_batch(self, reqs):
        a, b = self.graph.propose_batch(reqs), self.eager.propose_batch(reqs)
        assert a == b
        self.compared += sum(1 for d in a if d)
        return a

    def drop(self, request_id):
        self.eager.drop(request_id)
        self.graph.drop(request_id)


def test_graph_mtp_drafter_equals_eager_under_preemption_and_prefix_hits(tmp_path_factory):
    from k3serve.workers.engine.spec.mtp_graphs import GraphMTPProposer

    seed = MTP_SEEDS[1]
    d, cfg, prompts, ref = _setup(tmp_path_factory, seed)
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    kw = dict(enable_prefix_caching=True, speculative_config=spec, block_size=8)
    lay = LLM(str(d), dtype="float64", skip_tokenizer_init=True, max_model_len=64, **kw).engine.layout
    budget = tight_kv_budget(d, 64, 3 + 3 * len(lay.kda_groups), **kw)
    llm = LLM(str(d), dtype="float64", skip_tokenizer_init=True, kv_cache_memory=budget, max_num_batched_tokens=24,
              max_model_len=64, **kw)
    eager = llm.engine.proposer
    twin = llm.engine.proposer = TwinDrafter(eager, GraphMTPProposer(eager.cfg, llm.engine.runner.model.w,
                                                                     eager.dtype, 3, graphs=False, slots=1,
                                                                     positions=8))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(MAX_NEW))] == ref
    resend = [p + r[:FIRST] for p, r in zip(prompts, ref)]
    assert [o.outputs[0].token_ids for o in llm.generate(resend, _greedy(MAX_NEW - FIRST))] == [
        r[FIRST:] for r in ref]
    assert llm.engine.stats()["num_preemptions"] > 0 and twin.compared > 10


class PerfectDrafter(OracleDrafter):
    """Always drafts the reference continuation: every verify step accepts its whole run."""

    def propose(self, req) -> list[int]:
        seq = req.all_token_ids
        for prompt, r in self.refs.items():
            full = list(prompt) + r
            if len(seq) < len(full) and full[:len(seq)] == seq:
                return full[len(seq):len(seq) + self.k]
        return []


def test_stops_apply_inside_the_accepted_run(tmp_path_factory):
    seed = MTP_SEEDS[2]
    d, cfg, prompts, ref = _setup(tmp_path_factory, seed)
    llm = _llm(d, {"method": "ngram", "num_speculative_tokens": 3})
    llm.engine.proposer = PerfectDrafter({tuple(p): r for p, r in zip(prompts, ref)}, 3, cfg.vocab_size, seed)
    for i in range(len(prompts)):
        m = next((j for j in range(2, MAX_NEW) if ref[i][j] not in ref[i][:j]), None)  # a stop id first seen at m
        if m is None:
            continue
        o = llm.generate([prompts[i]], SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True,
                                                      stop_token_ids=[ref[i][m]]))[0].outputs[0]
        assert o.token_ids == ref[i][:m + 1] and o.finish_reason == "stop" and o.stop_reason == ref[i][m]
    for n in (1, 2, 5, 6):  # max_tokens never overshot, whatever the run length
        o = llm.generate([prompts[0]], _greedy(n))[0].outputs[0]
        assert o.token_ids == ref[0][:n] and o.finish_reason == "length"
    st = llm.engine.stats()
    assert st["spec_decode_num_accepted_tokens"] == st["spec_decode_num_draft_tokens"] > 0


@pytest.mark.parametrize("form", ["eager", "graph"])
@pytest.mark.parametrize("seed", MTP_SEEDS[:3])  # a dense, a LatentMoE and an MXFP4-MoE MTP layer
def test_mtp_drafts_equal_the_reference_drafter(tmp_path_factory, seed, form):
    """Both drafter forms (proposers.py MTPProposer, and mtp_graphs.py GraphMTPProposer: the fixed-shape steps
    CUDA replays as graphs, here run eagerly, its pool started at 1 request x 16 positions so it grows)."""
    from k3serve.workers.engine.spec.mtp_graphs import GraphMTPProposer
    from k3serve.workers.model.mtp import mtp_propose
    from k3serve.workers.model.reference import load_reference_model

    d, cfg, prompts, ref = _setup(tmp_path_factory, seed)
    k = 3
    llm = LLM(str(d), dtype="float64", skip_tokenizer_init=True, max_num_batched_tokens=32,
              speculative_config={"method": "mtp", "num_speculative_tokens": k})
    prop = llm.engine.proposer
    if form == "graph":
        prop = llm.engine.proposer = GraphMTPProposer(prop.cfg, llm.engine.runner.model.w, prop.dtype, k,
                                                      graphs=False, slots=1, positions=16)
    seen: list[tuple[list[int], list[int]]] = []
    orig = prop.propose_batch
    batched = []

    def record(reqs):
        drafts = orig(reqs)
        batched.append(len(reqs))
        seen.extend((list(r.all_token_ids), d) for r, d in zip(reqs, drafts))
        return drafts

    prop.propose_batch = record
    if form == "graph":  # greedy verify steps draft inside verify_and_draft (the one-wait step, llm_engine.py)
        vd, drafts_for = prop.verify_and_draft, prop.drafts_for

        def record_fused(items, logits, hidden):
            batched.append(len(items))
            return vd(items, logits, hidden)

        def record_for(req, d):
            out = drafts_for(req, d)
            if out:
                seen.append((list(req.all_token_ids), out))
            return out

        prop.verify_and_draft, prop.drafts_for = record_fused, record_for
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:3], _greedy(8))] == [r[:8] for r in ref[:3]]
    model = load_reference_model(str(d), dtype=torch.float64)
    assert len(seen) >= 9 and max(batched) > 1  # several requests drafted in one batch
    for toks, drafts in seen:
        target_next, want = mtp_propose(model, toks[:-1], k)
        assert target_next == toks[-1]
        assert drafts == want
    if form == "graph":  # the fixed-shape steps ran, and the pool grew in both directions
        assert prop.num_eager > len(batched) and prop._pool["S"] >= 3 and prop._pool["L"] > 16


def test_logprobs_with_speculation_equal_without(tmp_path_factory):
    seed = MTP_SEEDS[3]
    d, cfg, prompts, ref = _setup(tmp_path_factory, seed)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    base = LLM(str(d), dtype="float64", skip_tokenizer_init=True).generate(prompts[:2], sp)
    llm = _llm(d, {"method": "ngram", "num_speculative_tokens": 3})
    llm.engine.proposer = OracleDrafter({tuple(p): r for p, r in zip(prompts, ref)}, 3, cfg.vocab_size, seed)
    got = llm.generate(prompts[:2], sp)
    assert llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0
    for a, b in zip(base, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for ea, eb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert ea.keys() == eb.keys()
            for t in ea:
                assert abs(ea[t].logprob - eb[t].logprob) < 1e-9 and ea[t].rank == eb[t].rank


@pytest.mark.parametrize("value,needle", [
    ("{not json", "not valid JSON"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "unknown method 'eagle'"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "rollback": "undo"}', "unknown rollback 'undo'"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "k": 1}', "unknown key 'k'"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2}',
     "prompt_lookup_min (5) must be <= prompt_lookup_max (2)"),
    ("[1, 2]", "expected a JSON object"),
])
def test_bad_speculative_config_is_one_clear_error(value, needle):
    with pytest.raises(ValueError, match="speculative_config: ") as e:
        speculative_config_from(value)
    assert needle in str(e.value)


def test_bad_speculative_config_on_the_command_line(tiny_model_dir, tmp_path):
    r = subprocess.run([sys.executable, "-m", "k3serve.cli", "worker", "--model", str(tiny_model_dir),
                        "--speculative-config", '{"method": "mtp", "num_speculative_tokens": -1}'],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "argument --speculative-config: speculative_config: num_speculative_tokens" \
        in r.stderr, r.stderr
    # the model-dependent check: mtp on a checkpoint without an MTP layer (an engine error: one line, exit 1)
    no_mtp = next(s for s in range(40) if random_config(s).num_nextn_predict_layers == 0)
    d = random_model_dir(Path(tmp_path), no_mtp)
    with pytest.raises(ValueError, match="method 'mtp' needs a checkpoint with an MTP layer"):
        LLM(str(d), skip_tokenizer_init=True, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="not implemented with tensor_parallel_size > 1"):
        LLM(str(d), skip_tokenizer_init=True, tensor_parallel_size=2,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_sampling_with_speculation_is_seeded_and_bounded(tmp_path_factory):
    """Random sampling goes through the rejection sampler (its distribution test: tests/test_spec_rejection.py);
    here: seeded requests are reproducible, n > 1 fans out, lengths and ids stay in bounds, and drafts are
    both accepted and rejected."""
    seed = MTP_SEEDS[0]
    d, cfg, prompts, ref = _setup(tmp_path_factory, seed)
    llm = _llm(d, {"method": "ngram", "num_speculative_tokens": 3, "rollback": "recover_ssm"})
    llm.engine.proposer = OracleDrafter({tuple(p): r for p, r in zip(prompts, ref)}, 3, cfg.vocab_size, seed)
    sp = SamplingParams(temperature=0.7, top_k=5, max_tokens=12, ignore_eos=True, seed=123, n=2)
    a = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, sp)]
    b = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, sp)]
    assert a == b
    assert all(len(t) == 12 and all(0 <= x < cfg.vocab_size for x in t) for o in a for t in o)
    st = llm.engine.stats()
    assert 0 < st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"]


@pytest.mark.skipif(not (Path(__file__).resolve().parents[1] / "models" / "k3-demo-stdlib" / "config.json").exists(),
                    reason="demo model not in the tree")
def test_structured_output_and_stop_strings_with_speculation():
    """A grammar-constrained request (the rejection sampler masks each verified position with the grammar
    advanced by the drafts before it) and a stop string met inside an accepted run: greedy output equals
    the engine without speculation (the trained demo model, float64, ngram drafts)."""
    import json

    from k3serve.workers.model.paths import DEMO_MODEL_DIR

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "n"], "additionalProperties": False}
    prompt = "def f(x):\n    return {'name': 'x', 'n': 1}\n\n\ndef g(x):\n    return {'name': 'x', 'n': 1}\n"
    base = LLM(str(DEMO_MODEL_DIR), dtype="float64", max_model_len=512)
    spec = LLM(str(DEMO_MODEL_DIR), dtype="float64", max_model_len=512,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    so = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={"json": schema})
    plain = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    runs: list[tuple[int, int, bool]] = []  # (output length before, tokens in the step's run, truncated)
    orig = spec.engine._process_run

    def record(s, toks, lps, now):
        n0 = len(s.req.output_token_ids) - len(toks)
        orig(s, toks, lps, now)
        if s.req.params.structured_outputs is None:
            runs.append((n0, len(toks), len(s.req.output_token_ids) - n0 < len(toks)))

    spec.engine._process_run = record
    want = base.generate([prompt, prompt], [so, plain])
    got = spec.generate([prompt, prompt], [so, plain])
    # a stop string that first appears with a token that is not the last of its step's accepted run
    ids, tok = want[1].outputs[0].token_ids, spec.tokenizer
    cands = [n0 + j for n0, n, _t in runs for j in range(n - 1)]
    stop = None
    for i in cands:
        before, upto = tok.decode(ids[:i]), tok.decode(ids[:i + 1])
        if len(upto) == len(before):
            continue
        # the shortest suffix of the text up to token i that does not occur before it: first complete at i
        stop = next((upto[-m:] for m in range(2, 16) if upto[-m:].strip() and upto[-m:] not in before), None)
        if stop is not None:
            break
    assert stop is not None, runs
    stopped = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
    want.append(base.generate(prompt, stopped)[0])
    runs.clear()
    got.append(spec.generate(prompt, stopped)[0])
    assert any(t for _n0, _n, t in runs), "the stop string did not cut an accepted run"
    for w, g in zip(want, got):
        assert (g.outputs[0].token_ids, g.outputs[0].text, g.outputs[0].finish_reason) == (
            w.outputs[0].token_ids, w.outputs[0].text, w.outputs[0].finish_reason)
    json.loads(got[0].outputs[0].text)
    assert got[2].outputs[0].finish_reason == "stop" and stop not in got[2].outputs[0].text
    assert spec.engine.stats()["spec_decode_num_accepted_tokens"] > 0


class ShortOracle(OracleDrafter):
    """The oracle's drafts cut to a random length 1..k: verify chunks of every length in one batch."""

    def propose(self, req) -> list[int]:
        d = OracleDrafter.propose(self, req)
        return d[: random.Random(hash((self.seed, req.num_tokens))).randint(1, self.k)] if d else d


@pytest.mark.parametrize("drafter", ["short-oracle", "mtp", "mtp-graph"])
def test_fixed_shape_verify_steps_equal_reference(tmp_path_factory, drafter):
    """static_decode=True: verify steps run as fixed-shape padded batches (what CUDA graphs replay,
    workers/engine/spec/static_verify.py), chunks shorter than 1 + k padded, decode steps as fixed-shape decode
    batches that keep the hidden states; `mtp-graph`: the drafter's fixed-shape form too
    (workers/engine/spec/mtp_graphs.py, run eagerly here); tokens == reference."""
    from k3serve.workers.engine.spec.mtp_graphs import GraphMTPProposer

    seed = MTP_SEEDS[1]
    d, cfg, prompts, ref = _setup(tmp_path_factory, seed)
    k = 3
    mtp = drafter.startswith("mtp")
    llm = _llm(d, {"method": "mtp" if mtp else "ngram", "num_speculative_tokens": k},
               static_decode=True, max_num_batched_tokens=64)
    commits = _record_commits(llm)
    if not mtp:
        llm.engine.proposer = ShortOracle({tuple(p): r for p, r in zip(prompts, ref)}, k, cfg.vocab_size, seed)
    elif drafter == "mtp-graph":
        prop = llm.engine.proposer
        llm.engine.proposer = GraphMTPProposer(prop.cfg, llm.engine.runner.model.w, prop.dtype, k, graphs=False)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(MAX_NEW))]
    assert out == ref
    sv = llm.engine.runner.static_verify
    assert sv is not None and sv.num_steps > 0
    if mtp:  # the decode steps between verify steps took the fixed-shape decode batch (with hidden states)
        assert llm.engine.runner.num_static_decode_steps > 0
    if not mtp:
        assert llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0 and commits
        resend = [p + r[:FIRST] for p, r in zip(prompts, ref)]  # the commits' snapshots are exact
        assert [o.outputs[0].token_ids for o in llm.generate(resend, _greedy(MAX_NEW - FIRST))] == [
            r[FIRST:] for r in ref]


def test_ngram_drafter_is_the_reference_rule():
    """The engine's vectorized prompt lookup == workers/model/ngram_proposer.py on random repetitive ids."""
    from k3serve.workers.engine.spec.proposers import NgramDrafter
    from k3serve.workers.model.ngram_proposer import NgramProposer

    rng = random.Random(0)
    for case in range(400):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        k = rng.randint(1, 4)
        V = rng.choice([2, 3, 5, 20])
        ids = [rng.randrange(V) for _ in range(rng.randint(1, 40))]
        assert NgramDrafter(k, lo, hi).propose_ids(ids) == NgramProposer(k, lo, hi).propose(ids), (case, ids)
