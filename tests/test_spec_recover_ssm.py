"""RecoverSSM (kernels/kda_recover.py, workers/engine/spec/recover_ssm.py): the verify gives
ops.kda_chunked's outputs without writing the checkpoint, and the committed state (recurrent state and
conv window) equals the state recomputed from scratch after every accepted length, on random shapes and
random model configs, in float64."""

from __future__ import annotations

import random

import _triton_cpu  # (sets TRITON_INTERPRET=1 on CPU-only machines before any Triton kernel is built)
import pytest
import torch

from k3serve.kernels import ops
from k3serve.kernels.kda_recover import conv_window_fold, kda_recover_fold, kda_recover_verify
from k3serve.workers.engine.cache_layout import KVCacheTensors, plan_cache_layout
from k3serve.workers.engine.forward_batch import ForwardBatch
from k3serve.workers.engine.k3_forward import K3ForwardModel
from k3serve.workers.engine.spec.recover_ssm import RecoverSSMRollback
from k3serve.workers.engine.spec.rollback import VerifyRow, default_kda_mix, scheme_class
from k3serve.workers.model.init_weights import init_weights
from k3serve.workers.model.testing import random_config

torch.set_num_threads(1)
F64 = torch.float64


def _rand_case(seed):
    r = random.Random(seed)
    H, K, V = r.choice([1, 2, 3]), r.choice([2, 4, 8]), r.choice([3, 4, 8])
    lens = [r.randint(1, 7) for _ in range(r.randint(1, 4))]
    T = sum(lens)
    g = torch.Generator().manual_seed(seed)
    x = dict(q=torch.randn(T, H, K, generator=g, dtype=F64), k=torch.randn(T, H, K, generator=g, dtype=F64),
             v=torch.randn(T, H, V, generator=g, dtype=F64),
             g=-torch.rand(T, H, K, generator=g, dtype=F64) * r.choice([0.1, 1.0, 5.0]),
             beta=torch.rand(T, H, generator=g, dtype=F64))
    pool = torch.randn(2 * len(lens) + 2, H, V, K, generator=g, dtype=F64)
    slots = torch.tensor(r.sample(range(pool.shape[0] - 1), len(lens)))
    init = torch.tensor([r.random() < 0.8 for _ in lens])
    cu = torch.tensor([0] + lens).cumsum(0)
    return x, lens, cu, pool, slots, init


@pytest.mark.parametrize("seed", range(8))
def test_verify_equals_kda_chunked_and_fold_equals_recomputed_state(seed):
    x, lens, cu, pool, slots, init = _rand_case(seed)
    R, tmax = len(lens), max(lens)
    H, V, K = pool.shape[1:]
    ref_pool = pool.clone()
    o_ref = ops.kda_chunked(x["q"], x["k"], x["v"], x["g"], x["beta"], ref_pool, slots, cu, init)
    corr = torch.zeros(R, tmax, H, V, dtype=F64)
    work = pool.clone()
    chunk = random.Random(seed).choice([64, 2, 3])  # also the multi-chunk walk
    o = kda_recover_verify(x["q"], x["k"], x["v"], x["g"], x["beta"], work, slots, cu, init, corr, chunk_size=chunk)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-12)
    assert torch.equal(work, pool), "the verify wrote a state"
    spare = pool.shape[0] - 1
    for r in range(R):
        s, n = int(cu[r]), lens[r]
        pad = {name: torch.zeros((1, tmax) + t.shape[1:], dtype=F64) for name, t in x.items() if name in "kg"}
        pad["k"][0, :n], pad["g"][0, :n] = x["k"][s : s + n], x["g"][s : s + n]
        for c in range(n + 1):  # accepted drafts 0..n-1 -> c = 1..n tokens kept; c = 0 keeps S0
            got = pool.clone()
            kda_recover_fold(got, slots[r : r + 1], init[r : r + 1], pad["k"], pad["g"], corr[r : r + 1],
                             torch.tensor([c]), torch.tensor([spare]))
            want = pool.clone()
            if c:
                ops.kda_recurrent(*(x[name][s : s + c] for name in ("q", "k", "v", "g", "beta")), want,
                                  slots[r : r + 1], torch.tensor([0, c]), init[r : r + 1])
                expect = want[slots[r]]
            else:
                expect = pool[slots[r]] if init[r] else torch.zeros_like(pool[0])
            torch.testing.assert_close(got[spare], expect, rtol=0, atol=1e-12)
        if n == tmax and init[r]:
            assert torch.allclose(got[spare], ref_pool[slots[r]], rtol=0, atol=1e-12)  # full fold == chunked


@pytest.mark.parametrize("seed", range(8))
def test_cpu_token_walk_equals_the_chunked_verify(seed):
    """recover_ssm.py `_verify_walk` (the CPU verify of short chunks) == kda_recover_verify: outputs and
    corrections, ragged and equal-length rows, S0 read and never written."""
    from k3serve.workers.engine.spec.recover_ssm import _verify_walk

    x, lens, cu, pool, slots, init = _rand_case(seed)
    if seed % 2:  # every row the same length (the dense layout): the first len(lens) * lens[0] tokens
        lens = [lens[0]] * len(lens)
        T = sum(lens)
        g = torch.Generator().manual_seed(seed)
        x = {name: torch.randn(T, *t.shape[1:], generator=g, dtype=F64) for name, t in x.items()}
        x["g"], x["beta"] = -x["g"].abs(), torch.sigmoid(x["beta"])
        cu = torch.tensor([0] + lens).cumsum(0)
    R, tmax = len(lens), max(lens)
    H, V, K = pool.shape[1:]
    want_c = torch.zeros(R + 1, tmax + 1, H, V, dtype=F64)
    got_c = want_c.clone()
    o_ref = kda_recover_verify(x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots, cu, init, want_c)
    before = pool.clone()
    o = _verify_walk(x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots.tolist(), init.tolist(), lens, got_c,
                     scale=K ** -0.5)
    assert torch.equal(pool, before)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-11)
    torch.testing.assert_close(got_c, want_c, rtol=0, atol=1e-11)


@pytest.mark.parametrize("seed", range(6))
def test_cpu_conv_walk_equals_the_varlen_conv(seed):
    """recover_ssm.py `_conv_walk` == ops.causal_conv1d_varlen (silu) on a copy of the windows, which it never writes."""
    from k3serve.workers.engine.spec.recover_ssm import _conv_walk

    r = random.Random(seed)
    C, W = r.choice([6, 12]), r.choice([2, 3, 4])
    lens = [r.randint(1, 9) for _ in range(r.randint(1, 4))]
    if seed % 2:
        lens = [lens[0]] * len(lens)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), C, generator=g, dtype=F64)
    w = torch.randn(C, 1, W, generator=g, dtype=F64)
    pool = torch.randn(2 * len(lens) + 1, C, W - 1, generator=g, dtype=F64)
    slots = r.sample(range(pool.shape[0]), len(lens))
    init = [r.random() < 0.7 for _ in lens]
    before = pool.clone()
    got = _conv_walk(x, w, pool, slots, init, lens)
    assert torch.equal(pool, before)
    want = ops.causal_conv1d_varlen(x, w, pool[torch.tensor(slots)], torch.arange(len(lens)),
                                    torch.tensor([0] + lens).cumsum(0), torch.tensor(init), activation="silu")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_fold_reads_every_checkpoint_before_writing():
    """Several lengths of one row folded at once, one of them into the checkpoint's own slot."""
    x, lens, cu, pool, slots, init = _rand_case(3)
    n = lens[0]
    H, V, K = pool.shape[1:]
    corr = torch.zeros(len(lens), max(lens), H, V, dtype=F64)
    kda_recover_verify(x["q"], x["k"], x["v"], x["g"], x["beta"], pool.clone(), slots, cu, init, corr)
    kk, gg = x["k"][:n].unsqueeze(0), x["g"][:n].unsqueeze(0)
    corr0 = corr[:1, :n]
    one = []
    for c in range(n + 1):
        p = pool.clone()
        kda_recover_fold(p, slots[:1], init[:1], kk, gg, corr0, torch.tensor([c]), torch.tensor([pool.shape[0] - 1]))
        one.append(p[-1])
    many = pool.clone()
    outs = [int(slots[0])] + [pool.shape[0] - 1]  # the checkpoint's own slot first
    counts = [n, max(n - 1, 0)]
    kda_recover_fold(many, slots[:1].expand(2), init[:1].expand(2), kk.expand(2, -1, -1, -1),
                     gg.expand(2, -1, -1, -1), corr0.expand(2, -1, -1, -1), torch.tensor(counts), torch.tensor(outs))
    torch.testing.assert_close(many[outs[0]], one[counts[0]], rtol=0, atol=0)
    torch.testing.assert_close(many[outs[1]], one[counts[1]], rtol=0, atol=0)


@pytest.mark.parametrize("width", [2, 3, 4])
def test_conv_window_fold_equals_conv_state_after_prefix(width):
    g = torch.Generator().manual_seed(width)
    C, n = 5, 6
    pool = torch.randn(4, C, width - 1, generator=g, dtype=F64)
    xs = torch.randn(n, C, generator=g, dtype=F64)
    w = torch.randn(C, width, generator=g, dtype=F64)
    for init in (True, False):
        for c in range(n + 1):
            want = pool.clone()
            ops.causal_conv1d_varlen(xs[:c], w, want, torch.tensor([1]), torch.tensor([0, c]), torch.tensor([init]))
            got = pool.clone()
            conv_window_fold(got, torch.tensor([1]), torch.tensor([init]), xs.unsqueeze(0), torch.tensor([c]),
                             torch.tensor([3]))
            assert torch.equal(got[3], want[1])


def test_bad_arguments_are_clear_errors():
    x, lens, cu, pool, slots, init = _rand_case(1)
    H, V, K = pool.shape[1:]
    with pytest.raises(ValueError, match="corrections"):
        kda_recover_verify(x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots, cu, init,
                           torch.zeros(len(lens), 0, H, V, dtype=F64))
    with pytest.raises(ValueError, match="num_tokens"):
        kda_recover_fold(pool, slots[:1], init[:1], torch.zeros(1, 2, H, K, dtype=F64),
                         torch.zeros(1, 2, H, K, dtype=F64), torch.zeros(1, 2, H, V, dtype=F64),
                         torch.tensor([3]), torch.tensor([0]))


# ------------------------------------------------------------------------------------------------
# The scheme on a real K3ForwardModel: verify rows next to a prefill, against the default KDA path
# with a checkpoint export after every token (what the multi-slot scheme relies on).
# ------------------------------------------------------------------------------------------------


def _model(seed):
    cfg = random_config(seed)
    layout = plan_cache_layout(cfg, F64)
    kv = KVCacheTensors(layout, num_blocks=540)
    g = torch.Generator().manual_seed(seed)
    for j in range(layout.group_size):  # random states and windows in every block (the running blocks' S0)
        kv.ssm_view(j).copy_(torch.randn(kv.ssm_view(j).shape, generator=g, dtype=F64) * 0.3)
        kv.conv_view(j).copy_(torch.randn(kv.conv_view(j).shape, generator=g, dtype=F64))
    model = K3ForwardModel(cfg, init_weights(cfg, seed=seed, device="cpu", dtype=F64), layout, kv, F64)
    return cfg, layout, kv, model


def _batch(lens, state_idx, has_init, ckpt=None):
    B, T = len(lens), sum(lens)
    cu = torch.tensor([0] + lens).cumsum(0)
    seq, off, slots = ckpt if ckpt else (None, None, None)
    return ForwardBatch(
        input_ids=torch.zeros(T, dtype=torch.long), positions=torch.zeros(T, dtype=torch.long), cu_seqlens=cu,
        seq_lens=torch.tensor(lens), block_tables=[], slot_mapping=[], state_indices=state_idx,
        has_initial_state=torch.tensor(has_init), checkpoint_seq=seq, checkpoint_offsets=off,
        checkpoint_slots=slots, logits_indices=torch.zeros(B, dtype=torch.long))


@pytest.mark.parametrize("seed,with_prefill", [(0, True), (3, True), (11, True), (5, False)])
def test_scheme_commit_equals_recomputed_state_for_every_accepted_length(seed, with_prefill):
    cfg, layout, kv, model = _model(seed)
    assert scheme_class("recover_ssm") is RecoverSSMRollback
    ngroups = len(layout.kda_groups)
    r = random.Random(seed)
    k = r.randint(2, 4)
    T = 1 + k
    lens = [T, r.randint(1, T)] + [5] * with_prefill  # two verified rows (the second with fewer drafts), a prefill
    nseq = len(lens)
    kda_layers = [(i, gi, j) for gi, grp in enumerate(layout.kda_groups) for j, i in enumerate(grp.layer_ids)]
    h, d, _ = layout.ssm_shape
    gen = torch.Generator().manual_seed(seed + 1)
    inputs = {i: (torch.randn(sum(lens), 3 * h * d, generator=gen, dtype=F64),
                  torch.randn(sum(lens), h, d, generator=gen, dtype=F64),
                  torch.randn(sum(lens), h, generator=gen, dtype=F64)) for i, _, _ in kda_layers}
    run = [[10 + gi, 20 + gi, 30 + gi] for gi in range(ngroups)]  # per group: the three sequences' blocks
    state_idx = [torch.tensor(b[:nseq]) for b in run]
    has_init = [True, True, False][:nseq]
    orig = [p.clone() for p in kv.pages]

    # the oracle: the default path, exporting the state after every token of the verified rows
    pairs = [(s, o) for s in (0, 1) for o in range(1, lens[s] + 1)]

    def spare(s, o, gi):  # the oracle's export block of sequence s after o tokens, in KDA group gi
        return 100 + 20 * gi + 8 * s + o

    ck = (torch.tensor([s for s, _ in pairs]), torch.tensor([o for _, o in pairs]),
          [torch.tensor([spare(s, o, gi) for s, o in pairs]) for gi in range(ngroups)])
    ref_o = {}
    for i, gi, j in kda_layers:
        ref_o[i] = default_kda_mix(model, i, j, gi, *inputs[i], _batch(lens, state_idx, has_init, ck))
    ref_pages = [p.clone() for p in kv.pages]

    def state_at(pages, block, j):
        view = KVCacheTensors(layout, kv.num_blocks)
        view.pages = pages
        return view.ssm_view(j)[block].clone(), view.conv_view(j)[block].clone()

    rows = [VerifyRow(f"r{s}", s, start=9, num_tokens=lens[s], running_slots=[run[gi][s] for gi in range(ngroups)],
                      spec_slots=[[] for _ in range(ngroups)]) for s in (0, 1)]
    for a0 in range(1, T + 1):  # accepted length of row 0 (1 = every draft rejected)
        a1 = r.randint(1, lens[1])
        for p, o in zip(kv.pages, orig):
            p.copy_(o)
        scheme = RecoverSSMRollback(kv, layout, k, max_num_seqs=4)
        # the batch also asks for the offset-1 export of row 0 (as the scheduler does at a block boundary)
        ck1 = (torch.tensor([0]), torch.tensor([1]), [torch.tensor([90 + gi]) for gi in range(ngroups)])
        batch = _batch(lens, state_idx, has_init, ck1)
        scheme.begin_verify(rows, batch)
        assert batch.spec.kda_mix == scheme.kda_mix and not batch.is_decode
        assert scheme._step.whole == (not with_prefill)
        for i, gi, j in kda_layers:
            o = batch.spec.kda_mix(model, i, j, gi, *inputs[i], batch)
            torch.testing.assert_close(o, ref_o[i], rtol=0, atol=1e-12)
            for s in (0, 1):  # the verify did not touch the running blocks
                assert torch.equal(kv.ssm_view(j)[run[gi][s]], state_at(orig, run[gi][s], j)[0])
                assert torch.equal(kv.conv_view(j)[run[gi][s]], state_at(orig, run[gi][s], j)[1])
            if with_prefill:  # the prefill row went through the default path
                for a, b in zip(state_at(kv.pages, run[gi][2], j), state_at(ref_pages, run[gi][2], j)):
                    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
            for a, b in zip(state_at(kv.pages, 90 + gi, j), state_at(ref_pages, spare(0, 1, gi), j)):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-12)  # the batch's offset-1 export
        snap = a0 if a0 >= 2 else None  # a retained boundary inside the accepted run of row 0
        scheme.commit(rows[0], a0, [(snap, [70 + gi for gi in range(ngroups)])] if snap else [])
        scheme.commit(rows[1], a1, [])
        scheme.end_verify()
        for _, gi, j in kda_layers:
            for s, a in ((0, a0), (1, a1)):
                for got, want in zip(state_at(kv.pages, run[gi][s], j), state_at(ref_pages, spare(s, a, gi), j)):
                    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
            if snap:
                for got, want in zip(state_at(kv.pages, 70 + gi, j), state_at(ref_pages, spare(0, snap, gi), j)):
                    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_state_bytes_and_no_extra_slots():
    cfg, layout, kv, _ = _model(0)
    s = RecoverSSMRollback(kv, layout, 3, max_num_seqs=2)
    h, d, _ = layout.ssm_shape
    n_kda = sum(len(g.layer_ids) for g in layout.kda_groups)
    item = torch.empty((), dtype=layout.conv_dtype).element_size()
    per = 4 * (h * d * 8 + h * 2 * d * item + layout.conv_channels * item)  # T = 4; fp64 corrections
    assert s.state_bytes() == 2 * n_kda * per
    assert RecoverSSMRollback.extra_slots(3) == 0
    with pytest.raises(ValueError, match="did not verify"):
        s.commit(VerifyRow("x", 0, 0, 2, [0], [[]]), 1, [])


@_triton_cpu.skip_on_cuda
def test_triton_verify_and_fold_match_the_reference_under_the_interpreter():
    """kernels/triton/kda_recover.py (token-serial, fp32) against the float64 reference ops."""
    from k3serve.kernels.triton.kda_recover import kda_recover_fold_triton, kda_recover_verify_triton

    g = torch.Generator().manual_seed(5)
    H, K, V, lens = 2, 16, 32, [4, 1, 3]
    T, R, tmax = sum(lens), len(lens), max(lens)
    cu = torch.tensor([0] + lens).cumsum(0)
    x = [torch.randn(T, H, K, generator=g), torch.randn(T, H, K, generator=g), torch.randn(T, H, V, generator=g),
         -torch.rand(T, H, K, generator=g), torch.rand(T, H, generator=g)]
    pool = torch.randn(8, H, V, K, generator=g)
    slots, init = torch.tensor([5, 1, 2]), torch.tensor([True, False, True])
    corr_ref = torch.zeros(R, tmax, H, V, dtype=F64)
    o_ref = kda_recover_verify(*(t.double() for t in x), pool.double(), slots, cu, init, corr_ref)
    corr = torch.full((R, tmax, H, V), float("nan"))
    work = pool.clone()
    o = kda_recover_verify_triton(*x, work, slots, cu, init, corr)
    assert torch.equal(work, pool)
    assert _triton_cpu.rel(o, o_ref) < 1e-5
    for r in range(R):
        assert _triton_cpu.rel(corr[r, : lens[r]], corr_ref[r, : lens[r]]) < 1e-5
    # fold every accepted length of every row at once, one of them into a checkpoint's own slot
    rows = [r for r in range(R) for _ in range(lens[r] + 1)]
    counts = [c for r in range(R) for c in range(lens[r] + 1)]
    outs = list(range(100, 100 + len(rows)))
    outs[0] = int(slots[1])  # row 0's fold lands in row 1's checkpoint, which later rows still read
    kp, gp = torch.zeros(R, tmax, H, K), torch.zeros(R, tmax, H, K)
    for r in range(R):
        kp[r, : lens[r]], gp[r, : lens[r]] = x[1][cu[r] : cu[r + 1]], x[3][cu[r] : cu[r + 1]]
    idx = torch.tensor(rows)
    big = torch.cat([pool, torch.zeros(100 + len(rows) - 8, H, V, K)])
    ref = big.double().clone()
    kda_recover_fold(ref, slots[idx], init[idx], kp[idx].double(), gp[idx].double(), corr_ref[idx],
                     torch.tensor(counts), torch.tensor(outs))
    kda_recover_fold_triton(big, slots[idx], init[idx], kp[idx], gp[idx], corr[idx],
                            torch.tensor(counts, dtype=torch.int32), torch.tensor(outs))
    for o_slot in outs:
        assert _triton_cpu.rel(big[o_slot], ref[o_slot]) < 1e-5, o_slot


def test_kernels_benchmark_smoke(capsys):
    """benchmarks/spec_decode_kernels.py runs both schemes and prints the table (tiny shape, one iteration)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "spec_decode_kernels.py"
    spec = importlib.util.spec_from_file_location("spec_decode_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--device", "cpu", "--shapes", "small", "--batch", "2", "--k", "2", "--iters", "1"])
    out = capsys.readouterr().out
    line = [ln for ln in out.splitlines() if ln.startswith("small")]
    assert len(line) == 1
    cells = line[0].split()
    assert int(cells[10]) == 2 * (2 * 16 * 16 * 4 + 3 * 2 * 16 * 3 * 4)  # k (state + conv window), float32
    assert int(cells[11]) == 3 * (2 * 16 * 4 + 2 * 2 * 16 * 4 + 3 * 2 * 16 * 4)  # T (u + key|gate + conv in)


@_triton_cpu.skip_on_cuda
@pytest.mark.parametrize("lower_bound,init", [(None, True), (-5.0, True), (-2.5, False)])
def test_triton_commit_matches_the_reference_under_the_interpreter(lower_bound, init):
    """kernels/triton/kda_recover.py's fused commit (gate + fold + conv windows) of two requests in one
    launch against the reference composition, each request's longest length written over its own
    checkpoint slot."""
    from k3serve.kernels.kda_recover import kda_recover_commit_rows
    from k3serve.kernels.triton.kda_recover import kda_recover_commit_rows_triton

    g = torch.Generator().manual_seed(int(init) + (0 if lower_bound is None else 7))
    T, H, K, W = 4, 2, 16, 3
    C = 3 * H * K
    key_gate = torch.randn(2, T, H, 2 * K, generator=g)
    corr = torch.randn(2, T, H, K, generator=g)
    conv_in = torch.randn(2, T, C, generator=g)
    A_log, dt_bias = torch.randn(H, generator=g) * 0.3, torch.randn(H * K, generator=g)
    pool = torch.randn(10, H, K, K, generator=g)
    conv = torch.randn(10, C, W, generator=g)
    s0, inits, recs = torch.tensor([3, 5]), torch.tensor([init, True]), torch.tensor([1, 0])
    seg = torch.tensor([0, 4, 6])
    counts, outs = torch.tensor([1, 2, 2, 4, 0, 3]), torch.tensor([7, 8, 9, 3, 6, 5])  # 3, 5: the checkpoints
    ref_pool, ref_conv = pool.double(), conv.double()
    kda_recover_commit_rows(ref_pool, ref_conv, s0, inits, recs, seg, key_gate.double(), corr.double(),
                            conv_in.double(), A_log.double(), dt_bias.double(), lower_bound, counts, outs)
    kda_recover_commit_rows_triton(pool, conv, s0, inits, recs, seg, key_gate, corr, conv_in, A_log, dt_bias,
                                   lower_bound, counts, outs)
    for s in outs.tolist():
        assert _triton_cpu.rel(pool[s], ref_pool[s]) < 1e-5, s
        assert torch.allclose(conv[s].double(), ref_conv[s], rtol=0, atol=1e-6), s
    for s in (0, 1, 2, 4):  # untouched
        assert torch.equal(pool[s].double(), ref_pool[s]) and torch.equal(conv[s].double(), ref_conv[s])


