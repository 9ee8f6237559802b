"""Random draws for the exponential-race sampler: token = argmax(probs / q), q ~ Exp(1) i.i.d.

This picks token t with probability probs[t] (the "Gumbel-max" trick in ratio form). Each random
row consumes exactly V exponential draws per step from ITS OWN generator (seeded rows) or from the
sampler's global generator (unseeded rows), so a seeded row's stream never depends on the batch.
"""

from __future__ import annotations

import torch


def exponential_noise(
    generators: list[torch.Generator | None],
    vocab: int,
    dtype: torch.dtype,
    device: torch.device,
    global_generator: torch.Generator,
) -> torch.Tensor:
    """Tensor[M, vocab] of Exp(1) draws on `device`, row j drawn from generators[j] (CPU generators).

    Rows whose generator is None are drawn together, in row order, from `global_generator` (which may
    live on `device`). Values are clamped to >= the dtype's smallest normal so that 1/q is finite.
    """
    m = len(generators)
    q = torch.empty((m, vocab), dtype=dtype, device=device)
    seeded = [j for j, g in enumerate(generators) if g is not None]
    unseeded = [j for j, g in enumerate(generators) if g is None]
    if seeded:
        host = torch.empty((len(seeded), vocab), dtype=dtype)
        for r, j in enumerate(seeded):
            host[r].exponential_(generator=generators[j])
        q[torch.tensor(seeded, device=device)] = host.to(device)
    if unseeded:
        gen_dev = global_generator.device
        draw = torch.empty((len(unseeded), vocab), dtype=dtype, device=gen_dev)
        draw.exponential_(generator=global_generator)
        q[torch.tensor(unseeded, device=device)] = draw.to(device)
    return q.clamp_min_(torch.finfo(dtype).tiny)


def race_sample(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Tensor[M] int64: argmax over the vocab of probs / noise (probs and noise: Tensor[M, V])."""
    return (probs / noise).argmax(dim=-1)
