"""Packed token bitmasks (XGrammar's layout: int32 words, bit j of word w = token 32*w + j) on logits."""

from __future__ import annotations

import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Tensor[R, W] int32 -> Tensor[R, vocab] bool (True = allowed), on the bitmask's device."""
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows[j], t] = -inf where bit t of bitmask[j] is 0; in place, on the logits' device.

    The mask is copied to the device once (W = V/32 words per row) and unpacked there.
    """
    allowed = unpack(bitmask.to(logits.device, non_blocking=True), logits.shape[1])
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        idx = torch.tensor(rows, device=logits.device)
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
    return logits
