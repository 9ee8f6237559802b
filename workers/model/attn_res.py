"""Block Attention Residuals (design doc §1.2), a literal reference.

`attn_res_mix(sources, w_norm, w_q, w_out, eps)` is the mixing primitive; `AttnResState` carries the
per-sequence state (`blocks`, `partial`) through the stack and implements the per-layer schedule.
"""

from __future__ import annotations

import torch

from .functional import acc_dtype


def attn_res_mix(
    sources: list[torch.Tensor],
    w_norm: torch.Tensor,
    w_q: torch.Tensor,
    w_out: torch.Tensor | None,
    eps: float,
    eps_out: float | None = None,
) -> torch.Tensor:
    """Softmax mixture over depth-wise sources, each `[T, H]` (model dtype).

    l_i = sum_d w_q[d] * w_norm[d] * s_i[d] / sqrt(mean_d(s_i^2) + eps)   (acc dtype)
    alpha = softmax_i(l);  m = sum_i alpha_i * s_i  (raw sources);  out = RMSNorm(m; w_out) or m.
    `w_q` is the `[1, H]` (or `[H]`) weight of the `*_res_proj` Linear(H -> 1). Returns `[T, H]` (model dtype).
    """
    dtype = sources[0].dtype
    acc = acc_dtype(dtype)
    s = torch.stack([x.to(acc) for x in sources], dim=0)  # [n+1, T, H]
    wq = w_q.reshape(-1).to(acc) * w_norm.to(acc)
    logits = (s * wq).sum(-1) / torch.sqrt(s.pow(2).mean(-1) + eps)  # [n+1, T]
    alpha = torch.softmax(logits, dim=0)
    m = (alpha[..., None] * s).sum(0)  # acc dtype
    if w_out is None:
        return m.to(dtype)
    e = eps if eps_out is None else eps_out
    return (m * torch.rsqrt(m.pow(2).mean(-1, keepdim=True) + e)).to(dtype) * w_out.to(dtype)


class AttnResState:
    """Per-sequence AttnRes state: `blocks` (slot 0 = embedding, slot n = sum of block n's sublayer outputs)
    and `partial` (running sum inside the current block), both `[T, H]` in the model dtype.

    Per layer l (block size B): `pre_attn(l, delta=m_{l-1})` -> attention input;
    `post_attn(l, a_l)` -> MLP input; after the last layer `final(m_{L-1})` -> pre-norm hidden state.
    """

    def __init__(self, embedding: torch.Tensor, block_size: int, num_blocks: int):
        self.B = block_size
        self.NB = num_blocks
        self.blocks: list[torch.Tensor | None] = [None] * num_blocks
        self.partial = embedding

    def _add(self, delta: torch.Tensor | None) -> None:
        if delta is not None:
            # round_to_model_dtype(partial + delta): the sum is computed and stored in the model dtype.
            self.partial = (self.partial + delta).to(self.partial.dtype)

    def _sources(self, n: int) -> list[torch.Tensor]:
        got = self.blocks[:n]
        if any(b is None for b in got):
            raise RuntimeError(f"AttnRes: block slots {list(range(n))} are not all written yet")
        return [*got, self.partial]

    def pre_attn(self, layer: int, delta: torch.Tensor | None, w_norm, w_q, w_out, eps: float) -> torch.Tensor:
        write = layer % self.B == 0
        prev = -(-layer // self.B)
        self._add(delta)
        if write:
            self.blocks[layer // self.B] = self.partial
        return attn_res_mix(self._sources(prev), w_norm, w_q, w_out, eps)

    def post_attn(self, layer: int, attn_out: torch.Tensor, w_norm, w_q, w_out, eps: float) -> torch.Tensor:
        write = layer % self.B == 0
        prev = -(-layer // self.B)
        if write:
            self.partial = attn_out  # reset: a new block starts
        else:
            self._add(attn_out)
        return attn_res_mix(self._sources(prev + int(write)), w_norm, w_q, w_out, eps)

    def final(self, delta: torch.Tensor, w_norm, w_q, eps: float) -> torch.Tensor:
        self._add(delta)
        return attn_res_mix(self._sources(self.NB), w_norm, w_q, None, eps)
