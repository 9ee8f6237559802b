"""Random draws for the exponential-race sampler: token = argmax(probs / q), q ~ Exp(1) i.i.d.

This picks token t with probability probs[t] (the "Gumbel-max" trick in ratio form).

Reproducibility contract: a seeded row consumes exactly ONE draw per step from its own CPU
generator (`step_seed`); that 63-bit value seeds a scratch generator on the logits' device which
then draws the row's V exponentials. So a seeded row's noise depends only on its seed and its step
count, never on the other rows of the batch, and costs one device launch per row (no V-sized host
draw and copy). Unseeded rows draw together, in row order, from the sampler's global generator.
The same seed gives the same noise on the same device type and torch version, not across devices.
"""

from __future__ import annotations

import torch


def step_seed(generator: torch.Generator) -> int:
    """One draw in [0, 2**63) from `generator` (a CPU generator): the seed of this step's noise."""
    return int(torch.empty(1, dtype=torch.int64).random_(generator=generator).item())


def exponential_noise(
    generators: list[torch.Generator | None],
    vocab: int,
    dtype: torch.dtype,
    device: torch.device,
    global_generator: torch.Generator,
    scratch_generator: torch.Generator,
) -> torch.Tensor:
    """Tensor[M, vocab] of Exp(1) draws on `device`; row j seeded from generators[j] when not None.

    `global_generator` (rows without a generator) and `scratch_generator` (re-seeded per seeded row)
    must live on `device`. Values are clamped to >= the dtype's smallest normal so 1/q is finite.
    """
    m = len(generators)
    q = torch.empty((m, vocab), dtype=dtype, device=device)
    unseeded = [j for j, g in enumerate(generators) if g is None]
    if len(unseeded) == m:
        q.exponential_(generator=global_generator)
    else:
        for j, gen in enumerate(generators):
            if gen is not None:
                scratch_generator.manual_seed(step_seed(gen))
                q[j].exponential_(generator=scratch_generator)
        if unseeded:
            draw = torch.empty((len(unseeded), vocab), dtype=dtype, device=device)
            draw.exponential_(generator=global_generator)
            q[torch.tensor(unseeded, device=device)] = draw
    return q.clamp_min_(torch.finfo(dtype).tiny)


def race_sample(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Tensor[M] int64: argmax over the vocab of probs / noise (probs and noise: Tensor[M, V])."""
    return (probs / noise).argmax(dim=-1)
