"""Log-probabilities and ranks for the tokens a request reports (sampled and prompt logprobs).

Which logits feed these (documented contract of `Sampler`): the logits AFTER logit_bias,
min_tokens and the penalties but BEFORE temperature / min-p / top-k / top-p. That sits between
vLLM's "raw_logprobs" (before any adjustment) and "processed_logprobs" (after everything).
"""

from __future__ import annotations

import torch

from .state import LogprobEntry


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim; Tensor[N, V] -> Tensor[N, V], float64 stays float64, else float32."""
    dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return torch.log_softmax(logits.to(dt), dim=-1)


def token_ranks(logprobs: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Tensor[N] int64: 1 + the number of tokens in the row with a strictly higher logprob."""
    chosen = logprobs.gather(1, token_ids.view(-1, 1))
    return (logprobs > chosen).sum(dim=-1) + 1


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int | None]
) -> list[list[LogprobEntry] | None]:
    """Per row i: None if num_top[i] is None, else [chosen, top_1..top_n] as (id, logprob, rank).

    logprobs: Tensor[N, V] from `compute_logprobs`; token_ids: Tensor[N] int64 (the chosen ids);
    num_top: N entries, n >= 0 (n > V is clipped to V). Ranks follow `token_ranks` for every entry,
    so tied tokens share a rank. One topk over the asking rows with the largest n; one device->host
    copy.
    """
    asking = [i for i, n in enumerate(num_top) if n is not None]
    result: list[list[LogprobEntry] | None] = [None] * len(num_top)
    if not asking:
        return result
    rows = torch.tensor(asking, dtype=torch.long, device=logprobs.device)
    lp = logprobs[rows]
    ids = token_ids.to(logprobs.device)[rows]
    chosen_lp = lp.gather(1, ids.view(-1, 1)).squeeze(1)
    chosen_rank = token_ranks(lp, ids)
    max_n = min(max(int(num_top[i]) for i in asking), lp.shape[1])
    top_lp, top_ids = lp.topk(max_n, dim=-1)
    # Rank of the j-th top value = 1 + index of the first top value equal to it: every strictly
    # larger value precedes it in the descending top list.
    if max_n > 0:
        top_rank = (top_lp.unsqueeze(2) == top_lp.unsqueeze(1)).int().argmax(dim=2) + 1
    else:
        top_rank = top_ids  # [R, 0]
    # One device->host copy; ids and ranks are exact in float64.
    cols = [ids.unsqueeze(1), chosen_lp.unsqueeze(1), chosen_rank.unsqueeze(1), top_ids, top_lp, top_rank]
    packed = torch.cat([c.to(torch.float64) for c in cols], dim=1).tolist()
    for r, i in enumerate(asking):
        row = packed[r]
        entries: list[LogprobEntry] = [(int(row[0]), row[1], int(row[2]))]
        for j in range(min(int(num_top[i]), max_n)):
            entries.append((int(row[3 + j]), row[3 + max_n + j], int(row[3 + 2 * max_n + j])))
        result[i] = entries
    return result
