"""RecoverSSM ops for KDA speculative decoding (the scheme: workers/engine/spec/recover_ssm.py).

A verify step runs the 1 + k tokens of each speculative request from its checkpoint state S0 and
NEVER writes S0; instead it records, per token t, the delta rule's correction u_t (the pseudo-value
of kernels/reference/kda_chunked.py's WY form: S_t = S'_{t-1} + u_t k̂_tᵀ with S' the decayed state).
After sampling, the accepted prefix of c tokens is folded into the checkpoint:

    S_c = S0 · diag(e^{G_c}) + Σ_{s≤c} u_s (k̂_s ⊙ e^{G_c - G_s})ᵀ,   G_t = Σ_{r≤t} g_r,

which is exactly the state the recurrence reaches after c tokens (a rejected draft is only a smaller
c). The conv window after c tokens is the last K-1 raw inputs of [history | x_1..x_c].

The reference path is plain PyTorch (any device); math in fp32, fp64 when any input is fp64, like kernels/reference.
State pools are [num_slots, H, V, K] ([v][k]) and conv pools [num_slots, C, K-1], as in the reference
ops. Record tensors are padded per request row: [R, Tmax, H, *] (token-major like the [T, H, *] inputs).

On CUDA the state ops go to kernels/triton/kda_recover.py (token-serial Triton kernels, no host sync)
when the shapes suit them; K3SERVE_KERNELS=reference / =triton force either side, as in kernels/ops.py.
"""

from __future__ import annotations

import os

import torch

from .reference._varlen import bool_list, compute_dtype, int_list, seq_starts
from .reference.norms import l2_normalize


def _triton(*tensors: torch.Tensor, K: int, V: int):
    """kernels.triton.kda_recover when it should handle these tensors, else None (the reference)."""
    mode = os.environ.get("K3SERVE_KERNELS", "")
    if not ((tensors[0].is_cuda and mode != "reference") or mode == "triton"):
        return None
    try:
        from .triton import kda_recover as tk
    except ModuleNotFoundError as e:
        if e.name != "triton":
            raise
        return None
    return tk if tk.supported(*tensors, K=K, V=V) else None


def _chunk_with_u(S0, q, k, v, g, beta):
    """One chunk of n tokens for R rows at once, the WY form of kernels/reference/kda_chunked.py.

    S0 [R,H,V,K]; q, k, g [R,n,H,K] (q̂ scaled, k̂ normalised); v [R,n,H,V]; beta [R,n,H].
    Returns (o [R,n,H,V], u [R,n,H,V], state after the chunk [R,H,V,K]).
    """
    q, k, v, g = (t.transpose(1, 2) for t in (q, k, v, g))  # [R, H, n, *]
    beta = beta.transpose(1, 2)  # [R, H, n]
    n = q.shape[2]
    G = g.cumsum(dim=2)
    incl = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    diff = (G[:, :, :, None, :] - G[:, :, None, :, :]).masked_fill(~incl[None, None, :, :, None], float("-inf"))
    decay = torch.exp(diff)  # [R, H, t, s, K]
    a_kk = torch.einsum("rhtk,rhsk,rhtsk->rhts", k, k, decay).tril(-1) * beta[..., None]
    a_qk = torch.einsum("rhtk,rhsk,rhtsk->rhts", q, k, decay)
    eye = torch.eye(n, dtype=q.dtype, device=q.device)
    eG = torch.exp(G)
    rhs = beta[..., None] * torch.cat([k * eG, v], dim=-1)
    wu = torch.linalg.solve_triangular(eye + a_kk, rhs, upper=False, unitriangular=True)
    w, u = wu[..., : k.shape[-1]], wu[..., k.shape[-1]:]
    u = u - torch.einsum("rhtk,rhvk->rhtv", w, S0)
    o = torch.einsum("rhtk,rhvk->rhtv", q * eG, S0) + a_qk @ u
    Gn = G[:, :, n - 1 : n, :]
    S = S0 * torch.exp(Gn) + torch.einsum("rhsv,rhsk->rhvk", u, k * torch.exp(Gn - G))
    return o.transpose(1, 2), u.transpose(1, 2), S


def _pad_rows(x: torch.Tensor, cu: list[int], tmax: int) -> torch.Tensor:
    """[T, *] flat tokens -> [R, tmax, *] zero-padded per row."""
    R = len(cu) - 1
    out = x.new_zeros((R, tmax) + tuple(x.shape[1:]))
    for r in range(R):
        out[r, : cu[r + 1] - cu[r]] = x[cu[r] : cu[r + 1]]
    return out


def _initial_states(state_pool, slots, init, dt):
    H, V, K = state_pool.shape[1:]
    S0 = torch.zeros((len(slots), H, V, K), dtype=dt, device=state_pool.device)
    for r, (s, i) in enumerate(zip(slots, init)):
        if i:
            S0[r] = state_pool[s].to(dt)
    return S0


def kda_recover_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    corrections: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> torch.Tensor:
    """The verify pass: `kda_chunked`'s outputs for R sequences, without writing any state.

    Inputs as kernels/reference/kda_chunked.py (q, k, g [T, H, K]; v [T, H, V]; beta [T, H]; cu_seqlens
    [R+1]; state_indices [R] >= 0; has_initial_state bool [R] or None). `state_pool` is only READ.
    corrections: Tensor[R', Tmax, H, V] with R' >= R and Tmax >= every sequence's length, any float dtype;
    row r receives u_t of sequence r at [r, t] for t < len_r (the rest of the row is left as it is).
    Returns o [T, H, V] in v's dtype.
    """
    T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or g.shape != q.shape or tuple(v.shape[:2]) != (T, H) or tuple(beta.shape) != (T, H):
        raise ValueError(f"KDA shapes: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"g {tuple(g.shape)} beta {tuple(beta.shape)}")
    tk = _triton(q, k, v, g, beta, state_pool, corrections, K=K, V=V)
    if tk is not None:
        if tuple(state_pool.shape[1:]) != (H, V, K) or tuple(corrections.shape[2:]) != (H, V):
            raise ValueError(f"state_pool {tuple(state_pool.shape)} / corrections {tuple(corrections.shape)} "
                             f"vs [*, {H}, {V}, {K}]")
        return tk.kda_recover_verify_triton(q, k, v, g, beta, state_pool, state_indices, cu_seqlens,
                                            has_initial_state, corrections, scale=scale,
                                            use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
    cu = seq_starts(cu_seqlens)
    R = len(cu) - 1
    lens = [cu[r + 1] - cu[r] for r in range(R)]
    if cu[-1] > T:
        raise ValueError(f"cu_seqlens ends at {cu[-1]} but there are only {T} tokens")
    if tuple(state_pool.shape[1:]) != (H, V, K):
        raise ValueError(f"state_pool {tuple(state_pool.shape)} must be [num_slots, {H}, {V}, {K}] ([v][k])")
    tmax = max(lens, default=0)
    if corrections.dim() != 4 or corrections.shape[0] < R or corrections.shape[1] < tmax or \
            tuple(corrections.shape[2:]) != (H, V):
        raise ValueError(f"corrections {tuple(corrections.shape)} must be [>= {R}, >= {tmax}, {H}, {V}]")
    slots = int_list(state_indices, R, "state_indices")
    if any(s < 0 for s in slots):
        raise ValueError("kda_recover_verify: every sequence needs a state slot (no padded rows)")
    init = bool_list(has_initial_state, R, "has_initial_state")
    dt = compute_dtype(q, k, v, g, beta, state_pool)
    scale = K ** -0.5 if scale is None else scale
    qf, kf = q.to(dt), k.to(dt)
    if use_qk_l2norm:
        qf, kf = l2_normalize(qf, 1e-6), l2_normalize(kf, 1e-6)
    qf = qf * scale
    o = torch.zeros((T, H, V), dtype=dt, device=v.device)
    if R == 0 or tmax == 0:
        return o.to(v.dtype)
    P = [_pad_rows(t, cu, tmax) for t in (qf, kf, v.to(dt), g.to(dt), beta.to(dt))]
    S = _initial_states(state_pool, slots, init, dt)
    u_all = torch.zeros((R, tmax, H, V), dtype=dt, device=v.device)
    o_pad = torch.zeros((R, tmax, H, V), dtype=dt, device=v.device)
    for c0 in range(0, tmax, chunk_size):  # padded tokens have k = v = beta = g = 0: u = 0, S unchanged
        sl = slice(c0, min(c0 + chunk_size, tmax))
        o_pad[:, sl], u_all[:, sl], S = _chunk_with_u(S, *(t[:, sl] for t in P))
    for r in range(R):
        o[cu[r] : cu[r + 1]] = o_pad[r, : lens[r]]
        corrections[r, : lens[r]] = u_all[r, : lens[r]].to(corrections.dtype)
    return o.to(v.dtype)


def kda_recover_fold(
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    k: torch.Tensor,
    g: torch.Tensor,
    corrections: torch.Tensor,
    num_tokens: torch.Tensor,
    out_slots: torch.Tensor,
    *,
    use_qk_l2norm: bool = True,
) -> None:
    """The commit: state_pool[out_slots[n]] = the state after num_tokens[n] tokens of record row n.

    state_indices [N]: row n's checkpoint S0 (zeros where has_initial_state[n] is False); k, g
    [N, Tmax, H, K]: the keys as given to the verify (before l2 normalisation) and the log-decays;
    corrections [N, Tmax, H, V] from `kda_recover_verify`; num_tokens [N] in [0, Tmax] (0 copies S0).
    Every S0 is read before any slot is written, so an out slot may be its own or another row's S0.
    """
    N, tmax, H, K = k.shape
    V = corrections.shape[-1]
    if g.shape != k.shape or tuple(corrections.shape[:3]) != (N, tmax, H):
        raise ValueError(f"records: k {tuple(k.shape)} g {tuple(g.shape)} corrections {tuple(corrections.shape)}")
    if tuple(state_pool.shape[1:]) != (H, V, K):
        raise ValueError(f"state_pool {tuple(state_pool.shape)} must be [num_slots, {H}, {V}, {K}]")
    tk = _triton(state_pool, k, g, corrections, K=K, V=V)
    if tk is not None:
        tk.kda_recover_fold_triton(state_pool, state_indices, has_initial_state, k, g, corrections, num_tokens,
                                   out_slots, use_qk_l2norm=use_qk_l2norm)
        return
    slots = int_list(state_indices, N, "state_indices")
    outs = int_list(out_slots, N, "out_slots")
    counts = int_list(num_tokens, N, "num_tokens")
    if any(not 0 <= c <= tmax for c in counts):
        raise ValueError(f"num_tokens must be in [0, {tmax}]; got {counts}")
    init = bool_list(has_initial_state, N, "has_initial_state")
    if N == 0:
        return
    dt = compute_dtype(k, g, corrections, state_pool)
    S0 = _initial_states(state_pool, slots, init, dt)
    dev = state_pool.device
    c = torch.tensor(counts, dtype=torch.long, device=dev)
    keep = torch.arange(tmax, device=dev)[None, :] < c[:, None]  # [N, Tmax]
    kf = k.to(dt)
    if use_qk_l2norm:
        kf = l2_normalize(kf, 1e-6)
    gm = g.to(dt).masked_fill(~keep[:, :, None, None], 0.0)
    G = gm.cumsum(dim=1)  # [N, Tmax, H, K]
    Gc = G.gather(1, (c - 1).clamp_min(0).view(N, 1, 1, 1).expand(N, 1, H, K))  # [N, 1, H, K]
    Gc = Gc.masked_fill((c == 0).view(N, 1, 1, 1), 0.0)
    kd = (kf * torch.exp((Gc - G).masked_fill(~keep[:, :, None, None], float("-inf"))))  # s <= c only
    u = corrections.to(dt).masked_fill(~keep[:, :, None, None], 0.0)
    S = S0 * torch.exp(Gc.squeeze(1))[:, :, None, :] + torch.einsum("nshv,nshk->nhvk", u, kd)
    for n in range(N):
        state_pool[outs[n]].copy_(S[n].to(state_pool.dtype))


def conv_window_fold(
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    x: torch.Tensor,
    num_tokens: torch.Tensor,
    out_slots: torch.Tensor,
) -> None:
    """The conv commit: conv_states[out_slots[n]] = the last K-1 raw inputs of
    [history of row n | x[n, :num_tokens[n]]], history = conv_states[state_indices[n]] (zeros where
    has_initial_state[n] is False). x [N, Tmax, C] raw (pre-conv) inputs; conv_states [slots, C, K-1].
    All histories are read before any slot is written."""
    N, tmax, C = x.shape
    if conv_states.shape[1] != C:
        raise ValueError(f"conv_states {tuple(conv_states.shape)} vs inputs {tuple(x.shape)}")
    for name, t in (("state_indices", state_indices), ("num_tokens", num_tokens), ("out_slots", out_slots)):
        if t.numel() != N:
            raise ValueError(f"{name}: expected {N} entries, got {t.numel()}")
    if N == 0:
        return
    if not num_tokens.is_cuda and any(not 0 <= c <= tmax for c in num_tokens.tolist()):
        raise ValueError(f"num_tokens must be in [0, {tmax}]; got {num_tokens.tolist()}")
    w = conv_states.shape[2]
    dev = conv_states.device
    hist = conv_states.index_select(0, state_indices.to(device=dev, dtype=torch.long))  # [N, C, K-1] (a copy)
    if has_initial_state is not None:
        keep = has_initial_state.to(device=dev, dtype=torch.bool).view(N, 1, 1)
        hist = torch.where(keep, hist, torch.zeros((), dtype=hist.dtype, device=dev))
    full = torch.cat([hist, x.to(device=dev, dtype=conv_states.dtype).transpose(1, 2)], dim=2)  # [N, C, K-1+Tmax]
    start = num_tokens.to(device=dev, dtype=torch.long).view(N, 1, 1)
    cols = (start + torch.arange(w, device=dev).view(1, 1, w)).expand(N, C, w)
    conv_states.index_copy_(0, out_slots.to(device=dev, dtype=torch.long), full.gather(2, cols))


def kda_recover_commit_rows(
    state_pool: torch.Tensor,
    conv_states: torch.Tensor,
    s0_slots: torch.Tensor,
    inits: torch.Tensor,
    rec_rows: torch.Tensor,
    seg: torch.Tensor,
    key_gate: torch.Tensor,
    corrections: torch.Tensor,
    conv_inputs: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    counts: torch.Tensor,
    outs: torch.Tensor,
    *,
    use_qk_l2norm: bool = True,
) -> None:
    """The commit of R requests at one KDA layer: for request r and each entry n in seg[r]..seg[r+1],
    the state and conv window after counts[n] tokens of record row rec_rows[r] go to slot outs[n] of
    `state_pool` / `conv_states`.

    s0_slots / inits [R]: each request's checkpoint (its running block; zeros where inits is False),
    read before anything of that request is written, so a request's LAST out slot may be its own
    s0 slot. key_gate [Rb, T, H, 2K] = [k as given to the verify | raw gate before
    ops.kda_gate(·, A_log, dt_bias, lower_bound)]; corrections [Rb, T, H, V] from `kda_recover_verify`;
    conv_inputs [Rb, T, C] raw conv inputs; seg [R+1] int offsets into counts / outs [E]; counts
    ascending in [0, T] within each request; outs distinct. The reference composes ops.kda_gate,
    `kda_recover_fold` and `conv_window_fold` per request; on CUDA it is two Triton launches for all R.
    """
    _, T, H, K2 = key_gate.shape
    K = K2 // 2
    V = corrections.shape[-1]
    R = s0_slots.numel()
    if tuple(corrections.shape[1:3]) != (T, H) or conv_inputs.shape[1] != T or counts.numel() != outs.numel() \
            or inits.numel() != R or rec_rows.numel() != R or seg.numel() != R + 1:
        raise ValueError(f"records: key_gate {tuple(key_gate.shape)} corrections {tuple(corrections.shape)} "
                         f"conv_inputs {tuple(conv_inputs.shape)}; {R} requests, seg {seg.numel()}, "
                         f"counts {counts.numel()}, outs {outs.numel()}")
    if not counts.is_cuda:
        c, bounds = counts.tolist(), seg.tolist()
        for r in range(R):
            part = c[bounds[r] : bounds[r + 1]]
            if any(not 0 <= x <= T for x in part) or part != sorted(part):
                raise ValueError(f"counts must be ascending in [0, {T}] per request; got {part}")
    tk = _triton(state_pool, key_gate, corrections, K=K, V=V)
    if tk is not None:
        tk.kda_recover_commit_rows_triton(state_pool, conv_states, s0_slots, inits, rec_rows, seg, key_gate,
                                          corrections, conv_inputs, A_log, dt_bias, lower_bound, counts, outs,
                                          use_qk_l2norm=use_qk_l2norm)
        return
    from . import ops

    dev = state_pool.device
    bounds = [int(b) for b in seg.tolist()]
    slots, has, recs = s0_slots.tolist(), [bool(v) for v in inits.tolist()], rec_rows.tolist()
    for r in range(R):
        e0, e1 = bounds[r], bounds[r + 1]
        N = e1 - e0
        if N == 0:
            continue
        kg = key_gate[recs[r]]
        g = ops.kda_gate(kg[..., K:], A_log, dt_bias, lower_bound)
        slot = torch.full((N,), int(slots[r]), dtype=torch.long, device=dev)
        init = torch.full((N,), has[r], dtype=torch.bool, device=dev)
        kda_recover_fold(state_pool, slot, init, kg[..., :K].expand(N, T, H, K), g.expand(N, T, H, K),
                         corrections[recs[r]].expand(N, T, H, V), counts[e0:e1], outs[e0:e1],
                         use_qk_l2norm=use_qk_l2norm)
        conv_window_fold(conv_states, slot, init, conv_inputs[recs[r]].expand(N, T, conv_inputs.shape[2]),
                         counts[e0:e1], outs[e0:e1])


def kda_recover_commit(state_pool, conv_states, s0_slot: int, init: bool, key_gate, corrections, conv_inputs,
                       A_log, dt_bias, lower_bound, counts, outs, *, use_qk_l2norm: bool = True) -> None:
    """`kda_recover_commit_rows` for one request: key_gate [T, H, 2K], corrections [T, H, V],
    conv_inputs [T, C]; counts / outs [N] (counts ascending; the last out may be s0_slot)."""
    dev = state_pool.device
    lt = dict(dtype=torch.long, device=dev)
    kda_recover_commit_rows(state_pool, conv_states, torch.tensor([int(s0_slot)], **lt),
                            torch.tensor([bool(init)], dtype=torch.bool, device=dev), torch.zeros(1, **lt),
                            torch.tensor([0, counts.numel()], **lt), key_gate.unsqueeze(0), corrections.unsqueeze(0),
                            conv_inputs.unsqueeze(0), A_log, dt_bias, lower_bound, counts, outs,
                            use_qk_l2norm=use_qk_l2norm)
