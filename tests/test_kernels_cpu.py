"""The batched CPU ops (k3serve/kernels/cpu/) against the reference ops they stand in for.

Random ragged batches with recycled garbage in the pools, padded rows, checkpoints, strong decays (the
pairwise fallback of the chunked form), both MoE evaluation orders; float64 to 1e-10, float32 to 1e-4.
`ops` sends CPU tensors to these forms; K3SERVE_KERNELS=reference sends them to the reference.
"""

import random

import pytest
import torch

from k3serve.kernels import cpu, ops, reference

torch.set_num_threads(1)
F64 = torch.float64


def _close(got, want, dtype):
    tol = 1e-10 if dtype == F64 else 1e-4
    scale = max(1.0, float(want.abs().max()))
    err = float((got.to(F64) - want.to(F64)).abs().max()) / scale
    assert err < tol, f"max error {err:.2e}"


@pytest.fixture
def no_fallback(monkeypatch):
    """The fast forms must not hand these inputs to the reference (that would test nothing)."""
    def refuse(*a, **k):
        raise AssertionError("fell back to the reference op")
    for mod, name in ((cpu.kda, "_ref_chunked"), (cpu.kda, "_ref_decode"), (cpu.moe, "_reference")):
        monkeypatch.setattr(mod, name, refuse)


def _kda_case(seed, dtype, lower_bound=-5.0, strong=False):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    H, K, V = rng.choice([(2, 8, 6), (3, 16, 16), (1, 4, 8)])
    B = rng.randint(1, 6)
    lens = [rng.choice([0, 1, 2, rng.randint(3, 150)]) for _ in range(B)]
    lens[0] = max(lens[0], 1)
    T = sum(lens)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()))
    slots = rng.sample(range(2 * B + 4), B)
    if B > 1 and rng.random() < 0.5:
        slots[rng.randrange(B)] = -1  # a padded sequence
    init = [rng.random() < 0.6 for _ in range(B)]
    ckpt = []
    free = [s for s in range(2 * B + 4, 2 * B + 12)]
    for b in range(B):
        if slots[b] >= 0 and lens[b] and rng.random() < 0.6:
            for off in sorted(rng.sample(range(1, lens[b] + 1), min(2, lens[b]))):
                ckpt.append((b, off, free.pop()))
    raw_g = torch.randn(T, H, K, generator=gen, dtype=F64) * (4 if strong else 1)
    A_log = torch.randn(H, generator=gen, dtype=F64) * 0.5 + (2 if strong else 0)
    dt_bias = torch.randn(H * K, generator=gen, dtype=F64)
    g = reference.kda_gate(raw_g, A_log, dt_bias, None if strong else lower_bound)
    t = dict(
        q=torch.randn(T, H, K, generator=gen, dtype=F64), k=torch.randn(T, H, K, generator=gen, dtype=F64),
        v=torch.randn(T, H, V, generator=gen, dtype=F64), g=g,
        beta=torch.sigmoid(torch.randn(T, H, generator=gen, dtype=F64)))
    t = {n: x.to(dtype) for n, x in t.items()}
    pool = (torch.randn(2 * B + 12, H, V, K, generator=gen, dtype=F64) * 3).to(dtype)
    kw = dict(state_indices=torch.tensor(slots), cu_seqlens=cu, has_initial_state=torch.tensor(init))
    if ckpt:
        kw.update(checkpoint_seq=torch.tensor([c[0] for c in ckpt]),
                  checkpoint_offsets=torch.tensor([c[1] for c in ckpt]),
                  checkpoint_slots=torch.tensor([c[2] for c in ckpt]))
    return t, pool, kw


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("seed", range(6))
def test_kda_chunked_equals_reference(seed, dtype, in_place, no_fallback, monkeypatch):
    """Both recurrence forms (`kda.CHUNK_IN_PLACE`), with and without checkpoints, == the reference."""
    monkeypatch.setattr(cpu.kda, "CHUNK_IN_PLACE", in_place)
    t, pool, kw = _kda_case(seed, dtype, strong=seed % 3 == 2)
    p_ref, p_cpu = pool.clone(), pool.clone()
    want = reference.kda_chunked(t["q"], t["k"], t["v"], t["g"], t["beta"], p_ref, **kw)
    got = cpu.kda_chunked(t["q"], t["k"], t["v"], t["g"], t["beta"], p_cpu, **kw)
    _close(got, want, dtype)
    _close(p_cpu, p_ref, dtype)  # final states, checkpoints and untouched slots


def test_kda_chunked_strong_decay_chunks_go_pairwise_and_stay_finite(no_fallback, monkeypatch):
    masks = []
    real = cpu.kda._gated_products
    monkeypatch.setattr(cpu.kda, "_gated_products", lambda *a: (lambda r: masks.append(r[2]) or r)(real(*a)))
    T, H, K = 130, 2, 8
    g = torch.full((T, H, K), -0.05, dtype=torch.float32)
    g[64:, :, 0] = -30.0  # |G - G_mid| ~ 240 inside the chunks of the second half: e^240 overflows float32
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(T, H, K, generator=gen) for _ in range(3))
    beta = torch.rand(T, H, generator=gen)
    kw = dict(state_indices=torch.tensor([0]), cu_seqlens=torch.tensor([0, T]), has_initial_state=torch.tensor([False]))
    p_ref, p_cpu = torch.zeros(1, H, K, K), torch.zeros(1, H, K, K)
    want = reference.kda_chunked(q, k, v, g, beta, p_ref, **kw)
    got = cpu.kda_chunked(q, k, v, g, beta, p_cpu, **kw)
    (mask,) = masks
    assert mask.any() and not mask.all()  # both forms in one call
    assert torch.isfinite(got).all() and torch.isfinite(p_cpu).all()
    _close(got, want, torch.float32)
    _close(p_cpu, p_ref, torch.float32)


def _decode_args(gen, N, h, K, V, W, dtype):
    """kda_decode's tensor arguments for N rows over pools of N + 5 slots."""
    C = 2 * h * K + h * V
    args = dict(
        qkv=torch.randn(N, C, generator=gen, dtype=F64), conv_weight=torch.randn(C, 1, W, generator=gen, dtype=F64),
        conv_states=torch.randn(N + 5, C, W - 1, generator=gen, dtype=F64),
        raw_g=torch.randn(N, h, K, generator=gen, dtype=F64), A_log=torch.randn(h, generator=gen, dtype=F64),
        dt_bias=torch.randn(h * K, generator=gen, dtype=F64), beta_logit=torch.randn(N, h, generator=gen, dtype=F64),
        gate=torch.randn(N, h * V, generator=gen, dtype=F64), o_norm_weight=torch.randn(V, generator=gen, dtype=F64),
        state_pool=torch.randn(N + 5, h, V, K, generator=gen, dtype=F64))
    return {n: x.to(dtype) for n, x in args.items()}


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("seed", range(4))
def test_kda_decode_equals_reference(seed, dtype, no_fallback):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    N, h, K, V, W = rng.randint(1, 9), rng.choice([1, 2, 4]), rng.choice([4, 8]), rng.choice([4, 8]), 4
    slots = rng.sample(range(N + 5), N)
    if N > 1:
        slots[rng.randrange(N)] = -1
    args = _decode_args(gen, N, h, K, V, W, dtype)
    idx = torch.tensor(slots)
    init = torch.tensor([seed == 0 or rng.random() < 0.7 for _ in range(N)])  # seed 0: every row continues
    ref_args = {n: (x.clone() if n in ("conv_states", "state_pool") else x) for n, x in args.items()}
    want = reference.kda_decode(**ref_args, state_indices=idx, has_initial_state=init, lower_bound=-5.0, eps=1e-6)
    got = cpu.kda_decode(**args, state_indices=idx, has_initial_state=init, lower_bound=-5.0, eps=1e-6)
    _close(got, want, dtype)
    _close(args["state_pool"], ref_args["state_pool"], dtype)
    _close(args["conv_states"], ref_args["conv_states"], dtype)


@pytest.mark.parametrize("bmm", [True, False])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("slots", ["consecutive", "spread", "padded"])
def test_kda_decode_paged_pools(slots, dtype, bmm, monkeypatch):
    """kda_decode on pools that are strided views of one page buffer (as workers/engine/cache_layout.py's
    conv_view / ssm_view: each slot's conv history and state inside its page), in both delta-rule forms
    (`kda.DECODE_BMM`), for consecutive slots (updated in place through the views), spread ones (gathered and
    scattered) and a padded row; some rows fresh; == the reference, outputs and every page (untouched bytes too)."""
    monkeypatch.setattr(cpu.kda, "DECODE_BMM", bmm)
    gen = torch.Generator().manual_seed(7)
    N, h, K, V, W = 5, 2, 8, 4, 4
    C = 2 * h * K + h * V
    dense = _decode_args(gen, N, h, K, V, W, dtype)
    n_pages, conv_n, ssm_n = N + 5, C * (W - 1), h * V * K
    pages = torch.randn(n_pages, conv_n + ssm_n + 3, generator=gen, dtype=F64).to(dtype)  # 3 spare values per page
    args = {n: x for n, x in dense.items() if n not in ("conv_states", "state_pool")}
    idx = {"consecutive": torch.arange(2, 2 + N), "spread": torch.tensor([7, 0, 3, 9, 5]),
           "padded": torch.tensor([4, -1, 1, 8, 6])}[slots]
    init = torch.tensor([True, True, False, True, False])
    outs = []
    for pg in (pages.clone(), pages.clone()):
        conv = pg[:, :conv_n].view(n_pages, C, W - 1)
        pool = pg[:, conv_n:conv_n + ssm_n].view(n_pages, h, V, K)
        fn = reference.kda_decode if not outs else cpu.kda_decode
        outs.append((fn(**args, conv_states=conv, state_pool=pool, state_indices=idx, has_initial_state=init,
                        lower_bound=-5.0, eps=1e-6), pg))
    (want, pg_ref), (got, pg_cpu) = outs
    _close(got, want, dtype)
    _close(pg_cpu, pg_ref, dtype)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("seed", range(4))
def test_kda_decode_consecutive_slots_in_place(seed, dtype, monkeypatch):
    """Consecutive ascending slots (`_slot_range`): the pools are updated in place through a view (no gather or
    scatter: index_select / index_copy_ must not run), some rows starting fresh; == the reference, outputs and
    every pool row (the untouched rows too)."""
    rng = random.Random(100 + seed)
    gen = torch.Generator().manual_seed(seed)
    N, h, K, V, W = rng.randint(1, 9), rng.choice([1, 2, 4]), rng.choice([4, 8]), rng.choice([4, 8]), 4
    a = rng.randint(0, 3)
    args = _decode_args(gen, N, h, K, V, W, dtype)
    idx = torch.arange(a, a + N)
    assert cpu.kda._slot_range(idx) == slice(a, a + N)
    assert cpu.kda._slot_range(torch.tensor([a, a + 2])) is None and cpu.kda._slot_range(torch.tensor([3, 2])) is None
    init = torch.tensor([seed == 0 or rng.random() < 0.6 for _ in range(N)])
    ref_args = {n: (x.clone() if n in ("conv_states", "state_pool") else x) for n, x in args.items()}
    want = reference.kda_decode(**ref_args, state_indices=idx, has_initial_state=init, lower_bound=-5.0, eps=1e-6)
    for name in ("index_select", "index_copy_"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a_, **k_: pytest.fail("gathered or scattered"))
    got = cpu.kda_decode(**args, state_indices=idx, has_initial_state=init, lower_bound=-5.0, eps=1e-6)
    monkeypatch.undo()
    _close(got, want, dtype)
    _close(args["state_pool"], ref_args["state_pool"], dtype)
    _close(args["conv_states"], ref_args["conv_states"], dtype)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("shifted", [True, False])
def test_causal_conv1d_equals_reference(seed, dtype, shifted, monkeypatch):
    monkeypatch.setattr(cpu.conv, "_reference", lambda *a, **k: pytest.fail("fell back to the reference op"))
    monkeypatch.setattr(cpu.conv, "SHIFTED", shifted)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    B, C, W = rng.randint(1, 7), rng.choice([6, 24]), rng.choice([2, 4])
    lens = [rng.choice([0, 1, 1, 2, rng.randint(3, 40)]) for _ in range(B)]
    slots = rng.sample(range(B + 6), B)
    if B > 1:
        slots[rng.randrange(B)] = -1
    init = torch.tensor([rng.random() < 0.6 for _ in range(B)])
    ckpt = [(b, rng.randint(0, lens[b]), B + 6 + i) for i, b in enumerate(range(B)) if slots[b] >= 0 and rng.random() < 0.5]
    x = torch.randn(sum(lens), C, generator=gen, dtype=F64).to(dtype)
    w = torch.randn(C, 1, W, generator=gen, dtype=F64).to(dtype)
    states = torch.randn(2 * B + 6, C, W - 1, generator=gen, dtype=F64).to(dtype)
    _check_conv(x, w, states, _conv_kw(lens, slots, init, ckpt), dtype)


def _conv_kw(lens, slots, init, ckpt) -> dict:
    """causal_conv1d_varlen's batch arguments; `ckpt`: (sequence, offset, slot) checkpoints."""
    kw = dict(state_indices=torch.tensor(slots), cu_seqlens=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist()),
              has_initial_state=torch.as_tensor(init))
    if ckpt:
        kw.update(checkpoint_seq=torch.tensor([c[0] for c in ckpt]), checkpoint_offsets=torch.tensor([c[1] for c in ckpt]),
                  checkpoint_slots=torch.tensor([c[2] for c in ckpt]))
    return kw


def _check_conv(x, w, states, kw, dtype) -> None:
    """The CPU conv == the reference (outputs, shape and dtype, every pool row), with and without the SiLU."""
    for act in ("silu", None):
        s_ref, s_cpu = states.clone(), states.clone()
        want = reference.causal_conv1d_varlen(x, w, s_ref, activation=act, **kw)
        got = cpu.causal_conv1d_varlen(x, w, s_cpu, activation=act, **kw)
        assert got.shape == want.shape and got.dtype == want.dtype
        _close(got, want, dtype)
        _close(s_cpu, s_ref, dtype)


_CONV_EDGE_CASES = [  # (lens, slots, init, checkpoints (seq, offset, slot), extra rows past the last sequence)
    ([1, 0, 2, 3, 1, 17], [4, 0, 9, -1, 2, 7], [True, True, False, True, True, False], [(0, 0, 11), (2, 1, 12),
                                                                                        (5, 17, 13), (5, 2, 14)], 0),
    ([1, 1], [3, 1], [True, False], [], 0),  # fewer tokens than the kernel width
    ([5, 40, 1], [-1, 6, 5], [True, True, True], [(1, 3, 10)], 3),  # rows of no sequence stay zero
    ([64, 64, 64], [0, 1, 2], [True, True, True], [], 0),
    ([2], [-1], [True], [], 0),  # only a padded sequence
]


@pytest.mark.parametrize("shifted", [True, False])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("case", range(len(_CONV_EDGE_CASES)))
def test_causal_conv1d_forms_edge_cases(case, dtype, shifted, monkeypatch):
    """Both prefill forms of the CPU conv (`conv.SHIFTED`: shifted multiply-adds over the whole batch, or a conv1d
    per sequence) == the reference: sequences shorter than the kernel, empty and padded ones, fresh histories,
    checkpoints inside the history, non-contiguous slots, rows outside every sequence; outputs and every pool row."""
    monkeypatch.setattr(cpu.conv, "_reference", lambda *a, **k: pytest.fail("fell back to the reference op"))
    monkeypatch.setattr(cpu.conv, "SHIFTED", shifted)
    lens, slots, init, ckpt, extra = _CONV_EDGE_CASES[case]
    gen = torch.Generator().manual_seed(case)
    C, W = 12, 4
    x = torch.randn(sum(lens) + extra, C, generator=gen, dtype=F64).to(dtype)
    w = torch.randn(C, W, generator=gen, dtype=F64).to(dtype)
    states = torch.randn(16, C, W - 1, generator=gen, dtype=F64).to(dtype)
    _check_conv(x, w, states, _conv_kw(lens, slots, init, ckpt), dtype)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("seed", range(4))
def test_mla_paged_attention_equals_reference(seed, dtype):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    Hh, L, R, bs = rng.choice([1, 4]), rng.choice([8, 16]), 4, rng.choice([4, 16])
    B = rng.randint(2, 8)
    nq = [1 if rng.random() < 0.7 else rng.randint(2, 9) for _ in range(B)]
    ctx = [rng.randint(q, 60) for q in nq]
    nblocks = 1 + sum(-(-c // bs) for c in ctx)
    cache = torch.randn(nblocks, bs, L + R, generator=gen, dtype=F64).to(dtype)
    cache[0] = float("nan")  # never-allocated page 0 (padding in the tables) must not reach the output
    maxb = max(-(-c // bs) for c in ctx) + 2
    tables = torch.zeros(B, maxb, dtype=torch.int32)
    free = list(range(1, nblocks))
    rng.shuffle(free)
    for b, c in enumerate(ctx):
        for i in range(-(-c // bs)):
            tables[b, i] = free.pop()
        cache[tables[b, (c - 1) // bs], (c - 1) % bs + 1:] = float("nan")  # the last page's unused tail too
    T = sum(nq)
    q_lat = torch.randn(T, Hh, L, generator=gen, dtype=F64).to(dtype)
    q_pe = torch.randn(T, Hh, R, generator=gen, dtype=F64).to(dtype)
    cu = torch.tensor([0] + torch.tensor(nq).cumsum(0).tolist())
    a = (q_lat, q_pe, cache, tables, torch.tensor(ctx), cu, 0.3)
    got = cpu.mla_paged_attention(*a, kv_lora_rank=L)
    assert torch.isfinite(got).all()
    _close(got, reference.mla_paged_attention(*a, kv_lora_rank=L), dtype)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("T,E,I,D", [(3, 8, 4, 8), (40, 16, 8, 16), (5, 64, 512, 256)])
def test_moe_experts_equal_reference_every_order(T, E, I, D, dtype, no_fallback, monkeypatch):
    gen = torch.Generator().manual_seed(T + E)
    z = torch.randn(T, D, generator=gen, dtype=F64).to(dtype)
    w13 = torch.randn(E, 2 * I, D, generator=gen, dtype=F64).to(dtype) / D ** 0.5
    w2 = torch.randn(E, D + 3, I, generator=gen, dtype=F64).to(dtype) / I ** 0.5
    ids = torch.stack([torch.randperm(E, generator=gen)[:3] for _ in range(T)])
    ids[0, 2] = -1  # ignored
    ids[1, 1] = ids[1, 0]  # the same expert twice for one token: counted twice, as in the reference
    wts = torch.rand(T, 3, generator=gen, dtype=F64).to(dtype)
    for act in ("situ", "silu"):
        kw = dict(w13=w13, w2=w2, activation=act, situ_beta=3.0, situ_linear_beta=6.0)
        want = reference.moe_experts(z, wts, ids, **kw)
        _close(cpu.moe_experts(z, wts, ids, **kw), want, dtype)
        # every evaluation order: grouped_mm (float32), the per-expert loop, the dense form
        # K-major storage, as the CPU engine keeps experts (workers/engine/k3_forward.py)
        kmajor = dict(kw, w13=w13.transpose(1, 2).contiguous().transpose(1, 2),
                      w2=w2.transpose(1, 2).contiguous().transpose(1, 2))
        for grouped_mm, cost in ((True, 0), (False, 0), (False, 1 << 40)):
            monkeypatch.setattr(cpu.moe, "GROUPED_MM", grouped_mm)
            monkeypatch.setattr(cpu.moe, "LOOP_COST_BYTES", cost)
            _close(cpu.moe_experts(z, wts, ids, **kw), want, dtype)
            _close(cpu.moe_experts(z, wts, ids, **kmajor), want, dtype)
        monkeypatch.setattr(cpu.moe, "GROUPED_MM", True)
        monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # float32 with several threads: the dense form
        _close(cpu.moe_experts(z, wts, ids, **kmajor), want, dtype)


def test_ops_pinned_kernels_reads_the_mode_once(monkeypatch):
    """Inside `ops.pinned_kernels()` K3SERVE_KERNELS is the value read on entry (a change inside the block waits for
    the next block); nested blocks keep the outer pin; a registration change inside forgets the remembered choices;
    outside every block each op call reads the environment again."""
    z = torch.randn(2, 4)
    monkeypatch.delenv("K3SERVE_KERNELS", raising=False)
    with ops.pinned_kernels():
        assert ops._impl("moe_experts", z) is cpu.moe_experts
        monkeypatch.setenv("K3SERVE_KERNELS", "reference")
        assert ops._impl("moe_experts", z) is cpu.moe_experts
        with ops.pinned_kernels():  # nested: still the outer block's mode, and still pinned after it closes
            assert ops._impl("kda_chunked", z) is cpu.kda_chunked
        assert ops._impl("kda_chunked", z) is cpu.kda_chunked
        before = ops.registered().get("rms_norm")  # the Triton registration, where triton_ops is loaded: restored
        ops.register_impl("rms_norm", reference.rms_norm)  # any registration change: choose again (same mode)
        try:
            assert not ops.pinned_choices()
            assert ops._impl("moe_experts", z) is cpu.moe_experts
        finally:
            if before is None:
                ops.unregister_impl("rms_norm")
            else:  # unregistering would leave later tests of this process without the Triton rms_norm
                ops.register_impl("rms_norm", before)
    assert ops._impl("moe_experts", z) is reference.moe_experts  # unpinned: the environment as it is now
    with ops.pinned_kernels():
        assert ops._impl("moe_experts", z) is reference.moe_experts
        monkeypatch.delenv("K3SERVE_KERNELS")
        assert ops._impl("moe_experts", z) is reference.moe_experts
    assert ops._impl("moe_experts", z) is cpu.moe_experts
    assert ops.pinned_mode() is None and not ops.pinned_choices()


def test_ops_pinned_kernels_is_per_thread(monkeypatch):
    """A pin held open by one thread (an engine's forward) does not steer another thread's ops: the other thread
    reads the environment as it is now (the full suite once ran a test that set K3SERVE_KERNELS while a background
    engine's forward held the pin)."""
    import threading

    z = torch.randn(2, 4)
    monkeypatch.delenv("K3SERVE_KERNELS", raising=False)
    opened, release, seen = threading.Event(), threading.Event(), []

    def engine_thread():
        with ops.pinned_kernels():
            seen.append(ops._impl("moe_experts", z))
            opened.set()
            release.wait(10)
            seen.append(ops._impl("moe_experts", z))  # still its own pin after the main thread's changes

    t = threading.Thread(target=engine_thread)
    t.start()
    try:
        assert opened.wait(10)
        monkeypatch.setenv("K3SERVE_KERNELS", "reference")
        assert ops.pinned_mode() is None
        assert ops._impl("moe_experts", z) is reference.moe_experts
        with ops.pinned_kernels():
            assert ops.pinned_mode() == "reference"
            assert ops._impl("moe_experts", z) is reference.moe_experts
    finally:
        release.set()
        t.join(10)
    assert seen == [cpu.moe_experts, cpu.moe_experts]


def test_ops_pinned_kernels_released_on_error(monkeypatch):
    monkeypatch.delenv("K3SERVE_KERNELS", raising=False)
    with pytest.raises(RuntimeError), ops.pinned_kernels():
        raise RuntimeError("a failing forward")
    monkeypatch.setenv("K3SERVE_KERNELS", "reference")
    assert ops._impl("moe_experts", torch.randn(2, 4)) is reference.moe_experts


def test_cast_skips_only_noop_casts(monkeypatch):
    """`cast` returns x itself when it has the dtype (as `Tensor.to` would), converts otherwise; with
    SKIP_NOOP_CASTS off it always calls `Tensor.to`."""
    from k3serve.kernels.reference import _varlen

    x = torch.randn(3, dtype=torch.float32)
    assert _varlen.cast(x, torch.float32) is x
    y = _varlen.cast(x, F64)
    assert y.dtype == F64 and torch.equal(y, x.to(F64))
    calls = []
    real = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: calls.append(a) or real(self, *a, **k))
    assert _varlen.cast(x, torch.float32) is x and not calls
    monkeypatch.setattr(_varlen, "SKIP_NOOP_CASTS", False)
    assert _varlen.cast(x, torch.float32) is x and calls == [(torch.float32,)]


def test_ops_dispatch_cpu_forms_and_reference_switch(monkeypatch):
    z = torch.randn(2, 4)
    assert ops._impl("moe_experts", z) is cpu.moe_experts
    assert ops._impl("kda_chunked", z) is cpu.kda_chunked
    assert ops._impl("rms_norm", z) is reference.rms_norm  # no CPU form: the reference
    monkeypatch.setenv("K3SERVE_KERNELS", "reference")
    assert ops._impl("moe_experts", z) is reference.moe_experts
