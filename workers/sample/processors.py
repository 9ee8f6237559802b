"""Logit adjustments that can change the argmax: logit_bias, min_tokens, and the three penalties.

All functions take `logits: Tensor[N, V]` (float32 or float64) and the N per-row `SamplingState`s,
modify `logits` IN PLACE and return it. Token ids outside [0, V) are ignored (validation belongs to
the request layer). Rows with nothing to do cost nothing beyond a Python check.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .state import SamplingState


def apply_logit_bias(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """logits[i, t] += params.logit_bias[t] for each row i that has a bias."""
    vocab = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, st in enumerate(states):
        bias = st.params.logit_bias
        if not bias:
            continue
        for tok, val in bias.items():
            if 0 <= tok < vocab:
                rows.append(i)
                cols.append(tok)
                vals.append(float(val))
    if rows:
        idx = (_long(rows, logits.device), _long(cols, logits.device))
        logits.index_put_(idx, torch.tensor(vals, dtype=logits.dtype, device=logits.device), accumulate=True)
    return logits


def apply_min_tokens(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """While len(output) < min_tokens, stop_token_ids and EOS get -inf (EOS even under ignore_eos)."""
    vocab = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, st in enumerate(states):
        if len(st.output_token_ids) >= st.params.min_tokens:
            continue
        banned = set(st.params.stop_token_ids)
        if st.eos_token_id is not None:
            banned.add(st.eos_token_id)
        for tok in banned:
            if 0 <= tok < vocab:
                rows.append(i)
                cols.append(tok)
    if rows:
        logits[_long(rows, logits.device), _long(cols, logits.device)] = float("-inf")
    return logits


def apply_penalties(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """vLLM/OpenAI penalties, vectorised over the rows that use any of them.

    * repetition r (tokens seen in prompt OR output): logit > 0 -> logit / r, logit <= 0 -> logit * r;
    * frequency f: logit -= f * count(token in output);
    * presence p: logit -= p * (token in output).
    """
    sel = [
        i
        for i, st in enumerate(states)
        if st.params.repetition_penalty != 1.0
        or st.params.frequency_penalty != 0.0
        or st.params.presence_penalty != 0.0
    ]
    if not sel:
        return logits
    vocab = logits.shape[1]
    dev, dt = logits.device, logits.dtype
    sub_states = [states[i] for i in sel]
    out_counts = token_counts([st.output_ids() for st in sub_states], vocab, dev)
    everyone = len(sel) == logits.shape[0]
    rows = None if everyone else _long(sel, dev)
    sub = logits if rows is None else logits[rows]

    rep = torch.tensor([st.params.repetition_penalty for st in sub_states], dtype=dt, device=dev)
    if any(st.params.repetition_penalty != 1.0 for st in sub_states):
        seen = (token_counts([st.prompt_ids() for st in sub_states], vocab, dev) > 0) | (out_counts > 0)
        rep_full = torch.where(seen, rep.unsqueeze(1), torch.ones((), dtype=dt, device=dev))
        sub = torch.where(sub > 0, sub / rep_full, sub * rep_full)

    freq = torch.tensor([st.params.frequency_penalty for st in sub_states], dtype=dt, device=dev)
    pres = torch.tensor([st.params.presence_penalty for st in sub_states], dtype=dt, device=dev)
    sub = sub - freq.unsqueeze(1) * out_counts.to(dt) - pres.unsqueeze(1) * (out_counts > 0).to(dt)
    if rows is None:
        logits.copy_(sub)
    else:
        logits[rows] = sub
    return logits


def token_counts(
    token_ids: Sequence[torch.Tensor | Sequence[int]], vocab: int, device: torch.device
) -> torch.Tensor:
    """Tensor[M, vocab] int64: how often each id occurs in each of the M id sequences.

    Each entry is a 1-D int tensor (CPU, e.g. from `SamplingState.output_ids()`) or a list of ids.
    Ids outside [0, vocab) are dropped. All rows are concatenated on the host, copied to `device`
    once and counted with one scatter_add into a [M, vocab + 1] buffer (the last column absorbs
    invalid ids).
    """
    m = len(token_ids)
    counts = torch.zeros((m, vocab + 1), dtype=torch.long, device=device)
    parts = [t if isinstance(t, torch.Tensor) else torch.tensor(list(t), dtype=torch.long) for t in token_ids]
    lengths = [p.numel() for p in parts]
    total = sum(lengths)
    if total == 0:
        return counts[:, :vocab]
    flat = torch.cat(parts).to(device=device, dtype=torch.long)
    flat = torch.where((flat < 0) | (flat > vocab), torch.full_like(flat, vocab), flat)
    rows = torch.repeat_interleave(
        torch.arange(m, device=device), torch.tensor(lengths, device=device), output_size=total
    )
    counts.view(-1).scatter_add_(0, rows * (vocab + 1) + flat, torch.ones_like(flat))
    return counts[:, :vocab]


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
