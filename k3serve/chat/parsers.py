"""K3 output parsers: reasoning / content / tool calls from detokenized output text.

Input is the generated TEXT decoded with ``skip_special_tokens=False`` (markers as literal
``<|open|>`` ...), i.e. what follows the generation prefix ``...<|open|>think<|sep|>`` (thinking) or
``...<|open|>response<|sep|>`` (non-thinking). The model output therefore usually starts inside a
channel without its open marker; an echoed opener is accepted too.

Channels (see docs/chat-format.md, "Output"):

* ``think`` (thinking mode only): reasoning. Ends at ``<|close|>think<|sep|>``, or at a ``response`` /
  ``tools`` opener, or at the message end. With no end marker everything is (truncated) reasoning.
* ``response``: content, until ``<|close|>response<|sep|>``; text after it (outside any channel) is
  content too.
* ``tools``: ``call`` elements (``tool="NAME" index="N"``) with ``argument`` elements (``key``,
  ``type``) or one ``json`` element. A call is emitted when its ``<|close|>call<|sep|>`` arrives, as
  ``{id, type: function, function: {name, arguments: JSON text}}``; calls without a name are dropped;
  text between calls is dropped; an unfinished call at the end degrades to content.
  With ``tools_enabled=False`` or ``tool_choice="none"`` the tools block is not parsed and stays
  literal content.
* ``<|close|>message<|sep|>`` / ``<|end_of_msg|>`` end the output; anything after is ignored.

Any marker that does not fit the current channel is kept as literal text of that channel, so malformed
output degrades to content/reasoning and never raises. ``parse_output`` equals feeding the whole text
to :class:`StreamingParser` at once, and the streaming result is independent of how text is chunked.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from k3serve.chat.lexer import XtmlLexer, XToken
from k3serve.chat.xtml import decode_value


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object (raw text if the model's json block was invalid)
    type: str = "function"

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": self.type, "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class DeltaToolCall:
    """One complete tool call in a stream; ``index`` is the 0-based running call count."""

    index: int
    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedDelta:
    """Exactly one of the fields is set."""

    reasoning: str | None = None
    content: str | None = None
    tool_call: DeltaToolCall | None = None


@dataclass
class ParsedOutput:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


def default_call_id(index: int, name: str) -> str:
    """``"{name}:{index}"`` with the 0-based call index: the alias the renderer resolves tool results by."""
    return f"{name}:{index}"


@dataclass
class _Call:
    name: str | None
    raw: list[str]
    args: dict[str, Any] = field(default_factory=dict)
    json_raw: str | None = None
    arg: tuple[str, str, str | None] | None = None  # (element, key, type) of the open argument/json
    value: list[str] = field(default_factory=list)


class StreamingParser:
    """Incremental K3 output parser.

    ``feed(delta_text) -> list[ParsedDelta]`` returns reasoning/content text deltas (coalesced, in
    order) and complete tool calls; ``finish() -> list[ParsedDelta]`` flushes held-back text.
    ``call_id(index, name)`` makes tool-call ids (default :func:`default_call_id`).
    """

    def __init__(self, thinking: bool, tools_enabled: bool, tool_choice: Any = None, *,
                 call_id: Callable[[int, str], str] = default_call_id):
        self.thinking = bool(thinking)
        self.parse_tools = bool(tools_enabled) and tool_choice != "none"
        self.call_id = call_id
        self._lexer = XtmlLexer()
        self._state = "think" if self.thinking else "response"
        self._at_start = True  # an echoed channel opener may still be consumed
        self._call: _Call | None = None
        self._num_calls = 0
        self._out: list[ParsedDelta] = []
        self._finished = False

    # -- public --------------------------------------------------------------------------------
    def feed(self, delta_text: str) -> list[ParsedDelta]:
        if self._finished:
            return []
        for tok in self._lexer.feed(delta_text):
            self._dispatch(tok)
        return self._take()

    def finish(self) -> list[ParsedDelta]:
        if self._finished:
            return []
        for tok in self._lexer.finish():
            self._dispatch(tok)
        if self._state == "tools" and self._call is not None:
            self._abandon_call()
        self._finished = True
        return self._take()

    # -- output helpers ------------------------------------------------------------------------
    def _take(self) -> list[ParsedDelta]:
        out, self._out = self._out, []
        return out

    def _emit(self, kind: str, text: str) -> None:
        if not text:
            return
        last = self._out[-1] if self._out else None
        if last is not None and getattr(last, kind) is not None:
            setattr(last, kind, getattr(last, kind) + text)
        else:
            self._out.append(ParsedDelta(**{kind: text}))

    # -- state machine -------------------------------------------------------------------------
    def _dispatch(self, tok: XToken) -> None:
        getattr(self, "_in_" + self._state)(tok)

    @staticmethod
    def _is(tok: XToken, kind: str, name: str | None = None) -> bool:
        return tok.kind == kind and (name is None or tok.name == name)

    def _ends_message(self, tok: XToken) -> bool:
        return tok.kind == "eom" or self._is(tok, "close", "message")

    def _in_end(self, tok: XToken) -> None:
        pass

    def _in_think(self, tok: XToken) -> None:
        if tok.kind == "text":
            self._emit("reasoning", tok.raw)
        elif self._is(tok, "open", "think"):
            pass  # echoed generation prefix
        elif self._is(tok, "close", "think"):
            self._state, self._at_start = "response", True
        elif self._is(tok, "open", "response"):
            self._state, self._at_start = "response", False
        elif self._is(tok, "open", "tools"):
            self._state, self._at_start = "response", False
            self._in_response(tok)
        elif self._ends_message(tok):
            self._state = "end"
        else:
            self._emit("reasoning", tok.raw)

    def _in_response(self, tok: XToken) -> None:
        at_start, self._at_start = self._at_start, False
        if tok.kind == "text":
            self._emit("content", tok.raw)
        elif self._is(tok, "open", "response") and at_start:
            pass
        elif self._is(tok, "close", "response"):
            self._state = "after"
        elif self._is(tok, "open", "tools") and self.parse_tools:
            self._state = "tools"
        elif self._ends_message(tok):
            self._state = "end"
        else:
            self._emit("content", tok.raw)

    def _in_after(self, tok: XToken) -> None:
        if self._is(tok, "open", "response"):
            self._state = "response"
        else:
            self._in_response(tok)

    def _in_tools(self, tok: XToken) -> None:
        call = self._call
        if call is None:
            if self._is(tok, "open", "call"):
                self._call = _Call(name=tok.attrs.get("tool") or None, raw=[tok.raw])
            elif self._is(tok, "close", "tools"):
                self._state = "after"
            elif self._ends_message(tok):
                self._state = "end"
            # anything else between calls is dropped
            return
        if self._is(tok, "close", "tools") or self._ends_message(tok):
            self._abandon_call()
            self._in_tools(tok)
            return
        call.raw.append(tok.raw)
        if self._is(tok, "close", "call"):
            self._finish_call(call)
        elif call.arg is not None:
            element = call.arg[0]
            if self._is(tok, "close", element):
                self._finish_argument(call)
            else:
                call.value.append(tok.raw)  # argument bodies are raw text, markers included
        elif self._is(tok, "open", "argument") and "key" in tok.attrs:
            call.arg, call.value = ("argument", tok.attrs["key"], tok.attrs.get("type")), []
        elif self._is(tok, "open", "json"):
            call.arg, call.value = ("json", "", None), []
        # other text/markers between arguments are ignored

    def _finish_argument(self, call: _Call) -> None:
        element, key, type_ = call.arg
        raw = "".join(call.value)
        if element == "json":
            call.json_raw = raw
        else:
            call.args[key] = decode_value(raw, type_)
        call.arg, call.value = None, []

    def _finish_call(self, call: _Call) -> None:
        self._call = None
        if not call.name:
            return
        if call.json_raw is not None:
            try:
                obj = json.loads(call.json_raw)
            except ValueError:
                obj = None
            arguments = (json.dumps({**obj, **call.args}, ensure_ascii=False) if isinstance(obj, dict)
                         else call.json_raw)
        else:
            arguments = json.dumps(call.args, ensure_ascii=False)
        index = self._num_calls
        self._num_calls += 1
        self._out.append(ParsedDelta(tool_call=DeltaToolCall(index, self.call_id(index, call.name),
                                                             call.name, arguments)))

    def _abandon_call(self) -> None:
        """An unfinished call degrades to content (its raw text)."""
        call, self._call = self._call, None
        self._emit("content", "".join(call.raw))


def collect(deltas: list[ParsedDelta]) -> ParsedOutput:
    """Aggregate stream deltas into a :class:`ParsedOutput` (empty reasoning/content -> None)."""
    reasoning = "".join(d.reasoning for d in deltas if d.reasoning is not None)
    content = "".join(d.content for d in deltas if d.content is not None)
    calls = [ToolCall(d.tool_call.id, d.tool_call.name, d.tool_call.arguments) for d in deltas
             if d.tool_call is not None]
    return ParsedOutput(reasoning or None, content or None, calls)


def parse_output(text: str, *, thinking: bool, tools_enabled: bool, tool_choice: Any = None,
                 call_id: Callable[[int, str], str] = default_call_id) -> ParsedOutput:
    """Non-streaming parse of a complete output text (see module docstring)."""
    parser = StreamingParser(thinking, tools_enabled, tool_choice, call_id=call_id)
    return collect(parser.feed(text) + parser.finish())
