"""KDA over short chunks on the CPU (speculative verify steps): conv, gate and delta rule token by token.

A verify chunk is 1 + k tokens per request (k <= 8, workers/engine/spec/rollback.py); the chunked form
(kernels/cpu/kda.py `kda_chunked`: intra-chunk products, a triangular solve, checkpoint states rebuilt
from chunk entries) costs far more than the few tokens need. Here, as in `kda_decode`, every sequence's
conv history and state are gathered with one index, and the T tokens are walked in order with the
recurrent delta rule, all sequences at once ([n, Lt] padded layout; a padding token has g = 0 and
beta = 0, which leaves the state unchanged). The state after every token lands in one [n, Lt, H, V, K]
buffer, so the final states and every checkpoint export (the multi-slot rollback's states after 1..T-1
tokens) are plain gathers from it; the conv windows after any offset are slices of [history | chunk].

Contract: `kda_verify_composed` below (the short conv with exports, the gate, `kda_chunked` with the same
exports) for the delta rule's output o [T, H, V] before o_norm, in the compute dtype; final states are
written first, checkpoints after, later checkpoints to the same slot win (as in the reference ops).
Inputs outside the fast path (a sequence longer than `MAX_TOKENS` or empty, a state slot shared by two
sequences, mixed dtypes) go to the composed form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..reference._varlen import bool_list, checkpoints_by_seq, compute_dtype, int_list, seq_starts
from ..reference.kda_gate import kda_gate
from ..reference.norms import l2_normalize
from .conv import causal_conv1d_varlen
from .kda import kda_chunked

MAX_TOKENS = 9
"""Longest sequence (tokens in this step) the token walk takes: 1 + k for k <= 8 drafts."""


def padded_token_index(starts: list[int], lens: list[int], pad_row: int) -> torch.Tensor:
    """[R, max(lens)]: row r's tokens starts[r] .. starts[r] + lens[r] - 1 of a token-major tensor, then `pad_row`
    (the index of an appended zero row) up to the longest row: the padded [R, Lt] layout of the token walks."""
    Lt = max(lens)
    return torch.tensor([[s0 + t if t < n else pad_row for t in range(Lt)] for s0, n in zip(starts, lens)])


def conv_over_history(conv_states: torch.Tensor, idx: torch.Tensor, init: list[bool], x: torch.Tensor,
                      w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The short conv of padded chunks x [R, Lt, C] after their windows conv_states[idx] (zeros where not init),
    which are only read: (full [R, W-1+Lt, C] = [history | chunk], y [R, Lt, C] = SiLU of the window product), in
    x's dtype. The window product: a grouped conv1d costs ~150 us at these sizes."""
    hist = conv_states.index_select(0, idx).to(x.dtype)  # [R, C, W-1]
    if not all(init):
        hist = torch.where(torch.tensor(init)[:, None, None], hist, 0)
    full = torch.cat([hist.transpose(1, 2), x], dim=1)
    return full, F.silu((full.unfold(1, w.shape[1], 1) * w.to(x.dtype)).sum(-1))


def kda_verify_composed(qkv, conv_weight, conv_states, raw_g, A_log, dt_bias, beta_logit, state_pool,
                        state_indices, cu_seqlens, has_initial_state, *, lower_bound=None, scale=None,
                        checkpoint_seq=None, checkpoint_offsets=None, checkpoint_slots=None,
                        conv=causal_conv1d_varlen, gate=kda_gate, chunked=kda_chunked):
    """The contract: what workers/engine/k3_forward.py's KDA layer computes for a prefill/verify batch."""
    ck = dict(checkpoint_seq=checkpoint_seq, checkpoint_offsets=checkpoint_offsets,
              checkpoint_slots=checkpoint_slots)
    T = qkv.shape[0]
    _, h, K = raw_g.shape
    V = state_pool.shape[2]
    y = conv(qkv, conv_weight, conv_states, state_indices, cu_seqlens, has_initial_state, activation="silu", **ck)
    q, k, v = y.split([h * K, h * K, h * V], dim=-1)
    g = gate(raw_g, A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(beta_logit.to(compute_dtype(qkv)))
    return chunked(q.reshape(T, h, K), k.reshape(T, h, K), v.reshape(T, h, V), g, beta, state_pool, state_indices,
                   cu_seqlens, has_initial_state, scale=scale, use_qk_l2norm=True, **ck)


def kda_verify(qkv, conv_weight, conv_states, raw_g, A_log, dt_bias, beta_logit, state_pool, state_indices,
               cu_seqlens, has_initial_state, *, lower_bound=None, scale=None, checkpoint_seq=None,
               checkpoint_offsets=None, checkpoint_slots=None):
    """o [T, H, V] (compute dtype): see the module docstring and `kda_verify_composed`."""
    args = (qkv, conv_weight, conv_states, raw_g, A_log, dt_bias, beta_logit, state_pool, state_indices,
            cu_seqlens, has_initial_state)
    kw = dict(lower_bound=lower_bound, scale=scale, checkpoint_seq=checkpoint_seq,
              checkpoint_offsets=checkpoint_offsets, checkpoint_slots=checkpoint_slots)
    dt = compute_dtype(qkv)
    N = qkv.shape[0]
    _, h, K = raw_g.shape
    V = state_pool.shape[2]
    P = h * K
    w = conv_weight.squeeze(1) if conv_weight.dim() == 3 else conv_weight
    W = w.shape[1]
    if (qkv.dtype != dt or state_pool.dtype != dt or conv_states.dtype != dt or qkv.dim() != 2
            or qkv.shape[1] != 2 * P + h * V or tuple(w.shape[:1]) != (qkv.shape[1],)
            or tuple(conv_states.shape[1:]) != (w.shape[0], W - 1) or tuple(raw_g.shape[:1]) != (N,)
            or tuple(state_pool.shape[1:]) != (h, V, K) or W < 2):
        return kda_verify_composed(*args, **kw)
    cu = seq_starts(cu_seqlens)
    B = len(cu) - 1
    lens = [cu[b + 1] - cu[b] for b in range(B)]
    slots = int_list(state_indices, B, "state_indices")
    live = [b for b in range(B) if slots[b] >= 0]
    if (cu[-1] > N or not live or any(not 1 <= lens[b] <= MAX_TOKENS for b in live)
            or len({slots[b] for b in live}) != len(live)):
        return kda_verify_composed(*args, **kw)
    init = bool_list(has_initial_state, B, "has_initial_state")
    ckpts = checkpoints_by_seq(checkpoint_seq, checkpoint_offsets, checkpoint_slots, lens, min_offset=1)
    n = len(live)
    Lt = max(lens[b] for b in live)
    dense = n == B and all(lens[b] == Lt for b in live) and cu[-1] == N  # [B, Lt] is a view of the batch
    C = qkv.shape[1]
    if dense:
        x = qkv.reshape(n, Lt, C)
        tok = None
    else:  # padded layout: row N of the padded inputs is the padding token (zeros)
        tok = padded_token_index([cu[b] for b in live], [lens[b] for b in live], N)
        x = torch.cat([qkv, qkv.new_zeros(1, C)])[tok]
    idx = torch.tensor([slots[b] for b in live])
    init_l = [init[b] for b in live]
    # -- short conv: [history | chunk] per sequence, the windows of the whole batch at once
    full, y = conv_over_history(conv_states, idx, init_l, x, w)  # [n, W-1+Lt, C], [n, Lt, C]
    qk = l2_normalize(y[..., :2 * P].reshape(n, Lt, 2 * h, K), 1e-6)  # q and k normalised together
    q = qk[:, :, :h] * (K ** -0.5 if scale is None else scale)
    k = qk[:, :, h:, None, :]  # [n, Lt, H, 1, K]
    v = y[..., 2 * P:].reshape(n, Lt, h, V)
    g = kda_gate(raw_g, A_log, dt_bias, lower_bound).to(dt)  # [N, H, K]
    beta = torch.sigmoid(beta_logit.to(dt)).reshape(N, h)
    if tok is not None:  # padding tokens: g = 0 (decay 1), beta = 0 (no update)
        g = torch.cat([g, g.new_zeros(1, h, K)])[tok]
        beta = torch.cat([beta, beta.new_zeros(1, h)])[tok]
    eg = torch.exp(g).view(n, Lt, h, 1, K)
    beta = beta.view(n, Lt, h, 1)
    # -- the delta rule, token by token: Sh[:, t] = the state after t + 1 tokens
    S = state_pool.index_select(0, idx)  # [n, H, V, K]
    if not all(init_l):
        S = torch.where(torch.tensor(init_l)[:, None, None, None], S, 0)
    Sh = torch.empty(n, Lt, h, V, K, dtype=dt)
    for St, eg_t, k_t, v_t, b_t in zip(Sh.unbind(1), eg.unbind(1), k.unbind(1), v.unbind(1), beta.unbind(1)):
        torch.mul(S, eg_t, out=St)
        u = (v_t - (St * k_t).sum(-1)).mul_(b_t)  # [n, H, V]
        S = St.add_(u[..., None] * k_t)  # S + u kᵀ, in place
    o = (Sh * q[:, :, :, None, :]).sum(-1)  # [n, Lt, H, V]: every token's output at once
    # -- writes, one per pool: final conv windows and states, then checkpoints (the later one wins a slot)
    writes = {slots[b]: (r, lens[b]) for r, b in enumerate(live)}  # slot -> (row, tokens)
    row_of = {b: r for r, b in enumerate(live)}
    for b in sorted(ckpts):
        if b in row_of:  # a padding row's exports: nothing (as in the reference ops)
            for off, slot in ckpts[b]:
                writes[slot] = (row_of[b], off)
    # (flat index_select: advanced indexing over two dimensions costs ~80 us here)
    ws, wi, wj = torch.tensor([(sl, r * Lt + off - 1, r * (Lt + 1) + off)
                               for sl, (r, off) in writes.items()]).unbind(1)
    state_pool.index_copy_(0, ws, Sh.view(n * Lt, h, V, K).index_select(0, wi))
    wins = full.unfold(1, W - 1, 1).reshape(n * (Lt + 1), C, W - 1)  # [.., C, W-1]: the window after j tokens
    conv_states.index_copy_(0, ws, wins.index_select(0, wj))
    if dense:
        return o.reshape(N, h, V)
    out = torch.zeros(N + 1, h, V, dtype=dt)
    out[tok.reshape(-1)] = o.reshape(-1, h, V)
    return out[:N]
