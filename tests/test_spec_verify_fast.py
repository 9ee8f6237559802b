"""The short-chunk KDA path of verify steps (kernels/cpu/kda_verify.py) == the conv + gate + chunked form.

Random shapes in float64: sequences of 1..9 tokens (padded rows with slot -1, rows without an initial
state), multi-slot style exports after 1..T-1 tokens, a repeated export and one aimed at another
sequence's running slot; outputs, every state slot and every conv window compared with the composed form
on the reference ops and on the CPU ops, and the fast path checked to be the one that ran.
"""

from __future__ import annotations

import random

import pytest
import torch

from k3serve.kernels import ops, reference
from k3serve.kernels.cpu import kda_verify as kv


def _case(rng: random.Random, seed: int, long: bool = False):
    g = torch.Generator().manual_seed(seed)
    dt = torch.float64
    h, K, V = rng.choice([1, 2, 3]), rng.choice([4, 8, 16]), rng.choice([4, 8, 16])
    W = rng.choice([2, 3, 4])
    C = 2 * h * K + h * V
    B = rng.randint(1, 5)
    same = rng.random() < 0.4
    L = rng.randint(1, kv.MAX_TOKENS)
    lens = [L if same else rng.randint(1, kv.MAX_TOKENS) for _ in range(B)]
    if long:  # one sequence the token walk does not take
        lens[rng.randrange(B)] = rng.randint(kv.MAX_TOKENS + 1, 3 * kv.MAX_TOKENS)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    T = cu[-1]
    num_slots = 2 * B + cu[-1] + 2
    perm = rng.sample(range(num_slots), num_slots)
    slots = perm[:B]
    if B > 1 and rng.random() < 0.4:
        slots[rng.randrange(B)] = -1  # a padding row
    init = [rng.random() < 0.8 for _ in range(B)]
    free = perm[B:]
    seq, off, dst = [], [], []
    for b in range(B):
        if slots[b] < 0 and rng.random() < 0.5:
            continue
        for t in range(1, lens[b] + 1):
            if rng.random() < 0.7:
                seq.append(b)
                off.append(t)
                dst.append(free.pop())
    if seq and rng.random() < 0.5:  # the same export twice
        seq.append(seq[0])
        off.append(off[0])
        dst.append(dst[0])
    live = [b for b in range(B) if slots[b] >= 0]
    if len(live) > 1 and rng.random() < 0.3:  # an export into another sequence's running slot: it wins
        b0, b1 = live[0], live[1]
        seq.append(b0)
        off.append(rng.randint(1, lens[b0]))
        dst.append(slots[b1])
    scale = 2.0
    inputs = dict(
        qkv=torch.randn(T, C, generator=g, dtype=dt),
        conv_weight=torch.randn(C, 1, W, generator=g, dtype=dt) * 0.5,
        conv_states=torch.randn(num_slots, C, W - 1, generator=g, dtype=dt),
        raw_g=torch.randn(T, h, K, generator=g, dtype=dt) * scale,
        A_log=torch.randn(h, generator=g, dtype=dt) * 0.3,
        dt_bias=torch.randn(h * K, generator=g, dtype=dt),
        beta_logit=torch.randn(T, h, generator=g, dtype=dt),
        state_pool=torch.randn(num_slots, h, V, K, generator=g, dtype=dt),
        state_indices=torch.tensor(slots),
        cu_seqlens=torch.tensor(cu),
        has_initial_state=torch.tensor(init),
    )
    kw = dict(lower_bound=rng.choice([None, -5.0]), scale=rng.choice([None, K ** -0.5 * 0.9]))
    if seq:
        kw.update(checkpoint_seq=torch.tensor(seq), checkpoint_offsets=torch.tensor(off),
                  checkpoint_slots=torch.tensor(dst))
    return inputs, kw


def _run(fn, inputs, kw, **extra):
    x = {k: v.clone() for k, v in inputs.items()}
    o = fn(*x.values(), **kw, **extra)
    return o, x["state_pool"], x["conv_states"]


@pytest.mark.parametrize("seed", range(40))
def test_kda_verify_equals_chunked_form(seed, monkeypatch):
    rng = random.Random(seed)
    inputs, kw = _case(rng, seed)
    ref = _run(kv.kda_verify_composed, inputs, kw, conv=reference.causal_conv1d_varlen, gate=reference.kda_gate,
               chunked=reference.kda_chunked)
    cpu = _run(kv.kda_verify_composed, inputs, kw)  # the CPU conv and kda_chunked
    calls = []
    monkeypatch.setattr(kv, "kda_verify_composed", lambda *a, **k: calls.append(1))
    fast = _run(kv.kda_verify, inputs, kw)
    assert not calls, "the token walk fell back to the composed form"
    for name, a, b, c in zip(("o", "state_pool", "conv_states"), ref, cpu, fast):
        assert a.dtype == c.dtype == torch.float64, name
        torch.testing.assert_close(c, a, rtol=1e-10, atol=1e-10, msg=name)
        torch.testing.assert_close(c, b, rtol=1e-10, atol=1e-10, msg=name)


def test_kda_verify_hands_long_chunks_to_the_chunked_form(monkeypatch):
    rng = random.Random(7)
    inputs, kw = _case(rng, 7, long=True)
    real = kv.kda_verify_composed
    calls = []
    monkeypatch.setattr(kv, "kda_verify_composed", lambda *a, **k: calls.append(1) or real(*a, **k))
    ref = _run(real, inputs, kw, conv=reference.causal_conv1d_varlen, gate=reference.kda_gate,
               chunked=reference.kda_chunked)
    out = _run(kv.kda_verify, inputs, kw)
    assert calls == [1]  # the fallback ran
    for a, b in zip(ref, out):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)


def test_ops_kda_verify_dispatch(monkeypatch):
    """ops.kda_verify: the token walk on the CPU, the composed form of the ops with K3SERVE_KERNELS set."""
    rng = random.Random(3)
    inputs, kw = _case(rng, 3)
    seen = []
    monkeypatch.setattr(kv, "kda_verify", lambda *a, **k: seen.append("walk") or "walk")
    assert ops.kda_verify(*inputs.values(), **kw) == "walk"
    ref = _run(kv.kda_verify_composed, inputs, kw, conv=reference.causal_conv1d_varlen, gate=reference.kda_gate,
               chunked=reference.kda_chunked)
    monkeypatch.setenv("K3SERVE_KERNELS", "reference")
    real = reference.kda_chunked
    monkeypatch.setattr(reference, "kda_chunked", lambda *a, **k: seen.append("reference") or real(*a, **k))
    out = _run(ops.kda_verify, inputs, kw)
    assert seen == ["walk", "reference"]  # the composed form through ops' dispatch (here: the reference op)
    for a, b in zip(ref, out):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)


def test_mtp_drafts_of_one_request_equal_the_reference_drafter(tmp_path):
    """The MTP drafter's batch-1 form (keys without padding, workers/engine/spec/proposers.py) == mtp_propose,
    and the engine's greedy tokens with it == the reference forward (float64, a random MTP config)."""
    from _engine_helpers import random_model_dir, reference_outputs

    from k3serve.sampling_params import SamplingParams
    from k3serve.workers.llm import LLM
    from k3serve.workers.model.mtp import mtp_propose
    from k3serve.workers.model.reference import load_reference_model
    from k3serve.workers.model.testing import random_config

    seed = next(s for s in range(40) if random_config(s).num_nextn_predict_layers > 0)
    d = random_model_dir(tmp_path, seed)
    rng = random.Random(seed)
    prompt = [rng.randrange(random_config(seed).vocab_size) for _ in range(11)]
    ref = reference_outputs(d, [prompt], 10)[0]
    k = 3
    llm = LLM(str(d), dtype="float64", skip_tokenizer_init=True, max_num_seqs=1,
              speculative_config={"method": "mtp", "num_speculative_tokens": k})
    prop = llm.engine.proposer
    seen = []
    orig = prop.propose_batch

    def record(reqs):
        drafts = orig(reqs)
        assert len(reqs) <= 1
        seen.extend((list(r.all_token_ids), dr) for r, dr in zip(reqs, drafts))
        return drafts

    prop.propose_batch = record
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == ref
    model = load_reference_model(str(d), dtype=torch.float64)
    assert len(seen) >= 3 and all(len(dr) == k for _t, dr in seen)
    for toks, drafts in seen:
        assert mtp_propose(model, toks[:-1], k) == (toks[-1], drafts)
