"""RecoverSSM on a CUDA GPU: the Triton verify/fold (kernels/triton/kda_recover.py, reached through
kernels/kda_recover.py's dispatch) against the float64 reference on the CPU, and the engine with
speculative decoding under both rollback schemes against the float64 reference forward.

Unused state slots are NaN, so a kernel that reads or writes a slot it should not is caught; the
verify must leave the pool bit-for-bit unchanged.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from k3serve.kernels.kda_recover import kda_recover_commit_rows, kda_recover_fold, kda_recover_verify  # noqa: E402
from k3serve.sampling_params import SamplingParams  # noqa: E402
from k3serve.workers.llm import LLM  # noqa: E402
from k3serve.workers.model.reference import load_reference_model  # noqa: E402

DEV = "cuda"
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def rel(out, ref) -> float:
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,K", [(3, 64), (8, 128), (2, 8)])  # (2, 8): not a Triton shape -> reference on CUDA
def test_verify_and_fold_on_cuda_match_float64_reference(dtype, H, K):
    g = torch.Generator().manual_seed(H * 1000 + K)
    lens = [4, 1, 3, 2]
    T, R, tmax, V = sum(lens), len(lens), max(lens), K
    cu = torch.tensor([0] + lens).cumsum(0)
    q, k, v = (torch.randn(T, H, K, generator=g) for _ in range(3))
    gg = -torch.rand(T, H, K, generator=g) * 2
    beta = torch.rand(T, H, generator=g)
    nslots = 64
    pool = torch.full((nslots, H, V, K), float("nan"))
    slots = torch.tensor([7, 3, 11, 5])
    init = torch.tensor([True, True, False, True])
    pool[slots] = torch.randn(R, H, V, K, generator=g) * 0.3
    corr_ref = torch.zeros(R, tmax, H, V, dtype=torch.float64)
    o_ref = kda_recover_verify(q.double(), k.double(), v.double(), gg.double(), beta.double(), pool.double(),
                               slots, cu, init, corr_ref)
    dpool = pool.to(DEV)
    before = dpool.clone()
    corr = torch.full((R, tmax, H, V), float("nan"), device=DEV)
    args = [t.to(DEV, dtype) for t in (q, k, v)] + [gg.to(DEV), beta.to(DEV)]
    o = kda_recover_verify(*args, dpool, slots.to(DEV), cu.to(DEV), init.to(DEV), corr)
    torch.cuda.synchronize()
    assert torch.equal(dpool.isnan(), before.isnan()) and torch.equal(dpool.nan_to_num(), before.nan_to_num())
    assert rel(o, o_ref) < TOL[dtype]
    for r in range(R):
        assert rel(corr[r, : lens[r]], corr_ref[r, : lens[r]]) < TOL[dtype]
    # every accepted length of every row in one fold, out slots distinct from every checkpoint
    rows = [r for r in range(R) for _ in range(lens[r] + 1)]
    counts = [c for r in range(R) for c in range(lens[r] + 1)]
    outs = torch.arange(20, 20 + len(rows))
    kp, gp = torch.zeros(R, tmax, H, K), torch.zeros(R, tmax, H, K)
    for r in range(R):
        kp[r, : lens[r]], gp[r, : lens[r]] = k[cu[r] : cu[r + 1]], gg[cu[r] : cu[r + 1]]
    idx = torch.tensor(rows)
    ref = pool.double().clone()
    kda_recover_fold(ref, slots[idx], init[idx], kp[idx].double(), gp[idx].double(), corr_ref[idx],
                     torch.tensor(counts), outs)
    kda_recover_fold(dpool, slots[idx].to(DEV), init[idx].to(DEV), kp[idx].to(DEV, dtype), gp[idx].to(DEV),
                     corr[idx].contiguous(), torch.tensor(counts, device=DEV), outs.to(DEV))
    torch.cuda.synchronize()
    for s in outs.tolist():
        assert rel(dpool[s], ref[s]) < TOL[dtype], s
    untouched = torch.ones(nslots, dtype=torch.bool)
    untouched[outs] = False
    assert torch.equal(dpool[untouched].isnan().cpu(), pool[untouched].isnan())


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_commit_rows_on_cuda_match_float64_reference(lower_bound):
    """Three requests' commits in one call (one of them with snapshots), each longest length over its own
    checkpoint slot; every other slot stays NaN."""
    g = torch.Generator().manual_seed(17)
    T, H, K, W = 4, 3, 64, 3
    C = 3 * H * K
    kg, corr, xin = torch.randn(4, T, H, 2 * K, generator=g), torch.randn(4, T, H, K, generator=g), \
        torch.randn(4, T, C, generator=g)
    A_log, dt_bias = torch.randn(H, generator=g) * 0.3, torch.randn(H * K, generator=g)
    pool = torch.full((32, H, K, K), float("nan"))
    conv = torch.full((32, C, W), float("nan"))
    s0 = torch.tensor([3, 9, 5])
    pool[s0], conv[s0] = torch.randn(3, H, K, K, generator=g) * 0.3, torch.randn(3, C, W, generator=g)
    inits, recs, seg = torch.tensor([True, True, False]), torch.tensor([2, 0, 3]), torch.tensor([0, 3, 4, 5])
    counts, outs = torch.tensor([2, 3, 4, 1, 2]), torch.tensor([20, 21, 3, 9, 5])
    ref_pool, ref_conv = pool.double(), conv.double()
    kda_recover_commit_rows(ref_pool, ref_conv, s0, inits, recs, seg, kg.double(), corr.double(), xin.double(),
                            A_log.double(), dt_bias.double(), lower_bound, counts, outs)
    # bf16 records on the device: compare with the reference run on the same (rounded) records
    ref2_pool, ref2_conv = pool.double(), conv.double()
    kda_recover_commit_rows(ref2_pool, ref2_conv, s0, inits, recs, seg, kg.bfloat16().double(), corr.double(),
                            xin.bfloat16().double(), A_log.double(), dt_bias.double(), lower_bound, counts, outs)
    dp, dc = pool.clone().to(DEV), conv.clone().to(DEV)
    kda_recover_commit_rows(dp, dc, s0.to(DEV), inits.to(DEV), recs.to(DEV), seg.to(DEV), kg.to(DEV, torch.bfloat16),
                            corr.to(DEV), xin.to(DEV, torch.bfloat16), A_log.to(DEV), dt_bias.to(DEV), lower_bound,
                            counts.to(DEV), outs.to(DEV))
    torch.cuda.synchronize()
    for s in outs.tolist():
        assert rel(dp[s], ref2_pool[s]) < 1e-4, s
        assert rel(dc[s], ref2_conv[s]) < 1e-2, s
    others = torch.ones(32, dtype=torch.bool)
    others[outs] = False
    assert bool(dp[others].isnan().all()) and bool(dc[others].isnan().all())
    assert rel(ref_pool[20], ref2_pool[20]) < 2e-2  # bf16 records stay close to the float ones


def _check_near_argmax(ref, prompts, outs, margin=2e-3):
    exact = total = 0
    for p, out in zip(prompts, outs, strict=True):
        seq = list(p) + list(out[:-1])
        with torch.no_grad():
            lg = ref.logits(seq)[len(p) - 1:].double().cpu()
        for j, tok in enumerate(out):
            gap = float(lg[j].max() - lg[j][tok])
            assert gap <= margin * float(lg[j].abs().max().clamp_min(1.0)), (j, tok, gap)
            exact += int(tok == int(lg[j].argmax()))
            total += 1
    return exact, total


@pytest.mark.parametrize("rollback", ["multi_slot", "recover_ssm"])
def test_engine_speculative_greedy_on_cuda_both_schemes(tiny_model_dir, rollback):
    """ngram speculation (repetitive prompts, so drafts get accepted) with prefix caching, float32 on CUDA:
    every token within rounding of the float64 reference's argmax, most of them exactly it."""
    ref = load_reference_model(str(tiny_model_dir), dtype=torch.float64, device=DEV)
    vocab = ref.cfg.vocab_size
    g = torch.Generator().manual_seed(3)
    base = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 9, 13, 7)]
    prompts = [b * 4 for b in base]
    llm = LLM(str(tiny_model_dir), device=DEV, dtype="float32", skip_tokenizer_init=True, max_num_seqs=4,
              enable_prefix_caching=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "rollback": rollback})
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    exact, total = _check_near_argmax(ref, prompts, outs)
    assert exact >= 0.97 * total, (exact, total)
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 0, stats
    print(rollback, stats)
