"""KDA on the CPU: the decode step and the chunked prefill over the whole batch at once.

Same contracts as `k3serve.kernels.reference.kda_decode` and `kda_chunked` (see them); the reference walks
one sequence (and, in decode, one token) at a time, these walk the batch together:

* `kda_decode`: every row's conv history and state gathered with one index, the conv window, gates,
  normalisation and delta-rule update as whole-batch products, the states and histories scattered back;
* `kda_chunked`: every sequence's chunks (`CHUNK` tokens) laid side by side ([chunks, H, C, *], the last
  chunk of a sequence padded with tokens that change nothing: k = v = q = g = beta = 0). The intra-chunk
  work (gated q·k and k·k products, the unit-triangular solve for the WY pair) is one batched computation
  over all chunks; the chunk-to-chunk state recurrence is one step per chunk index, all sequences still
  running at once (every factor there is a decay e^{G_end - G_s} or e^{G_t} <= 1). The gated products
  Σ_k x_t[k] k_s[k] e^{G_t[k] - G_s[k]} are two GEMMs of x·e^{G - G_m} with k·e^{G_m - G}, G_m the
  cumulative gate at the chunk's middle token; a chunk where some |G - G_m| reaches `FACTOR_LIMIT` (e^{±}
  would leave the normal range) is computed pairwise instead (exp of every masked difference, as the
  reference does).

Chunk boundaries are this module's own (they do not change the result: the chunk form is exact); the
`chunk_size` argument is validated only. A padded sequence (state slot -1) reads and writes nothing,
its checkpoint exports included (skipped, as in the reference and kernels/triton/kda_chunk.py). Inputs outside the fast path (a state slot shared by two
sequences, mixed dtypes) go to the reference op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..reference import kda_chunked as _ref_chunked
from ..reference import kda_decode as _ref_decode
from ..reference._kda_batch import prepare
from ..reference._varlen import cast, compute_dtype
from ..reference.kda_gate import kda_gate
from ..reference.norms import l2_normalize, rms_norm

FACTOR_LIMIT = {torch.float32: 60.0, torch.float64: 600.0}
"""Largest |G_t - G_m| within a chunk for which the factorised form is used: e^{±60} ~ 1e±26 (float32),
e^{±600} ~ 1e±260 (float64) are finite and normal, so the two factors multiply back exactly."""

CONTIGUOUS_IN_PLACE = True
"""`kda_decode`: consecutive ascending state slots are updated in place through a view of the pools (no gather
and scatter of the states and conv histories); False always gathers (benchmarks, tests)."""

DECODE_BMM = True
"""`kda_decode`'s delta rule with the decay folded into the vectors: S·(e^g⊙k) and S·(e^g⊙q) as ONE batched product
with two columns (one read of the states), the output o = S_new·q = S·(e^g⊙q) + u (k·q) without a second pass over
the updated states, and the rank-1 update S·e^g + u kᵀ as `mul_` + `baddbmm_` in place; q and k normalised in one
call. False: the earlier form (row sums of broadcast products: S⊙e^g, (S⊙k)Σ, S + u kᵀ, (S⊙q)Σ), for benchmarks."""

CHUNK_IN_PLACE = True
"""`kda_chunked`'s chunk-to-chunk recurrence on [sequences x heads] views updated in place (`_recurrence_in_place`:
u -= W Sᵀ, o = Qg Sᵀ + A u, S = S·decay + uᵀ Kd as 3-D `bmm` products added into u, o and S), the entry states kept
only when a checkpoint needs them; False: the earlier form (`_recurrence`), for benchmarks. (`baddbmm_` would fuse
the adds but on the CPU it runs one `addmm_` per matrix at these sizes: slower than bmm + add_.)"""

CHUNK = 16
"""Chunk length: short chunks keep the intra-chunk products cheap (C·K per token and head) and the gate
range inside a chunk small; the chunk recurrence is a handful of batched ops per chunk index."""


def _unique(idx: torch.Tensor) -> bool:
    ids = idx.tolist()
    return len(set(ids)) == len(ids)


def _slot_range(idx: torch.Tensor) -> slice | None:
    """The slots as a slice when they are consecutive and ascending (a batch admitted together usually is), so
    the pool rows are updated in place through a view instead of gathered and scattered back; else None."""
    ids = idx.tolist()
    return slice(ids[0], ids[0] + len(ids)) if ids and ids == list(range(ids[0], ids[0] + len(ids))) else None


def kda_decode(
    qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_states: torch.Tensor,
    raw_g: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    beta_logit: torch.Tensor,
    gate: torch.Tensor,
    o_norm_weight: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    *,
    lower_bound: float | None = None,
    scale: float | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    args = (qkv, conv_weight, conv_states, raw_g, A_log, dt_bias, beta_logit, gate, o_norm_weight, state_pool,
            state_indices, has_initial_state)
    kw = dict(lower_bound=lower_bound, scale=scale, eps=eps)
    dt = compute_dtype(qkv)
    N = qkv.shape[0]
    _, h, K = raw_g.shape
    V = state_pool.shape[2]
    P = h * K
    idx = cast(state_indices, torch.long)
    live = idx >= 0
    w = conv_weight.squeeze(1) if conv_weight.dim() == 3 else conv_weight
    if (qkv.dtype != dt or state_pool.dtype != dt or conv_states.dtype != dt or qkv.dim() != 2
            or qkv.shape[1] != 2 * P + h * V or tuple(w.shape[:1]) != (qkv.shape[1],)
            or tuple(conv_states.shape[1:]) != (w.shape[0], w.shape[1] - 1) or not _unique(idx[live])):
        return _ref_decode(*args, **kw)
    out = torch.zeros(N, h, V, dtype=dt)
    if not bool(live.all()):  # padded rows: zero output, nothing read or written
        rows = live.nonzero().squeeze(1)
        if rows.numel():
            init = None if has_initial_state is None else has_initial_state[rows]
            out[rows] = kda_decode(qkv[rows], conv_weight, conv_states, raw_g[rows], A_log, dt_bias, beta_logit[rows],
                                   gate.reshape(N, -1)[rows], o_norm_weight, state_pool, idx[rows], init, **kw)
        return cast(out, qkv.dtype)
    init = (torch.zeros(N, dtype=torch.bool) if has_initial_state is None
            else cast(has_initial_state, torch.bool).reshape(N))
    all_init = bool(init.all())
    rng = _slot_range(idx) if CONTIGUOUS_IN_PLACE else None
    hist = conv_states[rng] if rng is not None else conv_states.index_select(0, idx)  # [N, C, W-1]
    if not all_init:
        hist = torch.where(init[:, None, None], hist, 0)
    full = torch.cat([hist, qkv[:, :, None]], dim=2)  # [N, C, W]
    y = F.silu((full * cast(w, dt)).sum(-1))
    if rng is not None:
        conv_states[rng] = full[:, :, 1:]
    else:
        conv_states.index_copy_(0, idx, full[:, :, 1:])
    g = kda_gate(raw_g, A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(cast(beta_logit, dt))
    sc = K ** -0.5 if scale is None else scale
    v = y[:, 2 * P:].reshape(N, h, V)
    if DECODE_BMM:
        qk = l2_normalize(y[:, :2 * P].reshape(N, 2 * h, K), 1e-6)  # q and k of every head in one call
        q, k = qk[:, :h] * sc, qk[:, h:]
    else:
        q = l2_normalize(y[:, :P].reshape(N, h, K), 1e-6) * sc
        k = l2_normalize(y[:, P:2 * P].reshape(N, h, K), 1e-6)
    if rng is not None:  # a view of the pool rows: updated in place, nothing gathered or scattered
        S = state_pool[rng]
        if not all_init:
            S[~init] = 0
    else:
        S = state_pool.index_select(0, idx)  # [N, h, V, K]
        if not all_init:
            S = torch.where(init[:, None, None, None], S, 0)
    if DECODE_BMM:
        o = _delta_rule_bmm(S, torch.exp(g), q, k, v, beta)
        if rng is None:
            state_pool.index_copy_(0, idx, S)
        return cast(rms_norm(o, cast(o_norm_weight, dt), eps) * torch.sigmoid(cast(gate.reshape(N, h, V), dt)),
                    qkv.dtype)
    # matrix-vector products as multiply + row sums: a batched GEMM with one column is ~3x slower here
    S = S.mul_(torch.exp(g)[:, :, None, :])
    u = beta[:, :, None] * (v - (S * k[:, :, None, :]).sum(-1))
    S.add_(u[:, :, :, None] * k[:, :, None, :])  # S + u kᵀ, in place
    if rng is None:
        state_pool.index_copy_(0, idx, S)
    o = (S * q[:, :, None, :]).sum(-1)
    return cast(rms_norm(o, cast(o_norm_weight, dt), eps) * torch.sigmoid(cast(gate.reshape(N, h, V), dt)), qkv.dtype)


def _delta_rule_bmm(S: torch.Tensor, eg: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    beta: torch.Tensor) -> torch.Tensor:
    """One decode token's gated delta rule on states S [N, h, V, K] (updated in place to S·diag(e^g) + u kᵀ with
    u = β (v - S·diag(e^g)·k)); returns o = S_new·q [N, h, V]. eg = e^g [N, h, K]; q, k [N, h, K]; v [N, h, V];
    beta [N, h]. The two products with the decayed states read S once: S·(e^g⊙k) | S·(e^g⊙q) as one batched
    product with two columns, and S_new·q = S·(e^g⊙q) + u (k·q). S may be a strided view of the paged pools
    (workers/engine/cache_layout.py ssm_view): everything here takes any strides."""
    sk_sq = torch.matmul(S, torch.stack([eg * k, eg * q], dim=-1))  # [N, h, V, 2]: S e^g k | S e^g q
    u = beta[:, :, None] * (v - sk_sq[..., 0])
    o = torch.addcmul(sk_sq[..., 1], u, (k * q).sum(-1, keepdim=True))
    S.mul_(eg[:, :, None, :]).addcmul_(u[:, :, :, None], k[:, :, None, :])  # S e^g + u kᵀ, in place
    return o


def _gated_products(qc, kc, G):
    """(A_kk [n,H,C,C] strictly lower, A_qk [n,H,C,C] inclusive lower): Σ_k x_t[k] k_s[k] e^{G_t[k]-G_s[k]}
    for x = k, q; returns also the chunks computed pairwise (a bool [n])."""
    n, H, C, K = kc.shape
    incl = torch.ones(C, C, dtype=torch.bool).tril()
    Gm = G[:, :, (C - 1) // 2 : (C - 1) // 2 + 1, :]
    rel = G - Gm
    pairwise = rel.abs().amax(dim=(1, 2, 3)) >= FACTOR_LIMIT[G.dtype]
    ke = (kc * torch.exp(-rel)).transpose(-1, -2)
    eG = torch.exp(rel)
    a_kk = ((kc * eG) @ ke).tril(-1)
    a_qk = ((qc * eG) @ ke).masked_fill_(~incl, 0)
    if bool(pairwise.any()):
        p = pairwise.nonzero().squeeze(1)
        Gp, kp = G[p], kc[p]
        diff = (Gp[:, :, :, None, :] - Gp[:, :, None, :, :]).masked_fill(~incl[:, :, None], float("-inf"))
        m = torch.exp(diff).mul_(kp[:, :, None, :, :])  # [p, H, t, s, K]: k_s e^{G_t - G_s}
        a_kk[p] = (m * kp[:, :, :, None, :]).sum(-1).tril(-1)
        a_qk[p] = (m * qc[p][:, :, :, None, :]).sum(-1)
    return a_kk, a_qk, pairwise


def _recurrence(S, spans, wk, u, qg, a_qk, decay_end, kd, entry):
    """The chunk-to-chunk recurrence (the earlier form): for each chunk step (c0, nrun) of `spans` the running
    sequences' states S[:nrun] [A, H, V, K] give the chunks' corrected u (in place), outputs and the next states
    (S in place); entry[c] = the state entering chunk c. Returns the chunk outputs [n, H, C, V]."""
    n, H, C, _ = qg.shape
    oc = torch.empty(n, H, C, u.shape[-1], dtype=S.dtype)
    for c0, nrun in spans:
        sl = slice(c0, c0 + nrun)
        S_run = S[:nrun]
        entry[sl] = S_run
        St = S_run.transpose(-1, -2)  # [A, H, K, V]
        u[sl] -= wk[sl] @ St
        oc[sl] = qg[sl] @ St + a_qk[sl] @ u[sl]
        S[:nrun] = S_run * decay_end[sl] + u[sl].transpose(-1, -2) @ kd[sl]
    return oc


def _recurrence_in_place(S, spans, wk, u, qg, a_qk, decay_end, kd, entry):
    """`_recurrence` on [A*H, ., .] views: the outputs computed into their rows (bmm out=), the corrections and the
    state update added in place (no copies of u, o or S); `entry` may be None (not kept)."""
    n, H, C, K = qg.shape
    V = u.shape[-1]
    oc = torch.empty(n, H, C, V, dtype=S.dtype)
    for c0, nrun in spans:
        sl = slice(c0, c0 + nrun)
        S_run = S[:nrun]
        if entry is not None:
            entry[sl] = S_run
        St = S_run.view(nrun * H, V, K).transpose(1, 2)  # [A*H, K, V]
        u_r = u[sl].view(nrun * H, C, V)
        u_r.sub_(torch.bmm(wk[sl].reshape(nrun * H, C, K), St))  # u -= W Sᵀ
        o_r = oc[sl].view(nrun * H, C, V)
        torch.bmm(qg[sl].reshape(nrun * H, C, K), St, out=o_r)
        o_r.add_(torch.bmm(a_qk[sl].reshape(nrun * H, C, C), u_r))  # Qg Sᵀ + A u
        S3 = S_run.view(nrun * H, V, K)
        S3.mul_(decay_end[sl].reshape(nrun * H, 1, K)).add_(torch.bmm(u_r.transpose(1, 2), kd[sl].reshape(nrun * H, C, K)))
    return oc


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    checkpoint_seq: torch.Tensor | None = None,
    checkpoint_offsets: torch.Tensor | None = None,
    checkpoint_slots: torch.Tensor | None = None,
    chunk_size: int = 64,
    host=None,
) -> torch.Tensor:
    # `host` (kernels/reference/_varlen.py HostVarlen): not needed on the CPU, where reading the indices is free
    args = (q, k, v, g, beta, state_pool, state_indices, cu_seqlens, has_initial_state)
    kw = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, checkpoint_seq=checkpoint_seq,
              checkpoint_offsets=checkpoint_offsets, checkpoint_slots=checkpoint_slots)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    kb = prepare(*args, scale, use_qk_l2norm, checkpoint_seq, checkpoint_offsets, checkpoint_slots)
    dt = kb.dtype
    seqs = [b for b, s in enumerate(kb.slots) if s >= 0]
    if state_pool.dtype != dt or len({kb.slots[b] for b in seqs}) != len(seqs):
        return _ref_chunked(*args, chunk_size=chunk_size, **kw)
    T, H, K = kb.q.shape
    Vd = kb.v.shape[-1]
    o = torch.zeros(T + 1, H, Vd, dtype=dt)
    if not seqs:
        return cast(o[:T], v.dtype)
    lens = {b: kb.cu[b + 1] - kb.cu[b] for b in seqs}
    if not any(lens.values()):
        return _ref_chunked(*args, chunk_size=chunk_size, **kw)
    # the padding token (index T): zeros everywhere, so it leaves the state and the gate sums unchanged
    qz, kz, vz, gz = (torch.cat([t, t.new_zeros(1, *t.shape[1:])]) for t in (kb.q, kb.k, kb.v, kb.g))
    bz = torch.cat([kb.beta, kb.beta.new_zeros(1, H)])
    C = CHUNK
    # sequences by chunk count, longest first: at chunk step j the running ones are a prefix
    nch = {b: -(-lens[b] // C) for b in seqs}
    order = sorted(seqs, key=lambda b: -nch[b])
    tok_rows, spans = [], []  # spans[j] = (first chunk, number of sequences) of step j
    for j in range(max(nch.values())):
        run = [b for b in order if nch[b] > j]
        spans.append((len(tok_rows), len(run)))
        for b in run:
            t0 = kb.cu[b] + j * C
            n = min(C, kb.cu[b + 1] - t0)
            tok_rows.append(list(range(t0, t0 + n)) + [T] * (C - n))
    idx = torch.tensor(tok_rows)  # [n_chunks, C]
    qc, kc, gc = (t[idx].transpose(1, 2) for t in (qz, kz, gz))  # [n, H, C, K]
    G = gc.cumsum(dim=2)
    vc = vz[idx].transpose(1, 2)  # [n, H, C, V]
    bc = bz[idx].transpose(1, 2)  # [n, H, C]
    a_kk, a_qk, _ = _gated_products(qc, kc, G)
    a_kk = a_kk * bc[..., None]
    eG = torch.exp(G)
    rhs = bc[..., None] * torch.cat([kc * eG, vc], dim=-1)
    eye = torch.eye(C, dtype=dt)
    wu = torch.linalg.solve_triangular(eye + a_kk, rhs, upper=False, unitriangular=True)
    wk, u = wu[..., :K], wu[..., K:].clone()
    qg = qc * eG
    G_end = G[:, :, -1:, :]  # [n, H, 1, K]: the padding keeps it at the last real token's value
    kd = kc * torch.exp(G_end - G)
    decay_end = torch.exp(G_end)
    slots = torch.tensor([kb.slots[b] for b in order])
    init = torch.tensor([kb.init[b] for b in order])
    S = torch.where(init[:, None, None, None], state_pool[slots], 0)  # [B, H, V, K]
    entry = torch.empty(idx.shape[0], H, Vd, K, dtype=dt) if kb.ckpts or not CHUNK_IN_PLACE else None
    form = _recurrence_in_place if CHUNK_IN_PLACE else _recurrence
    oc = form(S, spans, wk, u, qg, a_qk, decay_end, kd, entry)
    o[idx.reshape(-1)] = oc.transpose(1, 2).reshape(-1, H, Vd)
    state_pool[slots] = S
    if kb.ckpts:  # the state after `off` tokens: from the entry state of the chunk that holds token off-1
        chunk_of = {}
        for j, (c0, nrun) in enumerate(spans):
            for r in range(nrun):
                chunk_of[(order[r], j)] = c0 + r
        for b in sorted(kb.ckpts):
            if kb.slots[b] < 0:  # a padded sequence: its exports are skipped, as the reference and Triton forms do
                continue
            for off, slot in kb.ckpts[b]:
                j, n = (off - 1) // C, off - (off - 1) // C * C
                c = chunk_of[(b, j)]
                Gn = G[c, :, n - 1:n, :]
                kdn = kc[c, :, :n] * torch.exp(Gn - G[c, :, :n])
                state_pool[slot] = entry[c] * torch.exp(Gn) + u[c, :, :n].transpose(-1, -2) @ kdn
    return cast(o[:T], v.dtype)
