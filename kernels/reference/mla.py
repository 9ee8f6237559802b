"""Multi-head latent attention: paged latent cache write, absorbed paged attention, expanded attention."""

from __future__ import annotations

import math

import torch

from ._varlen import compute_dtype, int_list, seq_starts


def mla_write_cache(
    c_kv: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store [c_kv | k_pe] per token into the paged cache, in place.

    c_kv [T, L] (already normalised latent); k_pe [T, R]; kv_cache [num_blocks, block_size, L+R];
    slot_mapping [T] = block_id * block_size + offset; tokens with a slot < 0 are skipped.
    Values are cast to the cache dtype.
    """
    L, R = c_kv.shape[-1], k_pe.shape[-1]
    if kv_cache.shape[-1] != L + R:
        raise ValueError(f"kv_cache last dim {kv_cache.shape[-1]} != {L} + {R}")
    bs = kv_cache.shape[1]
    slots = slot_mapping.to(device=kv_cache.device, dtype=torch.long)
    keep = slots >= 0
    entry = torch.cat([c_kv, k_pe.to(c_kv.dtype)], dim=-1)[keep.to(c_kv.device)]
    s = slots[keep]
    # index (block, offset): the cache may be a strided view (pages padded past the block's tokens)
    kv_cache[s // bs, s % bs] = entry.to(device=kv_cache.device, dtype=kv_cache.dtype)


def _causal_mask(num_q: int, num_k: int, device: torch.device) -> torch.Tensor:
    """[num_q, num_k] bool: query i (at key position num_k - num_q + i) may see keys <= that position."""
    qpos = torch.arange(num_k - num_q, num_k, device=device)[:, None]
    return torch.arange(num_k, device=device)[None, :] <= qpos


def mla_paged_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    *,
    kv_lora_rank: int,
) -> torch.Tensor:
    """Absorbed MLA over the paged latent cache (the cache must already hold this step's tokens).

    q_lat [T, Hh, L] (= q_nope · W_UK per head); q_pe [T, Hh, R]; kv_cache [num_blocks, block_size, L+R];
    block_tables [B, max_blocks] int; seq_lens [B] = context length INCLUDING this step's tokens;
    cu_seqlens_q [B+1]. Query token i of sequence b sits at position seq_lens[b] - qlen_b + i and attends
    causally to positions <= it. score = (q_lat·c_kv + q_pe·k_pe)·scale, softmax in fp32 (fp64 for fp64
    inputs). Returns o_lat [T, Hh, L] = softmax-weighted c_kv, in q_lat's dtype.
    """
    L = kv_lora_rank
    cu = seq_starts(cu_seqlens_q)
    B = len(cu) - 1
    lens = int_list(seq_lens, B, "seq_lens")
    bs = kv_cache.shape[1]
    dt = compute_dtype(q_lat, kv_cache)
    out = torch.zeros(q_lat.shape, dtype=dt, device=q_lat.device)
    for b in range(B):
        nq, nk = cu[b + 1] - cu[b], lens[b]
        if nq == 0:
            continue
        if nq > nk:
            raise ValueError(f"sequence {b}: {nq} query tokens but context length {nk}")
        blocks = block_tables[b, : math.ceil(nk / bs)].to(device=kv_cache.device, dtype=torch.long)
        kv = kv_cache.index_select(0, blocks).reshape(-1, kv_cache.shape[-1])[:nk].to(dt)
        c, kpe = kv[:, :L], kv[:, L:]
        ql, qp = q_lat[cu[b] : cu[b + 1]].to(dt), q_pe[cu[b] : cu[b + 1]].to(dt)
        s = (torch.einsum("thl,sl->hts", ql, c) + torch.einsum("thr,sr->hts", qp, kpe)) * scale
        s = s.masked_fill(~_causal_mask(nq, nk, s.device), float("-inf"))
        out[cu[b] : cu[b + 1]] = torch.einsum("hts,sl->thl", torch.softmax(s, dim=-1), c)
    return out.to(q_lat.dtype)


def mla_attention_expanded(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool = True,
) -> torch.Tensor:
    """Plain (non-absorbed) MLA attention of one sequence without a cache.

    q_nope [T, Hh, Dn]; q_pe [T, Hh, R]; k_nope [S, Hh, Dn]; k_pe [S, R] (shared by all heads);
    v [S, Hh, Dv]; the queries are the last T of the S positions (causal mask if `causal`).
    score = (q_nope·k_nope + q_pe·k_pe)·scale. Returns [T, Hh, Dv] in q_nope's dtype (fp32/fp64 math).
    """
    dt = compute_dtype(q_nope, k_nope, v)
    s = torch.einsum("thd,shd->hts", q_nope.to(dt), k_nope.to(dt))
    s = (s + torch.einsum("thr,sr->hts", q_pe.to(dt), k_pe.to(dt))) * scale
    if causal:
        s = s.masked_fill(~_causal_mask(q_nope.shape[0], k_nope.shape[0], s.device), float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(s, dim=-1), v.to(dt)).to(q_nope.dtype)
