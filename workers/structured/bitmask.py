"""Packed token bitmasks (XGrammar's layout: int32 words, bit j of word w = token 32*w + j) on logits."""

from __future__ import annotations

import torch

_BYTE_BITS: dict[torch.device, torch.Tensor] = {}


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Tensor[R, W] int32 -> Tensor[R, vocab] bool (True = allowed), on the bitmask's device.

    Little-endian words, so byte k of the row holds tokens 8k .. 8k+7; each byte is looked up in a
    [256, 8] bool table (one gather, no 32x int32 intermediate).
    """
    table = _BYTE_BITS.get(bitmask.device)
    if table is None:
        table = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()
        table = _BYTE_BITS[bitmask.device] = table.to(bitmask.device)
    rows = bitmask.shape[0]
    byte_view = bitmask.contiguous().view(torch.uint8).view(rows, -1)
    return table[byte_view.long()].view(rows, -1)[:, :vocab]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows[j], t] = -inf where bit t of bitmask[j] is 0; in place, on the logits' device.

    The mask is copied to the device once (W = V/32 words per row) and unpacked there. (XGrammar's own
    CPU kernel was slower than this on the 16-core H200 host: batch 64, 59 vs 27 ms per sampler call.)
    """
    allowed = unpack(bitmask.to(logits.device, non_blocking=True), logits.shape[1])
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        idx = torch.tensor(rows, device=logits.device)
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
    return logits
