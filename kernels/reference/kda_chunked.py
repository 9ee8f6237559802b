"""KDA in chunk form (WY / UT transform, like FLA's chunk_kda): exactly equal to `kda_recurrent`.

Per chunk of n tokens with entry state S0 [H, V, K] (per head; t, s index tokens of the chunk, 1-based):
    G_t = Σ_{r≤t} g_r                            cumulative log-decay, [n, K]
    A_ts = beta_t Σ_k k̂_t[k] k̂_s[k] e^{G_t[k]-G_s[k]}   for s < t (strictly lower)
    T = (I + A)^-1                               (unit lower-triangular; applied by a triangular solve)
    W = T diag(beta) (k̂ ⊙ e^G),  U = T diag(beta) V   (the WY pair)
    Ũ = U - W S0ᵀ                                pseudo-values: u_t of the recurrence
    O = (q̂ ⊙ e^G) S0ᵀ + (M ∘ Q̂K̂ᵀ_gated) Ũ        with M the inclusive causal mask
    S_j = S0·diag(e^{G_j}) + Σ_{s≤j} ũ_s (k̂_s ⊙ e^{G_j-G_s})ᵀ      state after j tokens of the chunk
S_n is the next chunk's entry state; a checkpoint at chunk-relative offset j < n is S_j from the same
chunk quantities (the chunk walk is split at the offset; no second pass, chunk grid unchanged).
Gate differences are formed pairwise (G_t - G_s with s ≤ t, masked before exp), so nothing overflows.
"""

from __future__ import annotations

import torch

from ._kda_batch import prepare, run_sequences


def _state_after(S0: torch.Tensor, G: torch.Tensor, k: torch.Tensor, u: torch.Tensor, j: int) -> torch.Tensor:
    """State after the first j tokens of a chunk. S0 [H,V,K]; G, k [H,n,K]; u [H,n,V] -> [H,V,K]."""
    Gj = G[:, j - 1 : j, :]  # [H, 1, K]
    kd = k[:, :j] * torch.exp(Gj - G[:, :j])
    return S0 * torch.exp(Gj) + torch.einsum("hsv,hsk->hvk", u[:, :j], kd)


def _chunk(
    S0: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    offsets: list[int],
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One chunk. S0 [H,V,K]; q, k, g [n,H,K]; v [n,H,V]; beta [n,H]; offsets ⊂ [1, n).

    Returns (o [n,H,V], state after the chunk [H,V,K], states after each offset).
    """
    q, k, v, g = (t.transpose(0, 1) for t in (q, k, v, g))  # [H, n, *]
    beta = beta.t()  # [H, n]
    n = q.shape[1]
    G = g.cumsum(dim=1)
    incl = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    diff = (G[:, :, None, :] - G[:, None, :, :]).masked_fill(~incl[None, :, :, None], float("-inf"))
    decay = torch.exp(diff)  # [H, t, s, K], zero above the diagonal
    a_kk = torch.einsum("htk,hsk,htsk->hts", k, k, decay).tril(-1) * beta[:, :, None]
    a_qk = torch.einsum("htk,hsk,htsk->hts", q, k, decay)
    eye = torch.eye(n, dtype=q.dtype, device=q.device)
    eG = torch.exp(G)
    rhs = beta[:, :, None] * torch.cat([k * eG, v], dim=-1)
    wu = torch.linalg.solve_triangular(eye + a_kk, rhs, upper=False, unitriangular=True)
    w, u = wu[..., : k.shape[-1]], wu[..., k.shape[-1] :]
    u = u - torch.einsum("htk,hvk->htv", w, S0)
    o = torch.einsum("htk,hvk->htv", q * eG, S0) + a_qk @ u
    mids = [_state_after(S0, G, k, u, j) for j in offsets]
    return o.transpose(0, 1), _state_after(S0, G, k, u, n), mids


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
    """Chunked KDA; same contract and result as `kda_recurrent` (see it), plus `chunk_size` (>= 1).

    Chunks start at each sequence's first token and are `chunk_size` long (the last may be shorter);
    checkpoints do not move chunk boundaries. `host` (a _varlen.HostVarlen, host copies of the index arguments
    for kernels that would otherwise read them back from the device) is accepted and not needed here.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    kb = prepare(q, k, v, g, beta, state_pool, state_indices, cu_seqlens, has_initial_state, scale,
                 use_qk_l2norm, checkpoint_seq, checkpoint_offsets, checkpoint_slots)

    def walk(b, S, marks, o, ckpt_writes):
        start, end = kb.cu[b], kb.cu[b + 1]
        for c0 in range(start, end, chunk_size):
            c1 = min(c0 + chunk_size, end)
            inner = [(off - (c0 - start), slot) for off, slot in marks if c0 - start < off < c1 - start]
            sl = slice(c0, c1)
            o[sl], S_end, mids = _chunk(
                S, kb.q[sl], kb.k[sl], kb.v[sl], kb.g[sl], kb.beta[sl], [j for j, _ in inner]
            )
            ckpt_writes.extend((slot, m) for (_, slot), m in zip(inner, mids))
            ckpt_writes.extend((slot, S_end) for off, slot in marks if off == c1 - start)
            S = S_end
        return S

    return run_sequences(kb, state_pool, v, walk)
