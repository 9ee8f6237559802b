"""Triton KDA kernels under the CPU interpreter: chunked prefill, token-serial path, fused decode step."""

import _triton_cpu  # (sets TRITON_INTERPRET=1 first)
import pytest
import torch
from _triton_cpu import cu_of, rel

from k3serve.kernels import reference as R
from k3serve.kernels.triton.kda_chunk import ChunkPlan, kda_chunked_triton
from k3serve.kernels.triton.kda_decode import kda_decode_triton
from k3serve.kernels.triton.kda_recurrent import kda_recurrent_triton

pytestmark = _triton_cpu.skip_on_cuda

H, K, V = 2, 16, 32


def inputs(lens, seed, lower_bound=-5.0, a_log_scale=0.5):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q, k = torch.randn(T, H, K, generator=g), torch.randn(T, H, K, generator=g)
    v = torch.randn(T, H, V, generator=g)
    gg = R.kda_gate(
        torch.randn(T, H, K, generator=g),
        torch.randn(H, generator=g) * a_log_scale,
        torch.randn(H * K, generator=g),
        lower_bound,
    )
    beta = torch.sigmoid(torch.randn(T, H, generator=g))
    return q, k, v, gg, beta


def test_chunk_plan_cuts_at_checkpoints():
    plan = ChunkPlan(
        [0, 70, 70, 75], [3, 4, -1], {0: [(5, 9), (64, 8), (70, 7), (70, 6)]}, torch.device("cpu")
    )
    assert plan.chunk_start.tolist() == [0, 5, 64, 70]
    assert plan.chunk_len.tolist() == [5, 59, 6, 5]
    assert plan.chunk_ckpt.tolist() == [9, 8, 7, -1]
    assert plan.seq_first.tolist() == [0, 3, 3, 4]
    assert plan.extra_copies == [(7, 6)]


def test_plans_built_once_per_group_and_step(monkeypatch):
    """The engine calls the KDA layers of a step group by group in turn (layers 0, 1, 2 in groups 1, 2, 3: each group
    its own state slots, the same cu_seqlens): every group's plan is built once, reused for its later layers, rebuilt
    after an in-place write to an argument; with one cached plan (PLAN_CACHE_SIZE = 1) every layer rebuilds.
    Every layer's output and states == the reference."""
    from k3serve.kernels.triton import kda_chunk

    lens = [21, 5, 40]
    cu = cu_of(lens)
    init = torch.tensor([True, False, True])
    groups = [torch.tensor([0, 1, 2]), torch.tensor([5, 3, 4]), torch.tensor([8, 7, 6])]
    pool = torch.randn(9, H, V, K)
    ref_pool = pool.double()

    def layer(si, seed):
        q, k, v, gg, beta = inputs(lens, seed)
        ref = R.kda_chunked(q.double(), k.double(), v.double(), gg.double(), beta.double(), ref_pool, si, cu, init)
        out = kda_chunked_triton(q, k, v, gg, beta, pool, si, cu, init)
        assert rel(out, ref) < 1e-5 and rel(pool, ref_pool) < 1e-5

    def builds(n_layers):
        before = kda_chunk.PLAN_BUILDS[0]
        for i in range(n_layers):
            layer(groups[i % 3], i)
        return kda_chunk.PLAN_BUILDS[0] - before

    monkeypatch.setattr(kda_chunk, "_PLANS", [])
    assert builds(6) == 3  # two layers per group, one build per group
    assert builds(3) == 0  # same tensors, same versions: all reused
    groups[1][0] = 5  # an in-place write (same value) bumps the version: that group's plan is rebuilt
    assert builds(3) == 1
    monkeypatch.setattr(kda_chunk, "PLAN_CACHE_SIZE", 1)
    monkeypatch.setattr(kda_chunk, "_PLANS", [])
    assert builds(6) == 6  # only the last call's plan kept: every layer of the next group misses


def test_host_lists_replace_device_reads(monkeypatch):
    """With `host` (the engine's HostVarlen: the index arguments as lists) the chunk grid comes from the lists: output
    and states equal the call without it and the reference, checkpoints included; the plan is built once per HostVarlen
    (its memo), for every layer of the group; nothing of the tensors passed beside it is read back (`seq_starts` and
    `int_list` only ever see lists); and a new HostVarlen (the next step) builds again."""
    from k3serve.kernels.reference import _varlen
    from k3serve.kernels.triton import kda_chunk

    lens = [70, 13, 0, 1, 40]
    cu, si = cu_of(lens), torch.tensor([6, 2, 4, -1, 7])
    init = torch.tensor([True, False, True, False, True])
    ck = dict(checkpoint_seq=torch.tensor([0, 0, 4, 4, 1]), checkpoint_offsets=torch.tensor([3, 64, 17, 40, 13]),
              checkpoint_slots=torch.tensor([1, 3, 5, 8, 9]))
    host = _varlen.HostVarlen(cu.tolist(), si.tolist(), init.tolist(), *(t.tolist() for t in ck.values()))
    pool = torch.randn(12, H, V, K)
    pool_host, ref_pool = pool.clone(), pool.double()
    seen = []
    for name in ("seq_starts", "int_list"):
        orig = getattr(_varlen, name)
        monkeypatch.setattr(_varlen, name, lambda t, *a, _o=orig, **k: seen.append(type(t)) or _o(t, *a, **k))
    before = kda_chunk.PLAN_BUILDS[0]
    for layer in range(3):
        q, k, v, gg, beta = inputs(lens, 10 + layer)
        ref = R.kda_chunked(q.double(), k.double(), v.double(), gg.double(), beta.double(), ref_pool, si, cu, init,
                            **ck)
        seen.clear()
        with_host = kda_chunked_triton(q, k, v, gg, beta, pool_host, si, cu, init, **ck, host=host)
        assert all(t is list for t in seen), seen
        plain = kda_chunked_triton(q, k, v, gg, beta, pool, si, cu, init, **ck)
        assert torch.equal(with_host, plain) and torch.equal(pool_host, pool)
        assert rel(with_host, ref) < 1e-5 and rel(pool_host, ref_pool) < 1e-5
    assert list(host.memo) == [("kda_chunk", sum(lens), torch.device("cpu"))]
    builds = kda_chunk.PLAN_BUILDS[0] - before
    assert builds == 2  # one from the lists for all three layers, one (cached) for the tensor calls
    nxt = _varlen.HostVarlen(cu.tolist(), si.tolist(), init.tolist())
    q, k, v, gg, beta = inputs(lens, 20)
    kda_chunked_triton(q, k, v, gg, beta, pool_host, si, cu, init, host=nxt)
    assert kda_chunk.PLAN_BUILDS[0] - before == 3


@pytest.mark.parametrize("lens", [[1, 1, 2, 1], [1, 30, 0, 9]], ids=["decode-shaped", "prefill-shaped"])
def test_dispatch_with_host_lists(lens):
    """The engine passes `host` to ops.kda_chunked on every step: the Triton dispatcher takes it whichever form it
    picks (a batch of at most 2 tokens a sequence goes to the token-serial kernel, which has no use for it; it
    once failed there on the GPU with an unexpected keyword), with the reference's outputs and states."""
    from k3serve.kernels import triton_ops
    from k3serve.kernels.reference import _varlen

    cu, si = cu_of(lens), torch.tensor([3, 0, 5, 1])
    init = torch.tensor([True, False, True, True])
    host = _varlen.HostVarlen(cu.tolist(), si.tolist(), init.tolist())
    pool = torch.randn(8, H, V, K)
    ref_pool = pool.double()
    q, k, v, gg, beta = inputs(lens, 31)
    ref = R.kda_chunked(q.double(), k.double(), v.double(), gg.double(), beta.double(), ref_pool, si, cu, init)
    out = triton_ops._kda_chunked(q, k, v, gg, beta, pool, si, cu, init, chunk_size=64, host=host)
    assert rel(out, ref) < 1e-5 and rel(pool, ref_pool) < 1e-5


def test_upload_int32_packs_aligned_parts():
    from k3serve.kernels.triton.kda_chunk import upload_int32

    a, b, c = upload_int32([torch.arange(5), [7, -1], torch.tensor([], dtype=torch.int64)], torch.device("cpu"))
    assert a.tolist() == [0, 1, 2, 3, 4] and b.tolist() == [7, -1] and c.numel() == 0
    assert all(t.dtype == torch.int32 for t in (a, b, c))
    assert b.storage_offset() * 4 % 16 == 0 and b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()


def check_chunked(lower_bound, a_log_scale, **kw):
    # ragged, a zero-length and a padded sequence, slot reuse, checkpoints mid-chunk / at chunk ends / at
    # the end; a_log_scale 6 makes decays strong enough for the exact pairwise diagonal path
    lens = [70, 13, 0, 1, 40]
    q, k, v, gg, beta = inputs(lens, 1, lower_bound, a_log_scale)
    pool = torch.randn(12, H, V, K)
    untouched = pool[[0, 10, 11]].clone()
    si = torch.tensor([6, 2, 4, -1, 7])
    init = torch.tensor([True, False, True, False, True])
    ck = dict(
        checkpoint_seq=torch.tensor([0, 0, 4, 4, 1]),
        checkpoint_offsets=torch.tensor([3, 64, 17, 40, 13]),
        checkpoint_slots=torch.tensor([1, 3, 5, 8, 9]),
    )
    ref_pool = pool.double()
    ref = R.kda_chunked(
        q.double(), k.double(), v.double(), gg.double(), beta.double(), ref_pool, si, cu_of(lens), init, **ck
    )
    out = kda_chunked_triton(q, k, v, gg, beta, pool, si, cu_of(lens), init, **ck, **kw)
    assert rel(out, ref) < 1e-5
    assert rel(pool, ref_pool) < 1e-5
    assert torch.equal(pool[[0, 10, 11]], untouched)  # untouched slots keep their values


@pytest.mark.parametrize("lower_bound,a_log_scale", [(-5.0, 0.5), (None, 0.5), (None, 6.0)])
def test_chunked_matches_reference(lower_bound, a_log_scale):
    check_chunked(lower_bound, a_log_scale)


PREP = {"split": dict(prep_variant="split"), "onepass": dict(prep_variant="onepass")}


@pytest.mark.parametrize("variant", list(PREP))
@pytest.mark.parametrize("lower_bound,a_log_scale", [(-5.0, 0.5), (None, 6.0)])
def test_chunked_prep_variants_match_reference(variant, lower_bound, a_log_scale):
    # (None, 6.0): every 16-token block's decay span is far past 80, so every chunk is flagged by the main
    # launch and redone by the exact fix-up launch
    check_chunked(lower_bound, a_log_scale, **PREP[variant])


def bf16_case(seed=2):
    lens = [70, 20]
    q, k, v, gg, beta = inputs(lens, seed)
    q, k, v = (x.bfloat16() for x in (q, k, v))
    pool = torch.randn(2, H, V, K)
    si, init = torch.tensor([0, 1]), torch.tensor([True, False])
    ref_pool = pool.double()
    ref = R.kda_chunked(
        q.double(), k.double(), v.double(), gg.double(), beta.double(), ref_pool, si, cu_of(lens), init
    )
    return (q, k, v, gg, beta, pool, si, cu_of(lens), init), ref, ref_pool


@pytest.mark.parametrize(
    "kw",
    [{}, dict(prep_variant="split"), dict(prep_variant="onepass", tinv_fp32=True)],
    ids=["fused", "split", "onepass-tinv32"],
)
def test_chunked_bf16_product_form_inverse(kw):
    args, ref, ref_pool = bf16_case()
    out = kda_chunked_triton(*args, **kw)
    assert out.dtype == torch.bfloat16
    assert rel(out, ref) < 2.5e-2
    assert rel(args[5], ref_pool) < 2.5e-2


@pytest.mark.parametrize(
    "kw",
    [
        dict(prep_variant="split"),
        dict(prep_variant="split", exact_inline=True),
        dict(prep_variant="onepass", exact_inline=True),
    ],
    ids=["split", "inline", "onepass"],
)
def test_chunked_prep_mixed_decay_spans(kw):
    # only the second 16-token block of the first chunk decays past the factored form's limit (span 112):
    # that block is redone exactly, the others (and the other chunk) stay factored
    lens = [64, 30]
    q, k, v, _, beta = inputs(lens, 6)
    g = -0.3 * torch.rand(sum(lens), H, K, generator=torch.Generator().manual_seed(7))
    g[16:32] = -7.0
    pool = torch.randn(2, H, V, K)
    si, init = torch.tensor([1, 0]), torch.tensor([True, True])
    ref_pool = pool.double()
    ref = R.kda_chunked(
        q.double(), k.double(), v.double(), g.double(), beta.double(), ref_pool, si, cu_of(lens), init
    )
    fused_pool = pool.clone()
    fused = kda_chunked_triton(q, k, v, g, beta, fused_pool, si, cu_of(lens), init)
    out = kda_chunked_triton(q, k, v, g, beta, pool, si, cu_of(lens), init, **kw)
    assert rel(out, ref) < 1e-5 and rel(pool, ref_pool) < 1e-5
    assert rel(out, fused) < 1e-5 and rel(pool, fused_pool) < 1e-5


@pytest.mark.parametrize(
    "kw",
    [
        dict(prep_variant="split"),
        dict(prep_variant="onepass", wu_block_n=16),
        dict(
            prep_variant="split",
            exact_inline=True,
            intra_block_k=32,
            wu_block_n=64,
            prep_num_warps=4,
            prep_maxnreg=None,
            wu_num_warps=8,
        ),
    ],
    ids=["split", "onepass-bn16", "split-knobs"],
)
def test_chunked_prep_knobs_wider_heads(kw):
    # K = 32 (two K slices of 16 in the main pass), V = 64 != K (W and U column tiles differ in number),
    # no l2 norm, an explicit scale
    Hh, Kk, Vv = 1, 32, 64
    lens = [70, 5]
    g = torch.Generator().manual_seed(5)
    T = sum(lens)
    q, k, v = (
        torch.randn(T, Hh, Kk, generator=g),
        torch.randn(T, Hh, Kk, generator=g),
        torch.randn(T, Hh, Vv, generator=g),
    )
    gg = R.kda_gate(
        torch.randn(T, Hh, Kk, generator=g),
        torch.randn(Hh, generator=g) * 0.5,
        torch.randn(Hh * Kk, generator=g),
        -5.0,
    )
    beta = torch.sigmoid(torch.randn(T, Hh, generator=g))
    pool = torch.randn(3, Hh, Vv, Kk)
    si, init = torch.tensor([2, 0]), torch.tensor([True, False])
    opts = dict(use_qk_l2norm=False, scale=0.3)
    ref_pool = pool.double()
    ref = R.kda_chunked(
        q.double(),
        k.double(),
        v.double(),
        gg.double(),
        beta.double(),
        ref_pool,
        si,
        cu_of(lens),
        init,
        **opts,
    )
    out = kda_chunked_triton(q, k, v, gg, beta, pool, si, cu_of(lens), init, **opts, **kw)
    assert rel(out, ref) < 1e-5
    assert rel(pool, ref_pool) < 1e-5


def test_chunked_rejects_unknown_prep_variant():
    args, _, _ = bf16_case()
    with pytest.raises(ValueError, match="prep_variant"):
        kda_chunked_triton(*args, prep_variant="nope")


def test_recurrent_path_with_checkpoints():
    lens = [5, 1, 0, 9]
    q, k, v, gg, beta = inputs(lens, 3)
    pool = torch.full((8, H, V, K), float("nan"))
    pool[[2, 5]] = torch.randn(2, H, V, K)
    si = torch.tensor([2, 0, 7, 5])
    init = torch.tensor([True, False, False, True])
    ck = dict(
        checkpoint_seq=torch.tensor([0, 3]),
        checkpoint_offsets=torch.tensor([2, 9]),
        checkpoint_slots=torch.tensor([1, 3]),
    )
    ref_pool = pool.double()
    ref = R.kda_recurrent(
        q.double(), k.double(), v.double(), gg.double(), beta.double(), ref_pool, si, cu_of(lens), init, **ck
    )
    out = kda_recurrent_triton(q, k, v, gg, beta, pool, si, cu_of(lens), init, **ck)
    assert rel(out, ref) < 1e-5
    touched = [0, 1, 2, 3, 5, 7]
    assert rel(pool[touched], ref_pool[touched]) < 1e-5
    assert torch.isnan(pool[[4, 6]]).all()


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_fused_decode_matches_reference(lower_bound):
    g = torch.Generator().manual_seed(4)
    N, W = 5, 4
    C = 2 * H * K + H * V
    qkv = torch.randn(N, C, generator=g)
    cw = torch.randn(C, W, generator=g) * 0.5
    cs = torch.randn(9, C, W - 1, generator=g)
    pool = torch.randn(9, H, V, K, generator=g)
    cs[[1, 2, 4, 6]] = float("nan")
    pool[[1, 2, 4, 6]] = float("nan")
    args = (
        torch.randn(N, H, K, generator=g),
        torch.randn(H, generator=g) * 0.5,
        torch.randn(H * K, generator=g),
        torch.randn(N, H, generator=g),
        torch.randn(N, H, V, generator=g),
        torch.rand(V, generator=g) + 0.5,
    )
    si = torch.tensor([3, -1, 0, 8, 5])
    init = torch.tensor([True, True, False, True, False])
    rc, rp = cs.double(), pool.double()
    ref = R.kda_decode(
        qkv.double(),
        cw.double(),
        rc,
        *(a.double() for a in args[:5]),
        args[5].double(),
        rp,
        si,
        init,
        lower_bound=lower_bound,
    )
    out = kda_decode_triton(qkv, cw, cs, *args, pool, si, init, lower_bound=lower_bound)
    used = [0, 3, 5, 7, 8]
    assert rel(out, ref) < 1e-5
    assert (out[1] == 0).all()
    assert rel(pool[used], rp[used]) < 1e-5 and rel(cs[used], rc[used]) < 1e-6
    assert torch.isnan(pool[[1, 2, 4, 6]]).all() and torch.isnan(cs[[1, 2, 4, 6]]).all()


def test_chunked_reuses_the_batch_plan_for_the_same_tensors(monkeypatch):
    """Every KDA layer of an engine step passes the same cu_seqlens / slots / flags tensors: the host-side plan
    (device reads + chunk grid) is built once, reused while the tensors are the same objects at the same
    version, and rebuilt after an in-place write or for new tensor objects, with exact results each time."""
    import k3serve.kernels.triton.kda_chunk as KC

    builds = []
    real = KC._varlen.seq_starts
    monkeypatch.setattr(KC._varlen, "seq_starts", lambda cu: builds.append(1) or real(cu))
    lens = [5, 70, 1]
    q, k, v, gg, beta = inputs(lens, seed=3)
    si = torch.tensor([2, 0, 1])
    init = torch.tensor([True, False, True])
    cu = cu_of(lens)
    pool0 = torch.randn(3, H, V, K, generator=torch.Generator().manual_seed(4))

    def run(cu_t, si_t, init_t):
        pool, ref_pool = pool0.clone(), pool0.double()
        ref = R.kda_chunked(q.double(), k.double(), v.double(), gg.double(), beta.double(), ref_pool, si_t, cu_t,
                            init_t)
        out = kda_chunked_triton(q, k, v, gg, beta, pool, si_t, cu_t, init_t)
        assert rel(out, ref) < 1e-5 and rel(pool, ref_pool) < 1e-5

    run(cu, si, init)
    run(cu, si, init)  # a second layer of the same step: no rebuild
    assert len(builds) == 1
    cu[1:] = cu_of([40, 35, 1])[1:]  # written in place (a new step in a reused buffer): rebuilt
    run(cu, si, init)
    assert len(builds) == 2
    run(cu, si.clone(), init)  # a new tensor object with the same values: rebuilt, never trusted by value
    assert len(builds) == 3


@pytest.mark.parametrize("variant", ["fused", "split"])
def test_chunked_reads_strided_qkv(monkeypatch, variant):
    """q, k, v as column slices of one [T, 3·H·K] tensor (the conv output the engine splits): the fused prep kernel
    reads them at their token stride (no copies: `Tensor.contiguous` is not called on them), the other variants copy
    them; either way bit for bit the result of contiguous inputs."""
    lens = [70, 13, 1]
    q, k, v, gg, beta = inputs(lens, 5)
    T = q.shape[0]
    merged = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=1)
    qs, ks, vs = merged[:, : H * K].view(T, H, K), merged[:, H * K : 2 * H * K].view(T, H, K), merged[:, 2 * H * K :].view(T, H, V)
    assert not qs.is_contiguous() and qs.stride(0) == 2 * H * K + H * V
    si, init = torch.tensor([0, 1, 2]), torch.tensor([True, False, True])
    pool = torch.randn(3, H, V, K)
    pool2 = pool.clone()
    kw = {} if variant == "fused" else dict(prep_variant=variant)
    want = kda_chunked_triton(q, k, v, gg, beta, pool, si, cu_of(lens), init, **kw)
    copied = []
    real = torch.Tensor.contiguous
    monkeypatch.setattr(torch.Tensor, "contiguous",
                        lambda self, *a, **k_: copied.append(self.data_ptr()) or real(self, *a, **k_))
    got = kda_chunked_triton(qs, ks, vs, gg, beta, pool2, si, cu_of(lens), init, **kw)
    monkeypatch.undo()
    strided = {qs.data_ptr(), ks.data_ptr(), vs.data_ptr()}
    assert (strided & set(copied)) == (set() if variant == "fused" else strided)
    assert torch.equal(got, want) and torch.equal(pool2, pool)
