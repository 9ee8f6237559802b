"""Chat-completions responses built from SeqDeltas of raw K3 output text (engine-free: the router reuses it).

The engine generates with `skip_special_tokens=False`, so each sequence's text carries the XTML
markers; `k3serve.chat.parsers` splits it into reasoning (`reasoning_content`), content and
tool calls. Streaming uses one `StreamingParser` per choice; non-streaming parses the whole text.
A choice that produced tool calls and stopped normally reports `finish_reason="tool_calls"`.
"""

from __future__ import annotations

from k3serve.chat.parsers import StreamingParser, parse_output
from k3serve.openai_api import protocol as P
from k3serve.openai_api.deltas import SeqDelta
from k3serve.openai_api.logprobs import TokenText, chat_logprobs


def _finish_reason(reason: str | None, has_tool_calls: bool) -> str | None:
    if reason == "stop" and has_tool_calls:
        return "tool_calls"
    return reason


class ChatOutputBuilder:
    """Streaming: `start_chunks()`, then `chunks(deltas)` per engine output, then `usage_chunk()`.
    Non-streaming: `add(deltas)` per engine output, then `response(usage)`.

    `logprobs_k`: None (no logprobs) or the number of top alternatives per token.
    """

    def __init__(self, *, rid: str, created: int, model: str, n: int, thinking: bool, tools_enabled: bool,
                 tool_choice, logprobs_k: int | None, token_text: TokenText | None,
                 include_usage: bool = False):
        self.rid, self.created, self.model, self.n = rid, created, model, n
        self.thinking, self.tools_enabled, self.tool_choice = thinking, tools_enabled, tool_choice
        self.logprobs_k = logprobs_k
        self.token_text = token_text
        self.include_usage = include_usage
        self._parsers = [StreamingParser(thinking, tools_enabled, tool_choice) for _ in range(n)]
        self._num_calls = [0] * n
        self._texts: list[list[str]] = [[] for _ in range(n)]
        self._lps: list[list[dict]] = [[] for _ in range(n)]
        self._finish: list[tuple[str | None, int | str | None]] = [(None, None)] * n

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        return P.chat_chunk(self.rid, self.created, self.model, choices, usage_=usage,
                            include_usage_field=self.include_usage)

    def _logprobs(self, d: SeqDelta) -> list[dict] | None:
        if self.logprobs_k is None or d.logprobs is None or self.token_text is None:
            return None
        return chat_logprobs(d.token_ids, d.logprobs, self.logprobs_k, self.token_text)

    # --- streaming ---------------------------------------------------------------------------
    def start_chunks(self) -> list[dict]:
        return [self._chunk([P.chat_delta_choice(i, {"role": "assistant", "content": ""})]) for i in range(self.n)]

    def chunks(self, deltas: list[SeqDelta]) -> list[dict]:
        out = []
        for d in deltas:
            parser = self._parsers[d.index]
            parsed = parser.feed(d.text) if d.text else []
            if d.finish_reason is not None:
                parsed += parser.finish()
            delta: dict = {}
            reasoning = "".join(p.reasoning for p in parsed if p.reasoning is not None)
            content = "".join(p.content for p in parsed if p.content is not None)
            calls = [p.tool_call.to_openai() for p in parsed if p.tool_call is not None]
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content:
                delta["content"] = content
            if calls:
                delta["tool_calls"] = calls
                self._num_calls[d.index] += len(calls)
            lp = self._logprobs(d)
            if not delta and lp is None and d.finish_reason is None:
                continue
            reason = _finish_reason(d.finish_reason, self._num_calls[d.index] > 0)
            out.append(self._chunk([P.chat_delta_choice(
                d.index, delta, finish_reason=reason, stop_reason=d.stop_reason,
                logprobs={"content": lp} if lp is not None else None)]))
        return out

    def usage_chunk(self, usage: dict) -> dict:
        return P.chat_chunk(self.rid, self.created, self.model, [], usage_=usage)

    # --- non-streaming -----------------------------------------------------------------------
    def add(self, deltas: list[SeqDelta]) -> None:
        for d in deltas:
            self._texts[d.index].append(d.text)
            lp = self._logprobs(d)
            if lp is not None:
                self._lps[d.index].extend(lp)
            if d.finish_reason is not None:
                self._finish[d.index] = (d.finish_reason, d.stop_reason)

    def response(self, usage: dict) -> dict:
        choices = []
        for i in range(self.n):
            parsed = parse_output("".join(self._texts[i]), thinking=self.thinking,
                                  tools_enabled=self.tools_enabled, tool_choice=self.tool_choice)
            calls = [c.to_openai() for c in parsed.tool_calls]
            reason, stop = self._finish[i]
            lp = {"content": self._lps[i]} if self.logprobs_k is not None else None
            choices.append(P.chat_choice(i, content=parsed.content, reasoning=parsed.reasoning, tool_calls=calls,
                                         finish_reason=_finish_reason(reason, bool(calls)), stop_reason=stop,
                                         logprobs=lp))
        return P.chat_response(self.rid, self.created, self.model, choices, usage)
