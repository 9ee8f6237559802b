"""Rejection sampling for speculative decoding: the 1 + k verified positions -> the tokens to emit.

Per request i the target model scored 1 + k_i positions in one forward pass: position j's logits
predict the token after the prompt + output + drafts[:j]. This module turns those logits, the
k_i draft tokens and (optionally) the drafter's probabilities into `num_accepted[i]` accepted
drafts plus ONE more token (the correction at the first rejected position, or the bonus token
from position k_i when every draft was accepted).

Rules (each position's target distribution p is exactly what `workers/sample/sampler.py` would
sample from at that point of the sequence: logit_bias, min_tokens and the penalties see the
drafts before it as output, the grammar mask has accepted them, then temperature, min-p, top-k,
top-p):
  * greedy rows (temperature < 1e-5): draft j is accepted iff it equals the argmax of position j
    (ties -> lowest id, as the sampler); the extra token is that argmax. So greedy output with
    speculation is token-for-token the output without it.
  * random rows: the standard speculative-sampling rule. Draft d_j, drawn by the proposer from q_j,
    is accepted with probability min(1, p_j(d_j) / q_j(d_j)); on the first rejection the extra token
    is drawn from norm(max(0, p_j - q_j)); when all k_i are accepted it is drawn from p_{k_i}. The
    emitted tokens are then distributed exactly as tokens sampled one by one from p. A proposer
    without probabilities (n-gram lookup, greedy MTP) has q_j = one-hot(d_j): accept with
    probability p_j(d_j), residual = p_j without d_j.

Randomness (same contract as workers/sample/draw.py): a seeded row takes ONE draw per verify step
from its own generator; that value seeds the sampler's scratch generator on the logits' device,
which then draws the row's V exponentials (for the extra token, by the exponential race) and then
its k_i uniforms. So a seeded row's tokens depend only on its seed and step count, never on the
batch, and a row with k_i = 0 gets exactly the token `Sampler` would give it. Unseeded rows draw
their exponentials, then their uniforms, from the sampler's global generator, in row order.
Greedy rows draw nothing. A seeded request's tokens with speculation are reproducible but are not
the same tokens as without speculation (the rule consumes randomness differently); greedy ones are.

The emitted tokens may run past a stop token or max_tokens: the caller truncates (and then rolls
the KV state back to what it keeps). Grammar states are advanced by the emitted tokens, stopping
when the grammar terminates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3serve.workers.sample.draw import step_seed
from k3serve.workers.sample.filters import apply_min_p, apply_temperature, apply_top_k_top_p
from k3serve.workers.sample.logprobs import compute_logprobs, gather_logprobs
from k3serve.workers.sample.processors import apply_logit_bias, apply_min_tokens, apply_penalties
from k3serve.workers.sample.sampler import Sampler, plain_greedy
from k3serve.workers.sample.state import LogprobEntry, SamplingState


@dataclass
class SpecSamplerOutput:
    """Per request i (input order): `token_ids[i]` = the accepted drafts followed by the one
    correction/bonus token (1 + num_accepted[i] ids); `logprobs` is None when no request asked,
    else per request None or one `[chosen, top_1..top_n]` entry list per emitted token (the same
    entries `Sampler` reports, from the logits after logit_bias/min_tokens/penalties/grammar)."""

    token_ids: list[list[int]]
    num_accepted: list[int]
    logprobs: list[list[list[LogprobEntry]] | None] | None = None


# ---------------------------------------------------------------------------------------------
# The pure rule over padded tensors
# ---------------------------------------------------------------------------------------------


def greedy_verify(
    target_argmax: torch.Tensor, draft_token_ids: torch.Tensor, num_draft: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance. target_argmax: Tensor[N, K+1] int64 (argmax of each position, padding
    anywhere past 1 + num_draft[i]); draft_token_ids: Tensor[N, K] int64; num_draft: Tensor[N].

    Returns (num_accepted Tensor[N], final_token Tensor[N]): the longest prefix of drafts equal to
    the argmaxes, and the argmax at the first position after it.
    """
    n, k = draft_token_ids.shape
    valid = torch.arange(k, device=draft_token_ids.device).unsqueeze(0) < num_draft.unsqueeze(1)
    match = (draft_token_ids == target_argmax[:, :k]) & valid
    num_accepted = match.to(torch.long).cumprod(dim=1).sum(dim=1)
    final = target_argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return num_accepted, final


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The speculative-sampling rule, batched. Shapes (N requests, K = max drafts, V vocab):

    target_probs: Tensor[N, K+1, V], p of each position (rows past 1 + num_draft[i] are ignored);
    draft_token_ids: Tensor[N, K] int64; num_draft: Tensor[N] int64 in [0, K];
    draft_probs: Tensor[N, K, V] (q; each draft was drawn from its row) or None (q = one-hot);
    uniforms: Tensor[N, K] in [0, 1); noise: Tensor[N, V] of Exp(1) draws (> 0).

    Draft j is accepted iff u_j * q_j(d_j) < p_j(d_j) (i.e. u_j < p/q, without dividing; q = 0 and
    p > 0 accepts, p = 0 rejects). The extra token is argmax(r / noise) (the exponential race, i.e.
    a draw from r normalised) with r = max(0, p_a - q_a) at the first rejected position a, or
    r = p_K' when all drafts were accepted; a residual with no mass falls back to p_a.
    Returns (num_accepted Tensor[N] int64, final_token Tensor[N] int64).
    """
    n, k = draft_token_ids.shape
    dev = target_probs.device
    if k > 0:
        p_d = target_probs[:, :k].gather(2, draft_token_ids.unsqueeze(2)).squeeze(2)
        if draft_probs is None:
            accept = uniforms < p_d
        else:
            q_d = draft_probs.gather(2, draft_token_ids.unsqueeze(2)).squeeze(2)
            accept = uniforms * q_d < p_d
        valid = torch.arange(k, device=dev).unsqueeze(0) < num_draft.unsqueeze(1)
        num_accepted = (accept & valid).to(torch.long).cumprod(dim=1).sum(dim=1)
    else:
        num_accepted = torch.zeros(n, dtype=torch.long, device=dev)
    rows = torch.arange(n, device=dev)
    p_final = target_probs[rows, num_accepted]  # [N, V]
    rejected = num_accepted < num_draft
    if k > 0:  # (computed for every row, used where rejected: no host read of `rejected`)
        pos = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            residual = p_final.clone()
            d = draft_token_ids[rows, pos]
            residual[rows, d] = 0.0
        else:
            residual = (p_final - draft_probs[rows, pos]).clamp_min(0.0)
        empty = residual.sum(dim=1) <= 0
        residual = torch.where(empty.unsqueeze(1), p_final, residual)
        dist = torch.where(rejected.unsqueeze(1), residual, p_final)
    else:
        dist = p_final
    final = (dist / noise).argmax(dim=1)
    return num_accepted, final


# ---------------------------------------------------------------------------------------------
# The engine-facing sampler
# ---------------------------------------------------------------------------------------------


class RejectionSampler:
    """Speculative counterpart of `Sampler`, sharing its generators (pass the engine's Sampler).

    Call with `logits: Tensor[R, V]`, the rows of every request's 1 + k_i positions back to back in
    request order (R = sum(1 + k_i)), the requests' `SamplingState`s, `draft_token_ids[i]` (k_i ids,
    may be empty) and optionally `draft_probs[i]` (Tensor[k_i, V] or None for a one-hot proposer).
    The caller's logits are never modified; `states` are not modified except grammar states, which
    are advanced by the emitted tokens (the caller appends the tokens it keeps to output_token_ids).
    """

    def __init__(self, sampler: Sampler | None = None) -> None:
        self.sampler = sampler if sampler is not None else Sampler()

    def __call__(
        self,
        logits: torch.Tensor,
        states: list[SamplingState],
        draft_token_ids: list[list[int]],
        draft_probs: list[torch.Tensor | None] | None = None,
    ) -> SpecSamplerOutput:
        n = len(states)
        counts = [len(d) for d in draft_token_ids]
        _check_inputs(logits, states, draft_token_ids, draft_probs, counts)
        if n == 0:
            return SpecSamplerOutput(token_ids=[], num_accepted=[], logprobs=None)
        if all(plain_greedy(st) for st in states):
            return _greedy_fast(logits, draft_token_ids, counts)
        dev = logits.device
        dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + 1 + c)

        x = logits.to(dtype=dt, copy=True)
        pos_states = _position_states(states, draft_token_ids)
        apply_logit_bias(x, pos_states)
        apply_min_tokens(x, pos_states)
        apply_penalties(x, pos_states)
        _apply_grammar(x, logits, states, draft_token_ids, starts)

        num_top = [st.params.logprobs for st in states]
        logprobs = compute_logprobs(x) if any(t is not None for t in num_top) else None

        num_accepted = [0] * n
        final = [0] * n
        k_max = max(counts)
        greedy = [i for i, st in enumerate(states) if st.params.greedy]
        random_rows = [i for i, st in enumerate(states) if not st.params.greedy]
        if greedy:
            idx = _padded_index(greedy, starts, counts, k_max, dev)  # [G, K+1]
            argmax_flat = x.argmax(dim=-1)
            acc, fin = greedy_verify(argmax_flat[idx], _drafts(greedy, draft_token_ids, k_max, dev),
                                     _long([counts[i] for i in greedy], dev))
            for i, (a, f) in zip(greedy, torch.stack([acc, fin], 1).tolist()):  # one device->host copy
                num_accepted[i], final[i] = a, f
        if random_rows:
            acc, fin = self._sample_random(x, states, random_rows, draft_token_ids, draft_probs,
                                           starts, counts, k_max)
            for i, (a, f) in zip(random_rows, torch.stack([acc, fin], 1).tolist()):
                num_accepted[i], final[i] = a, f

        token_ids = [list(draft_token_ids[i][: num_accepted[i]]) + [final[i]] for i in range(n)]
        out_lp = None
        if logprobs is not None:
            out_lp = _emitted_logprobs(logprobs, token_ids, starts, num_top)
        for i, st in enumerate(states):
            if st.structured is not None:
                for tok in token_ids[i]:
                    if not st.structured.active:
                        break
                    st.structured.accept(tok)
        return SpecSamplerOutput(token_ids=token_ids, num_accepted=num_accepted, logprobs=out_lp)

    def _sample_random(self, x, states, rows, draft_token_ids, draft_probs, starts, counts, k_max):
        dev, dt = x.device, x.dtype
        sub_states = [states[i] for i in rows]
        flat_rows = [r for i in rows for r in range(starts[i], starts[i + 1])]
        reps = [1 + counts[i] for i in rows]
        flat_idx = _long(flat_rows, dev)
        xs = x[flat_idx]

        def per_row(values, dtype):
            return torch.repeat_interleave(torch.tensor(values, dtype=dtype), torch.tensor(reps))

        xs = apply_temperature(xs, per_row([st.params.temperature for st in sub_states], dt))
        min_p = [st.params.min_p for st in sub_states]
        if any(p > 0.0 for p in min_p):
            xs = apply_min_p(xs, per_row(min_p, dt))
        top_k = [min(st.params.top_k, x.shape[1]) for st in sub_states]
        top_p = [st.params.top_p for st in sub_states]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            xs = apply_top_k_top_p(xs, per_row(top_k, torch.long), per_row(top_p, dt))
        probs_flat = torch.softmax(xs, dim=-1)
        # padded [M, K+1, V]: position j of row m is flat row offset_m + min(j, k_m)
        local_starts = [0]
        for r in reps:
            local_starts.append(local_starts[-1] + r)
        pad = _padded_index(list(range(len(rows))), local_starts, [counts[i] for i in rows], k_max, dev)
        target = probs_flat[pad]
        q = None
        if draft_probs is not None and any(draft_probs[i] is not None for i in rows):
            q = torch.zeros((len(rows), k_max, x.shape[1]), dtype=dt, device=dev)
            for m, i in enumerate(rows):
                if counts[i] == 0:
                    continue
                if draft_probs[i] is None:
                    q[m, torch.arange(counts[i], device=dev), _long(draft_token_ids[i], dev)] = 1.0
                else:
                    q[m, : counts[i]] = draft_probs[i].to(device=dev, dtype=dt)
        noise, uniforms = self._draws(sub_states, [counts[i] for i in rows], k_max, x.shape[1], dt, dev)
        return rejection_sample(target, _drafts(rows, draft_token_ids, k_max, dev),
                                _long([counts[i] for i in rows], dev), q, uniforms, noise)

    def _draws(self, states, counts, k_max, vocab, dt, dev):
        """(noise Tensor[M, V] Exp(1) clamped to >= tiny, uniforms Tensor[M, K]); see the module doc."""
        m = len(states)
        noise = torch.empty((m, vocab), dtype=dt, device=dev)
        uniforms = torch.zeros((m, k_max), dtype=dt, device=dev)
        unseeded = [j for j, st in enumerate(states) if st.generator is None]
        if unseeded:
            g = self.sampler.global_generator(dev)
            part = torch.empty((len(unseeded), vocab), dtype=dt, device=dev).exponential_(generator=g)
            upart = torch.empty((len(unseeded), k_max), dtype=dt, device=dev).uniform_(generator=g)
            if len(unseeded) == m:
                noise, uniforms = part, upart
            else:
                idx = _long(unseeded, dev)
                noise[idx] = part
                uniforms[idx] = upart
        if len(unseeded) < m:
            scratch = self.sampler._device_generator(dev, "scratch")
            for j, st in enumerate(states):
                if st.generator is not None:
                    scratch.manual_seed(step_seed(st.generator))
                    noise[j].exponential_(generator=scratch)
                    if counts[j]:
                        uniforms[j, : counts[j]].uniform_(generator=scratch)
        return noise.clamp_min_(torch.finfo(dt).tiny), uniforms


def _greedy_fast(logits: torch.Tensor, drafts: list[list[int]], counts: list[int]) -> SpecSamplerOutput:
    """Every request plain greedy: the argmax of every row on the device, ONE device->host copy of those
    R = sum(1 + k_i) ids (the step's only host sync here), acceptance on the host (the drafts are host lists):
    the same rule as `greedy_verify` (longest prefix of drafts equal to the argmaxes, then the argmax after it;
    argmax ties -> the lowest id, as the float copy the general path takes, whose values are the same)."""
    am = logits.argmax(dim=-1).cpu().numpy()
    token_ids, num_accepted = [], []
    o = 0
    for d, c in zip(drafts, counts):
        row = am[o:o + 1 + c]
        a = 0
        while a < c and int(d[a]) == int(row[a]):
            a += 1
        token_ids.append([int(t) for t in d[:a]] + [int(row[a])])
        num_accepted.append(a)
        o += 1 + c
    return SpecSamplerOutput(token_ids=token_ids, num_accepted=num_accepted, logprobs=None)


def _check_inputs(logits, states, draft_token_ids, draft_probs, counts) -> None:
    if len(draft_token_ids) != len(states):
        raise ValueError(f"draft_token_ids has {len(draft_token_ids)} entries for {len(states)} requests")
    if draft_probs is not None and len(draft_probs) != len(states):
        raise ValueError(f"draft_probs has {len(draft_probs)} entries for {len(states)} requests")
    want = sum(1 + c for c in counts)
    if logits.dim() != 2 or logits.shape[0] != want:
        raise ValueError(f"logits must be [sum(1 + k_i), V] = [{want}, V]; got {tuple(logits.shape)}")
    vocab = logits.shape[1]
    for i, drafts in enumerate(draft_token_ids):
        if any(not 0 <= int(t) < vocab for t in drafts):
            raise ValueError(f"request {i}: draft token ids must be in [0, {vocab}); got {list(drafts)}")
        if draft_probs is not None and draft_probs[i] is not None:
            if tuple(draft_probs[i].shape) != (counts[i], vocab):
                raise ValueError(f"request {i}: draft_probs must be [{counts[i]}, {vocab}]; "
                                 f"got {tuple(draft_probs[i].shape)}")


def _position_states(states: list[SamplingState], drafts: list[list[int]]) -> list[SamplingState]:
    """One state per verified position: position j of request i sees output + drafts[:j].

    Only requests whose processors read the output (penalties, min_tokens still pending) get a copy
    per position; the others reuse their state (logit_bias does not depend on the position).
    """
    out: list[SamplingState] = []
    for st, d in zip(states, drafts):
        p = st.params
        needs = (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
                 or len(st.output_token_ids) < p.min_tokens)
        out.append(st)
        for j in range(1, len(d) + 1):
            if needs:
                out.append(SamplingState(p, st.prompt_token_ids, st.output_token_ids + list(d[:j]),
                                         None, st.eos_token_id))
            else:
                out.append(st)
    return out


def _apply_grammar(x, raw_logits, states, drafts, starts) -> None:
    """Mask each constrained request's positions in place: position j's mask is filled after the
    grammar accepted drafts[:j] (the sampler's own helper masks, with its dead-row fallback), then
    the accepted drafts are rolled back. Positions after a draft the grammar forbids keep no mask:
    the rule never reaches them (that draft has probability 0 at its own position)."""
    from k3serve.workers.sample.constraints import apply_grammar_masks

    for i, st in enumerate(states):
        g = st.structured
        if g is None or not g.active:
            continue
        accepted = 0
        for j in range(len(drafts[i]) + 1):
            if not g.active:  # terminated after an accepted draft: unconstrained, as in Sampler
                break
            r = starts[i] + j
            sub = x[r : r + 1]
            apply_grammar_masks(sub, raw_logits[r : r + 1], [st], [0])
            if j == len(drafts[i]):
                break
            tok = int(drafts[i][j])
            if sub[0, tok] == float("-inf"):
                break
            g.accept(tok)
            accepted += 1
        g.rollback(accepted)


def _emitted_logprobs(logprobs, token_ids, starts, num_top):
    flat_rows, toks, tops, owner = [], [], [], []
    for i, ids in enumerate(token_ids):
        if num_top[i] is None:
            continue
        for j, t in enumerate(ids):
            flat_rows.append(starts[i] + j)
            toks.append(t)
            tops.append(num_top[i])
            owner.append(i)
    result: list[list[list[LogprobEntry]] | None] = [None] * len(token_ids)
    dev = logprobs.device
    entries = gather_logprobs(logprobs[_long(flat_rows, dev)], _long(toks, dev), tops)
    for i, e in zip(owner, entries):
        if result[i] is None:
            result[i] = []
        result[i].append(e)
    return result


def _padded_index(reqs: list[int], starts: list[int], counts: list[int], k_max: int,
                  dev: torch.device) -> torch.Tensor:
    """Tensor[len(reqs), K+1] of flat row indices; positions past 1 + k_i repeat the last row."""
    idx = [[starts[i] + min(j, counts[i]) for j in range(k_max + 1)] for i in reqs]
    return torch.tensor(idx, dtype=torch.long, device=dev).view(len(reqs), k_max + 1)


def _drafts(reqs: list[int], drafts: list[list[int]], k_max: int, dev: torch.device) -> torch.Tensor:
    """Tensor[len(reqs), K] int64, padded with 0 (the padding is never accepted: num_draft masks it)."""
    rows = [list(drafts[i]) + [0] * (k_max - len(drafts[i])) for i in reqs]
    return torch.tensor(rows, dtype=torch.long, device=dev).view(len(reqs), k_max)


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
