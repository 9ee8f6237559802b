"""The per-step Sampler: logits of the rows that sample -> one token id (+ logprobs) per row.

Pipeline (vLLM v1 order), all on a float32 copy (float64 logits stay float64):
  1. logit_bias added; 2. min_tokens masks stop_token_ids and EOS with -inf;
  3. penalties: repetition (prompt + output), frequency and presence (output);
  3b. structured outputs: each constrained row's grammar bitmask (constraints.py), so the rows
      below only see allowed tokens; after sampling, each constrained row's matcher accepts its token;
  4. logprobs, for rows that ask, from THESE logits (after 1-3, before 5-7);
  5. greedy rows (temperature < 1e-5): argmax, ties -> lowest id;
  6. random rows: temperature, min-p, top-k, top-p;
  7. exponential race with the row's own generator (or the global one when unseeded).
The caller's logits tensor is never modified.
"""

from __future__ import annotations

import torch

from .constraints import advance_grammars, apply_grammar_masks, constrained_rows
from .draw import exponential_noise, race_sample
from .filters import apply_min_p, apply_temperature, apply_top_k_top_p
from .logprobs import compute_logprobs, gather_logprobs
from .processors import apply_logit_bias, apply_min_tokens, apply_penalties
from .state import SamplerOutput, SamplingState


def plain_greedy(st: SamplingState) -> bool:
    """True when the pipeline above returns exactly the row's argmax and nothing else: greedy (5), no logprobs (4),
    nothing of 1-3b in force (no logit bias, min_tokens reached, no penalties, no active grammar). For such rows
    the engine may take an argmax computed elsewhere (ModelRunner.take_greedy_ids) instead of calling the sampler."""
    p = st.params
    return (
        p.greedy
        and p.logprobs is None
        and not p.logit_bias
        and len(st.output_token_ids) >= p.min_tokens
        and p.repetition_penalty == 1.0
        and p.frequency_penalty == 0.0
        and p.presence_penalty == 0.0
        and (st.structured is None or not st.structured.active)
    )


class Sampler:
    """Stateless apart from the global generator used by rows without a seed.

    `seed`: seeds the global generator (None: a nondeterministic seed); there is one per device the
    logits live on. Seeded rows take one draw per step from their own CPU generator
    (`SamplingState.generator`) to seed their noise; see `draw.py` for the reproducibility contract.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = int(seed) if seed is not None else torch.Generator().seed()  # no global side effect
        self._generators: dict[tuple[torch.device, str], torch.Generator] = {}

    def global_generator(self, device: torch.device) -> torch.Generator:
        """The generator for unseeded rows whose logits live on `device` (created on first use)."""
        return self._device_generator(torch.device(device), "global")

    def _device_generator(self, device: torch.device, role: str) -> torch.Generator:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        gen = self._generators.get((device, role))
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self._seed & 0xFFFF_FFFF_FFFF_FFFF)
            self._generators[(device, role)] = gen
        return gen

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
        """Sample one token per row. logits: Tensor[N, V] (any float dtype), states: N entries."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(
                f"logits must be [N, V] with N == len(states) ({len(states)}); got {tuple(logits.shape)}"
            )
        n = len(states)
        if n == 0:
            return SamplerOutput(token_ids=[], logprobs=None)
        dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
        x = logits.to(dtype=dt, copy=True)
        apply_logit_bias(x, states)
        apply_min_tokens(x, states)
        apply_penalties(x, states)
        grammar_rows = constrained_rows(states)
        if grammar_rows:
            apply_grammar_masks(x, logits, states, grammar_rows)

        num_top = [st.params.logprobs for st in states]
        logprobs = compute_logprobs(x) if any(k is not None for k in num_top) else None

        greedy = [st.params.greedy for st in states]
        if all(greedy):
            token_ids = x.argmax(dim=-1)
        else:
            token_ids = torch.empty(n, dtype=torch.long, device=x.device)
            g_rows = [i for i in range(n) if greedy[i]]
            r_rows = [i for i in range(n) if not greedy[i]]
            if g_rows:
                g_idx = torch.tensor(g_rows, device=x.device)
                token_ids[g_idx] = x[g_idx].argmax(dim=-1)
            r_idx = torch.tensor(r_rows, device=x.device)
            token_ids[r_idx] = self._sample_random(x[r_idx], [states[i] for i in r_rows])

        out_lp = gather_logprobs(logprobs, token_ids, num_top) if logprobs is not None else None
        ids = token_ids.tolist()
        if grammar_rows:
            advance_grammars(states, grammar_rows, ids)
        return SamplerOutput(token_ids=ids, logprobs=out_lp)

    def _sample_random(self, x: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Tensor[M] int64 for M non-greedy rows x: Tensor[M, V]."""
        dev, dt = x.device, x.dtype
        # Parameter tensors stay on the CPU: the filters branch on them without a device sync.
        x = apply_temperature(x, torch.tensor([st.params.temperature for st in states], dtype=dt))
        min_p = [st.params.min_p for st in states]
        if any(p > 0.0 for p in min_p):
            x = apply_min_p(x, torch.tensor(min_p, dtype=dt))
        # k >= V keeps every token; clamp before the int64 tensor (a huge k must not overflow it)
        top_k = [min(st.params.top_k, x.shape[1]) for st in states]
        top_p = [st.params.top_p for st in states]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            x = apply_top_k_top_p(x, torch.tensor(top_k, dtype=torch.long), torch.tensor(top_p, dtype=dt))
        probs = torch.softmax(x, dim=-1)
        noise = exponential_noise(
            [st.generator for st in states],
            x.shape[1],
            dt,
            dev,
            self.global_generator(dev),
            self._device_generator(dev, "scratch"),
        )
        return race_sample(probs, noise)
