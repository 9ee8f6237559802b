"""The sync-free verify forward on a CUDA GPU (issue #20).

* The Triton short-chunk KDA kernel (kernels/triton/kda_verify.py) against the float64 contract on the CPU
  (tests/_kda_verify_cases.py: random shapes, padding rows, exports, the static verify layout).
* One verify-shaped forward pass of K3ForwardModel (every row 1 + k tokens, multi-slot exports after
  1..k tokens, a padding row), two steps in a row (fresh state, then from the first step's state), on the
  demo model and on a random config with Triton-sized heads: no host sync (CUDA sync debug mode "warn",
  every warning listed with its stack, so one run names every sync on the path), logits equal to the
  float64 reference forward (no caches), logits and every written state / window / latent page equal to
  the previous path (conv + chunked KDA), and a CUDA-graph capture of the step replaying the same result.
"""

from __future__ import annotations

import math
import random
import traceback
import warnings
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from _kda_verify_cases import case, check, oracle, run  # noqa: E402

from k3serve.kernels.triton import kda_verify as tkv  # noqa: E402
from k3serve.workers.engine.cache_layout import KVCacheTensors, plan_cache_layout  # noqa: E402
from k3serve.workers.engine.forward_batch import ForwardBatch  # noqa: E402
from k3serve.workers.engine.k3_forward import K3ForwardModel  # noqa: E402
from k3serve.workers.model.config import K3Config  # noqa: E402
from k3serve.workers.model.init_weights import init_weights  # noqa: E402
from k3serve.workers.model.loader import load_model_weights  # noqa: E402
from k3serve.workers.model.reference import ReferenceModel  # noqa: E402
from k3serve.workers.model.testing import random_text_config  # noqa: E402

DEV = "cuda"
DEMO = Path(__file__).resolve().parents[2] / "models" / "k3-demo-stdlib"


def rel(out, ref) -> float:
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_kernel_on_cuda_matches_float64_contract(seed, dtype):
    rng = random.Random(seed)
    inputs, kw = case(rng, seed, static=seed % 2 == 1, heads=(3, 8), dims=(64, 128))
    if dtype != torch.float32:  # bf16 activations and conv windows, fp32 states (the engine's layout)
        for name in ("qkv", "raw_g", "beta_logit", "conv_states"):
            inputs[name] = inputs[name].to(dtype)
    ref = oracle(inputs, kw)
    dev = {k: v.to(DEV) if v is not None else None for k, v in inputs.items()}
    dkw = {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    assert tkv.supported(dev["qkv"], dev["conv_weight"], dev["conv_states"], dev["raw_g"], dev["state_pool"])
    out = run(tkv.kda_verify_triton, dev, dkw)
    torch.cuda.synchronize()
    if dtype == torch.float32:
        check([t.cpu() for t in out], ref, 2e-4)
    else:  # the kernel keeps fp32 inside; only the stored conv windows round to bf16
        assert rel(out[0], ref[0]) < 1e-4 and rel(out[1], ref[1]) < 1e-4
        assert rel(out[2], ref[2]) < 1e-2


# -- one verify step of the engine's forward -----------------------------------------------------------


def _triton_sized_config(seed: int) -> K3Config:
    """A random config whose KDA and MLA layers take the Triton kernels (power-of-two head sizes >= 16)."""
    t = random_text_config(seed)
    t["linear_attn_config"]["head_dim"] = random.Random(seed).choice([16, 32, 64])
    t["kv_lora_rank"], t["qk_rope_head_dim"] = 32, 16
    return K3Config.from_dict({"model_type": "kimi_k3", "text_config": t})


def _models(source: str):
    if source == "demo":
        cfg, w = load_model_weights(DEMO, dtype=torch.float32)
    else:
        cfg = _triton_sized_config(int(source.split("-")[1]))
        w = init_weights(cfg, seed=5, device="cpu", dtype=torch.float32)
    w64 = {k: v.double() if v.is_floating_point() else v for k, v in w.items()}
    ref = ReferenceModel(cfg, w64, torch.float64)
    layout = plan_cache_layout(cfg, torch.float32)
    kv = KVCacheTensors(layout, num_blocks=128, device=DEV)
    model = K3ForwardModel(cfg, {k: v.to(DEV) for k, v in w.items()}, layout, kv, torch.float32)
    return cfg, ref, layout, kv, model


class _Rows:
    """Block ids for `n` sequences (+ padding rows) of a verify batch: 2 MLA blocks per group, a running KDA
    block and k export blocks per KDA group; block 0 stays the null block."""

    def __init__(self, layout, n: int, k: int):
        ids = iter(range(1, 10_000))
        self.mla = [[[next(ids), next(ids)] for _ in range(n)] for _ in layout.mla_groups]
        self.run = [[next(ids) for _ in range(n)] for _ in layout.kda_groups]
        self.spec = [[[next(ids) for _ in range(k)] for _ in range(n)] for _ in layout.kda_groups]


def _batch(layout, rows: _Rows, tokens: list[list[int]], start: int, size: int, k: int) -> ForwardBatch:
    """The static verify batch's shape (workers/engine/spec/static_verify.py): `size` rows of T = 1 + k tokens,
    the real ones first, padding rows with slot -1 that repeat row 0's first export."""
    T, n, bs = 1 + k, len(tokens), layout.block_size
    lt = dict(dtype=torch.long, device=DEV)
    ids = [t for row in tokens for t in row] + [0] * ((size - n) * T)
    pos = [start + j for _ in range(size) for j in range(T)]
    bts, slots = [], []
    for g in range(len(layout.mla_groups)):
        bt = torch.zeros(size, 2, dtype=torch.int32)
        sm = [-1] * (size * T)
        for i in range(n):
            bt[i] = torch.tensor(rows.mla[g][i])
            for j in range(T):
                p = start + j
                sm[i * T + j] = rows.mla[g][i][p // bs] * bs + p % bs
        bts.append(bt.to(DEV))
        slots.append(torch.tensor(sm, **lt))
    si = [torch.tensor(rows.run[g][:n] + [-1] * (size - n), **lt) for g in range(len(layout.kda_groups))]
    ck_seq = [i for i in range(n) for _ in range(k)] + [0] * ((size - n) * k)
    ck_off = [o for _ in range(n) for o in range(1, T)] + [1] * ((size - n) * k)
    ck_slots = [torch.tensor([s for i in range(n) for s in rows.spec[g][i]] + [rows.spec[g][0][0]] * ((size - n) * k),
                             **lt) for g in range(len(layout.kda_groups))]
    return ForwardBatch(
        input_ids=torch.tensor(ids, **lt), positions=torch.tensor(pos, **lt),
        cu_seqlens=torch.arange(size + 1, **lt) * T,
        seq_lens=torch.tensor([start + T] * n + [T] * (size - n), **lt), block_tables=bts, slot_mapping=slots,
        state_indices=si, has_initial_state=torch.tensor([start > 0] * n + [False] * (size - n), device=DEV),
        checkpoint_seq=torch.tensor(ck_seq, **lt), checkpoint_offsets=torch.tensor(ck_off, **lt),
        checkpoint_slots=ck_slots, logits_indices=torch.arange(n * T, **lt), is_decode=False, max_query_len=T)


def _syncs_in(fn) -> tuple[object, list[str]]:
    """fn()'s result and every host sync CUDA's sync debug mode reported while it ran, each with its stack."""
    found = []

    def show(message, category, filename, lineno, file=None, line=None):
        # torch's warning for a sync (c10/cuda: "called a synchronizing CUDA operation"); not the one-time
        # "Synchronization debug mode is a prototype feature ..." notice that setting the mode emits
        if "called a synchronizing CUDA operation" in str(message):
            found.append(f"{message}\n" + "".join(traceback.format_stack(limit=14)[:-1]))

    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode(prev)
    return out, found


def _used(kv, layout, rows: _Rows):
    """The states, conv windows and latent pages the steps write, as float copies."""
    out = []
    for g, grp in enumerate(layout.kda_groups):
        blocks = rows.run[g] + [b for r in rows.spec[g] for b in r]
        for j in range(len(grp.layer_ids)):
            out += [kv.ssm_view(j)[blocks].clone(), kv.conv_view(j)[blocks].clone()]
    for g, grp in enumerate(layout.mla_groups):
        blocks = [b for r in rows.mla[g] for b in r]
        for j in range(len(grp.layer_ids)):
            out.append(kv.mla_view(j)[blocks].clone())
    return out


@pytest.mark.parametrize("source", ["demo", "random-3", "random-8"])
def test_verify_step_forward_is_sync_free_and_exact(source, monkeypatch):
    cfg, ref, layout, kv, model = _models(source)
    k, n, size = 3, 2, 3  # two requests and one padding row, 1 + k tokens each
    T = 1 + k
    rng = random.Random(sum(map(ord, source)))
    seqs = [[rng.randrange(cfg.vocab_size) for _ in range(2 * T)] for _ in range(n)]
    rows = _Rows(layout, size, k)
    b1 = _batch(layout, rows, [s[:T] for s in seqs], 0, size, k)
    b2 = _batch(layout, rows, [s[T:] for s in seqs], T, size, k)
    model.forward(b1)  # compile every kernel outside the audit
    for p in kv.pages:
        p.zero_()
    torch.cuda.synchronize()

    # the new path: no host sync in either step (one run lists every sync with its stack); the audit sees one
    assert len(_syncs_in(lambda: torch.ones(1, device=DEV).item())[1]) == 1
    l1, s1 = _syncs_in(lambda: model.forward(b1).clone())
    after1 = [p.clone() for p in kv.pages]
    l2, s2 = _syncs_in(lambda: model.forward(b2).clone())
    assert not s1 + s2, "host syncs in the verify forward:\n\n" + "\n\n".join(s1 + s2)
    pages2 = _used(kv, layout, rows)

    # the float64 reference forward (no caches) over each whole sequence
    want = torch.cat([ref.logits(s) for s in seqs]).double()  # [n * 2T, V]
    got = torch.cat([torch.cat([l1[i * T:(i + 1) * T], l2[i * T:(i + 1) * T]]) for i in range(n)]).double().cpu()
    assert rel(got, want) < 5e-4, rel(got, want)

    # the previous path (conv + chunked KDA), from the same pages: same logits, same written state
    for p in kv.pages:
        p.zero_()
    monkeypatch.setattr(K3ForwardModel, "_short_rows", staticmethod(lambda b: False))
    c1 = model.forward(b1).clone()
    c2 = model.forward(b2).clone()
    monkeypatch.undo()
    assert rel(l1, c1) < 1e-5 and rel(l2, c2) < 1e-5
    for a, c in zip(pages2, _used(kv, layout, rows)):
        assert rel(a, c) < 1e-5

    # the step captured in a CUDA graph replays the eager result
    for p, q in zip(kv.pages, after1):
        p.copy_(q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lg = model.forward(b2)
    for p, q in zip(kv.pages, after1):
        p.copy_(q)
    graph.replay()
    torch.cuda.synchronize()
    assert rel(lg, l2) < 1e-6
    for a, c in zip(pages2, _used(kv, layout, rows)):
        assert rel(a, c) < 1e-6
