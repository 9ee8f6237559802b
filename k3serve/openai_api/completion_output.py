"""Completions-API responses built from SeqDeltas (engine-free: the router reuses it).

A batch request has P prompts × n sequences; choice index = prompt_index * n + sequence index.
"""

from __future__ import annotations

from k3serve.openai_api import protocol as P
from k3serve.openai_api.deltas import SeqDelta
from k3serve.openai_api.logprobs import CompletionLogprobs, TokenText, merge_completion_logprobs


class CompletionOutputBuilder:
    """Streaming: `chunks(prompt_index, deltas)` → chunk dicts. Non-streaming: `add()` then `response()`.

    `echo_texts[p]` (or None) is prepended to every choice of prompt p; `logprobs_k` is the request's
    `logprobs` (None: no logprobs).
    """

    def __init__(self, *, rid: str, created: int, model: str, n: int, num_prompts: int,
                 echo_texts: list[str] | None, logprobs_k: int | None, token_text: TokenText | None):
        self.rid, self.created, self.model, self.n = rid, created, model, n
        self.echo_texts = echo_texts
        self.logprobs_k = logprobs_k
        self._texts: dict[int, list[str]] = {}
        self._lp_parts: dict[int, list[dict]] = {}
        self._lp: dict[int, CompletionLogprobs] = {}
        self._finish: dict[int, tuple[str | None, int | str | None]] = {}
        self._echoed: set[int] = set()
        self._token_text = token_text
        self.num_choices = n * num_prompts

    def _choice_index(self, prompt_index: int, d: SeqDelta) -> int:
        return prompt_index * self.n + d.index

    def _prefix(self, prompt_index: int, ci: int) -> str:
        if self.echo_texts is None or ci in self._echoed:
            return ""
        self._echoed.add(ci)
        return self.echo_texts[prompt_index]

    def _logprobs(self, ci: int, d: SeqDelta, start_offset: int) -> dict | None:
        if self.logprobs_k is None or d.logprobs is None or self._token_text is None:
            return None
        lp = self._lp.setdefault(ci, CompletionLogprobs(self.logprobs_k, self._token_text, start_offset))
        return lp.add(d.token_ids, d.logprobs)

    def chunks(self, prompt_index: int, deltas: list[SeqDelta]) -> list[dict]:
        out = []
        for d in deltas:
            ci = self._choice_index(prompt_index, d)
            text = self._prefix(prompt_index, ci) + d.text
            lp = self._logprobs(ci, d, len(text) - len(d.text))
            if not text and lp is None and d.finish_reason is None:
                continue
            choice = P.completion_choice(ci, text, finish_reason=d.finish_reason, stop_reason=d.stop_reason,
                                         logprobs=lp)
            out.append(P.completion_response(self.rid, self.created, self.model, [choice], None, chunk=True))
        return out

    def add(self, prompt_index: int, deltas: list[SeqDelta]) -> None:
        for d in deltas:
            ci = self._choice_index(prompt_index, d)
            parts = self._texts.setdefault(ci, [])
            prefix = self._prefix(prompt_index, ci)
            parts.append(prefix + d.text)
            lp = self._logprobs(ci, d, len(prefix))
            if lp is not None:
                self._lp_parts.setdefault(ci, []).append(lp)
            if d.finish_reason is not None:
                self._finish[ci] = (d.finish_reason, d.stop_reason)

    def response(self, usage: dict) -> dict:
        choices = []
        for ci in range(self.num_choices):
            reason, stop = self._finish.get(ci, (None, None))
            text = "".join(self._texts.get(ci, []))
            if ci not in self._echoed and self.echo_texts is not None:
                text = self.echo_texts[ci // self.n] + text
            choices.append(P.completion_choice(ci, text, finish_reason=reason, stop_reason=stop,
                                               logprobs=merge_completion_logprobs(self._lp_parts.get(ci, []))))
        return P.completion_response(self.rid, self.created, self.model, choices, usage)

    def usage_chunk(self, usage: dict) -> dict:
        return P.completion_response(self.rid, self.created, self.model, [], usage, chunk=True)
