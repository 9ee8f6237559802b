"""KDA (Kimi Delta Attention) recurrence, token by token: the semantic reference."""

from __future__ import annotations

import torch

from ._kda_batch import prepare, run_sequences


def kda_recurrent(
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
) -> torch.Tensor:
    """Gated delta rule with per-channel decay over a flattened variable-length batch.

    Shapes: q, k [T, H, K]; v [T, H, V]; g [T, H, K] log-decay; beta [T, H] (already sigmoid-ed);
    cu_seqlens [B+1]; state_indices [B]; has_initial_state bool [B] (None = all False);
    state_pool [num_slots, H, V, K] stored [v][k] (fp32, fp64 or bf16), updated IN PLACE.

    use_qk_l2norm: q̂ = l2_normalize(q)·scale, k̂ = l2_normalize(k) (eps 1e-6); else q̂ = q·scale, k̂ = k.
    scale defaults to K^-0.5. Per token, per head:
        S' = S·diag(exp(g_t));  u = beta_t (v_t - S' k̂_t);  S = S' + u k̂_tᵀ;  o_t = S q̂_t.
    Sequence b starts from state_pool[state_indices[b]] if has_initial_state[b] else zeros, and its final
    state is written back to that slot. A negative state index marks a padded sequence: zero output, no
    slot read or written.

    Checkpoints (LongTensor [N] each, or all None): state_pool[checkpoint_slots[n]] receives the state
    after checkpoint_offsets[n] (in (0, len]) tokens of sequence checkpoint_seq[n]; several per sequence
    are allowed. All initial states are read before anything is written; final states are written first,
    then checkpoints.

    Returns o [T, H, V] in v's dtype; math in fp32 (fp64 if any input or the pool is fp64).
    """
    kb = prepare(q, k, v, g, beta, state_pool, state_indices, cu_seqlens, has_initial_state, scale,
                 use_qk_l2norm, checkpoint_seq, checkpoint_offsets, checkpoint_slots)

    def walk(b, S, marks, o, ckpt_writes):
        start = kb.cu[b]
        for i in range(kb.cu[b + 1] - start):
            t = start + i
            S = S * torch.exp(kb.g[t])[:, None, :]
            u = kb.beta[t][:, None] * (kb.v[t] - torch.einsum("hvk,hk->hv", S, kb.k[t]))
            S = S + u[:, :, None] * kb.k[t][:, None, :]
            o[t] = torch.einsum("hvk,hk->hv", S, kb.q[t])
            ckpt_writes.extend((slot, S) for off, slot in marks if off == i + 1)
        return S

    return run_sequences(kb, state_pool, v, walk)
