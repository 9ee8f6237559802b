"""Acceptance measurements of the demo model (figures for the model card).

* `heldout_perplexity`: exp(mean next-token cross-entropy) over the held-out files' token stream, cut
  into non-overlapping windows (every token of every window is scored; the first token of a window has
  no context, as at the start of a file).
* `function_body_parse_rate`: for held-out functions, the prompt is the file's text before the function
  plus its header (def line(s)), the last `prompt_tokens` tokens of it; the model greedily writes up to
  `max_new` tokens; the completion is cut at the first non-blank line indented no deeper than the
  `def` (the function ended) or, when the budget runs out first, after its last complete line; a case
  passes when `ast.parse(dedent(header + completion))` succeeds (an empty body fails). Also reported:
  how many completions ended the function within the budget.
* `mtp_accuracy`: teacher-forced top-1 accuracy of the MTP layer (position t: predict x_{t+2} from h_t
  and x_{t+1}) on held-out windows, counted where the target's own next-token guess is right too: the
  chance that a first draft is accepted, given the target's token.
"""

from __future__ import annotations

import ast
import math
import textwrap

import torch

from . import forward as F
from .corpus import Function


@torch.no_grad()
def heldout_perplexity(w, cfg, tokens: torch.Tensor, window: int, opt, batch: int = 32,
                       max_windows: int | None = None) -> tuple[float, int]:
    n = (tokens.numel() - 1) // window
    if max_windows is not None:
        n = min(n, max_windows)
    total, count = 0.0, 0
    for s in range(0, n, batch):
        idx = torch.arange(s, min(n, s + batch), device=tokens.device)[:, None] * window
        pos = idx + torch.arange(window + 1, device=tokens.device)[None, :]
        chunk = tokens[pos]
        logits = F.lm_logits(w, cfg, F.hidden_states(w, cfg, chunk[:, :-1], opt))
        ce = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1),
                                               reduction="sum")
        total += float(ce)
        count += chunk[:, 1:].numel()
    return math.exp(total / max(count, 1)), count


@torch.no_grad()
def greedy_batch(w, cfg, prompts: torch.Tensor, max_new: int, opt, stop_ids=()) -> torch.Tensor:
    """Equal-length prompts `[B, P]` -> `[B, max_new]` greedy tokens (full recomputation each step)."""
    seq = prompts
    for _ in range(max_new):
        logits = F.lm_logits(w, cfg, F.hidden_states(w, cfg, seq, opt)[:, -1])
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    return seq[:, prompts.shape[1]:]


def cut_completion(text: str, indent: str) -> tuple[str, bool]:
    """(the completion up to where the function ends, whether it ended within the text)."""
    lines = text.split("\n")
    kept = []
    for n, line in enumerate(lines):
        last = n == len(lines) - 1
        if last:
            return "".join(x + "\n" for x in kept), False  # unfinished last line: dropped
        if line.strip() and len(line) - len(line.lstrip()) <= len(indent):
            return "".join(x + "\n" for x in kept), True
        kept.append(line)
    return "".join(x + "\n" for x in kept), False


def body_parses(header: str, completion: str) -> bool:
    body = [x for x in completion.split("\n") if x.strip()]
    if not body:
        return False
    try:
        ast.parse(textwrap.dedent(header + completion))
    except (SyntaxError, ValueError):
        return False
    return True


def function_body_parse_rate(w, cfg, tok, funcs: list[Function], opt, prompt_tokens: int = 256, max_new: int = 128,
                             limit: int = 64, device="cpu", batch: int = 32, examples: list | None = None):
    """(passed, ended, cases) for up to `limit` held-out functions whose prompt has >= prompt_tokens tokens."""
    cases = []
    for f in funcs:
        ids = tok.encode(f.prefix + f.header)  # ends with the header's final newline
        if len(ids) < prompt_tokens:
            continue
        cases.append((f, ids[-prompt_tokens:]))
        if len(cases) >= limit:
            break
    passed = ended = 0
    for s in range(0, len(cases), batch):
        part = cases[s : s + batch]
        prompts = torch.tensor([c[1] for c in part], device=device)
        out = greedy_batch(w, cfg, prompts, max_new, opt)
        for (f, _), row in zip(part, out.tolist()):
            ordinary = []
            for t in row:
                if t >= tok.num_base_tokens:
                    break
                ordinary.append(t)
            text = tok.decode(ordinary)
            comp, done = cut_completion(text, f.indent)
            ok = body_parses(f.header, comp)
            passed += ok
            ended += done
            if examples is not None and len(examples) < 6:
                examples.append({"function": f.name, "parsed": ok, "ended": done, "completion": comp})
    return passed, ended, len(cases)


@torch.no_grad()
def mtp_accuracy(w, cfg, tokens: torch.Tensor, window: int, opt, windows: int = 64) -> tuple[float, float]:
    """(MTP top-1 accuracy on x_{t+2}, the same where the target's x_{t+1} guess is right)."""
    n = min((tokens.numel() - 1) // window, windows)
    idx = torch.arange(n, device=tokens.device)[:, None] * window + torch.arange(window, device=tokens.device)
    chunk = tokens[idx]
    h = F.hidden_states(w, cfg, chunk, opt)
    tgt_ok = F.lm_logits(w, cfg, h[:, :-2]).argmax(-1) == chunk[:, 1:-1]
    ml, _ = F.mtp_hidden(w, cfg, 0, h[:, :-2], chunk[:, 1:-1], opt)
    mtp_ok = ml.argmax(-1) == chunk[:, 2:]
    return float(mtp_ok.float().mean()), float((mtp_ok & tgt_ok).float().sum() / tgt_ok.float().sum().clamp_min(1))
