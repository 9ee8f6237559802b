"""K3 chat renderer: OpenAI-style messages -> prompt token ids (no Jinja), per docs/chat-format.md.

Structural markers (``<|open|>``, ``<|close|>``, ``<|sep|>``, ``<|end_of_msg|>``,
``<|kimi_image_placeholder|>``) are emitted as their special-token ids. Every piece of text (tag
names, attributes, user/system/tool/assistant text, JSON) goes through ``tokenizer.encode``, which
only produces ordinary tokens, so text can never forge a marker. Each text piece is encoded on its own
(the piece boundaries are listed in docs/chat-format.md).

All malformed input raises ``ValueError`` with a message naming the problem (HTTP 400 upstream).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from k3serve.chat.xtml import (
    CLOSE,
    END_OF_MSG,
    IMAGE_PLACEHOLDER,
    OPEN,
    SEP,
    format_attrs,
    render_value,
    value_type,
)

THINKING_EFFORTS = ("low", "high", "max")
# OpenAI's reasoning_effort values onto K3's: "medium" (OpenAI's default) is K3's default (no effort marker)
OPENAI_EFFORTS = {"minimal": "low", "medium": None, "xhigh": "max"}
ROLES = ("system", "developer", "user", "assistant", "tool")
TEXT_PART_TYPES = ("text", "input_text")
IMAGE_PART_TYPES = ("image_url", "image", "input_image")

TOOLS_HEADER = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
DYNAMIC_TOOLS_HEADER = (
    "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n"
)
JSON_ONLY = ("Your response must be raw JSON data without markdown code blocks (```json) "
             "or any additional formatting.")


@dataclass
class RenderedPrompt:
    """``token_ids``: the prompt; ``thinking``: whether the generation prefix opened the think channel
    (the output parsers need it); ``thinking_effort``: the effort in effect, or None."""

    token_ids: list[int]
    thinking: bool
    thinking_effort: str | None = None


def _plain(obj: Any) -> Any:
    """Pydantic models / mappings -> plain dicts (recursively for lists)."""
    if hasattr(obj, "model_dump"):
        return obj.model_dump(exclude_none=True)
    if isinstance(obj, Mapping):
        return dict(obj)
    return obj


def _json_compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


class _Builder:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self._sp = {name: tokenizer.special_id(name) for name in (OPEN, CLOSE, SEP, END_OF_MSG)}

    def special(self, name: str) -> None:
        self.ids.append(self._sp[name] if name in self._sp else self.tok.special_id(name))

    def text(self, s: str) -> None:
        if s:
            self.ids.extend(self.tok.encode(s))

    def open(self, tag: str, attrs: list[tuple[str, Any]] = ()) -> None:
        self.special(OPEN)
        self.text(tag)
        for piece in format_attrs(list(attrs)):
            self.text(piece)
        self.special(SEP)

    def close(self, tag: str) -> None:
        self.special(CLOSE)
        self.text(tag)
        self.special(SEP)

    def end_message(self) -> None:
        self.close("message")
        self.special(END_OF_MSG)

    def system_notice(self, kind: str, body: str) -> None:
        """Internal system message ``<message role="system" type=KIND>`` used for tools/effort/format."""
        self.open("message", [("role", "system"), ("type", kind)])
        self.text(body.strip())
        self.end_message()


# ----------------------------------------------------------------------------------- validation


def resolve_thinking(thinking: bool | None, enable_thinking: bool | None,
                     reasoning_effort: str | None) -> tuple[bool, str | None]:
    """(thinking, thinking_effort) from the request knobs. Defaults to thinking on without an effort.

    ``enable_thinking`` is an alias of ``thinking`` (both given and different -> error);
    ``reasoning_effort="none"`` turns thinking off; ``low``/``high``/``max`` set the effort (only in
    effect while thinking is on); OpenAI's other values map onto these (`OPENAI_EFFORTS`: ``minimal`` ->
    ``low``, ``medium`` -> the default, ``xhigh`` -> ``max``); anything else is a ``ValueError``.
    """
    for name, v in (("thinking", thinking), ("enable_thinking", enable_thinking)):
        if v is not None and not isinstance(v, bool):
            raise ValueError(f"{name} must be a boolean, got {v!r}")
    if thinking is not None and enable_thinking is not None and thinking != enable_thinking:
        raise ValueError("thinking and enable_thinking disagree; pass only one of them")
    on = thinking if thinking is not None else enable_thinking
    effort = None
    if isinstance(reasoning_effort, str) and reasoning_effort in OPENAI_EFFORTS:
        reasoning_effort = OPENAI_EFFORTS[reasoning_effort]
        if reasoning_effort is None:  # OpenAI's default level: the model's own default
            return (True if on is None else on), None
    if reasoning_effort is not None:
        if reasoning_effort == "none":
            on = False
        elif reasoning_effort in THINKING_EFFORTS:
            effort = reasoning_effort
        else:
            raise ValueError(f"reasoning_effort must be one of {['none', *THINKING_EFFORTS, *OPENAI_EFFORTS]}, "
                             f"got {reasoning_effort!r}")
    on = True if on is None else on
    return on, (effort if on else None)


def _validate_schema(where: str, schema: Any) -> None:
    if not isinstance(schema, dict):
        raise ValueError(f"{where}.parameters must be a JSON-schema object, got {type(schema).__name__}")
    if "type" in schema and schema["type"] != "object":
        raise ValueError(f"{where}.parameters.type must be 'object', got {schema['type']!r}")
    props = schema.get("properties", {})
    if not isinstance(props, dict) or any(not isinstance(v, dict | bool) for v in props.values()):
        raise ValueError(f"{where}.parameters.properties must map names to schemas")
    req = schema.get("required", [])
    if not isinstance(req, list) or any(not isinstance(r, str) for r in req):
        raise ValueError(f"{where}.parameters.required must be a list of strings")


def validate_tools(tools: Any) -> list[dict]:
    """OpenAI ``tools`` -> list of ``{"type": "function", "function": {...}}`` dicts; ValueError if bad."""
    if tools is None:
        return []
    if not isinstance(tools, list | tuple):
        raise ValueError("tools must be a list")
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        tool = _plain(tool)
        if not isinstance(tool, dict):
            raise ValueError(f"{where} must be an object")
        if tool.get("type", "function") != "function":
            raise ValueError(f"{where}.type must be 'function', got {tool.get('type')!r}")
        fn = _plain(tool.get("function"))
        if not isinstance(fn, dict):
            raise ValueError(f"{where}.function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.function.name must be a non-empty string")
        if name in names:
            raise ValueError(f"{where}: duplicate tool name {name!r}")
        names.add(name)
        if "description" in fn and fn["description"] is not None and not isinstance(fn["description"], str):
            raise ValueError(f"{where}.function.description must be a string")
        if fn.get("parameters") is not None:
            _validate_schema(f"{where}.function", fn["parameters"])
        fn = {k: v for k, v in fn.items() if v is not None}
        out.append({**{k: v for k, v in tool.items() if v is not None}, "type": "function", "function": fn})
    return out


def _tool_choice_notice(tool_choice: Any, tool_names: list[str]) -> str | None:
    choice = _plain(tool_choice)
    if choice is None or choice == "auto":
        return None
    if choice == "none":
        return "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message."
    if choice == "required":
        if not tool_names:
            raise ValueError("tool_choice='required' needs a non-empty tools list")
        return "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message."
    if isinstance(choice, dict):
        fn = _plain(choice.get("function")) or {}
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise ValueError("tool_choice object must be {'type': 'function', 'function': {'name': ...}}")
        if name not in tool_names:
            raise ValueError(f"tool_choice names tool {name!r}, which is not in tools")
        return (f"The system is invoked with `tool_choice={name}`.\n"
                f"You MUST call the tool `{name}` in the next message.")
    raise ValueError(f"tool_choice must be 'auto', 'none', 'required' or a function object, got {choice!r}")


def _response_format_notice(response_format: Any) -> str | None:
    rf = _plain(response_format)
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise ValueError("response_format must be an object")
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return f"The system is invoked with `response_format=json_object`.\n{JSON_ONLY}"
    if kind == "json_schema":
        js = _plain(rf.get("json_schema"))
        if not isinstance(js, dict):
            raise ValueError("response_format.json_schema must be an object")
        schema = js.get("schema", js.get("json_schema", js))
        return (f"The system is invoked with `response_format=json_schema`.\n{JSON_ONLY}\n"
                f"The JSON data must match the following schema:\n```json\n{_json_compact(schema)}\n```")
    raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


# ---------------------------------------------------------------------------- tool-result matching


def _call_function(call: Any, where: str) -> tuple[str, Any]:
    """(name, arguments) of an assistant tool call (OpenAI shape or flat {name, arguments})."""
    call = _plain(call)
    if not isinstance(call, dict):
        raise ValueError(f"{where} must be an object")
    fn = _plain(call.get("function", call))
    if not isinstance(fn, dict):
        raise ValueError(f"{where}.function must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.function.name must be a non-empty string")
    return name, fn.get("arguments")


@dataclass
class _ToolResult:
    message: dict
    tool: str
    index: int  # 1-based
    where: str


def _resolve_tool_block(block: list[tuple[int, dict]], calls: list[tuple[str | None, str]]) -> list[_ToolResult]:
    """Match a run of consecutive tool messages to the preceding assistant's calls.

    Aliases per call at 0-based position p: its ``id`` and ``"{name}:{p}"``. If every message resolves,
    each gets the call's name and 1-based index and the run is stably sorted into call order. Otherwise
    the run stays in its order; each message then takes its own ``name``, else the call at its
    position in the run, with the running 1-based position as index.
    """
    where = [f"messages[{i}]" for i, _ in block]
    if not calls:
        raise ValueError(f"{where[0]}: tool message without a preceding assistant tool call")
    aliases: dict[str, int] = {}
    for p, (call_id, name) in enumerate(calls):
        if call_id is not None:
            aliases.setdefault(str(call_id), p)
        aliases.setdefault(f"{name}:{p}", p)
    positions = []
    for _, msg in block:
        key = msg.get("tool_call_id", msg.get("id"))
        positions.append(aliases.get(str(key)) if key is not None else None)
    if all(p is not None for p in positions):
        resolved = [_ToolResult(msg, calls[p][1], p + 1, w) for p, (_, msg), w in zip(positions, block, where)]
        return sorted(resolved, key=lambda r: r.index)
    out = []
    for k, (_, msg) in enumerate(block):
        name = msg.get("name") or msg.get("tool")
        if not name:
            if k >= len(calls):
                raise ValueError(f"{where[k]}: tool message (tool_call_id={msg.get('tool_call_id')!r}) "
                                 f"has no matching tool call")
            name = calls[k][1]
        out.append(_ToolResult(msg, str(name), k + 1, where[k]))
    return out


# ----------------------------------------------------------------------------------- rendering


def _render_content(b: _Builder, content: Any, where: str) -> None:
    content = _plain(content)
    if content is None:
        return
    if isinstance(content, str):
        b.text(content)
        return
    if not isinstance(content, list | tuple):
        raise ValueError(f"{where}.content must be a string or a list of content parts")
    for j, part in enumerate(content):
        part = _plain(part)
        if isinstance(part, str):
            b.text(part)
            continue
        if not isinstance(part, dict):
            raise ValueError(f"{where}.content[{j}] must be an object")
        kind = part.get("type")
        if kind in TEXT_PART_TYPES:
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{where}.content[{j}].text must be a string")
            b.text(text)
        elif kind in IMAGE_PART_TYPES:
            b.special(IMAGE_PLACEHOLDER)
        else:
            raise ValueError(f"{where}.content[{j}] has unsupported type {kind!r}")


def _normalize_arguments(args: Any, where: str) -> tuple[dict | None, str | None]:
    """(dict, None) for object arguments; (None, raw) for a string that is not valid JSON."""
    args = _plain(args)
    if args is None:
        return {}, None
    if isinstance(args, str):
        if not args.strip():
            return {}, None
        try:
            args = json.loads(args)
        except ValueError:
            return None, args
    if not isinstance(args, dict):
        raise ValueError(f"{where}.function.arguments must be a JSON object")
    return args, None


def _render_assistant(b: _Builder, msg: dict, where: str, thinking: bool) -> None:
    b.open("message", [("role", "assistant")])
    if thinking:
        b.open("think")
        reasoning = msg.get("reasoning_content", msg.get("reasoning"))
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise ValueError(f"{where}.reasoning_content must be a string")
            if reasoning.strip():
                b.text(reasoning)
        b.close("think")
    b.open("response")
    _render_content(b, msg.get("content"), where)
    b.close("response")
    calls = msg.get("tool_calls") or []
    if calls:
        b.open("tools")
        for k, call in enumerate(calls):
            cw = f"{where}.tool_calls[{k}]"
            name, raw_args = _call_function(call, cw)
            args, raw = _normalize_arguments(raw_args, cw)
            b.open("call", [("tool", name), ("index", k + 1)])
            if raw is not None:
                b.open("json", [("type", "object")])
                b.text(raw)
                b.close("json")
            else:
                for key, value in args.items():
                    try:
                        b.open("argument", [("key", key), ("type", value_type(value))])
                    except ValueError as e:
                        raise ValueError(f"{cw}: argument {key!r}: {e}") from None
                    b.text(render_value(value))
                    b.close("argument")
            b.close("call")
        b.close("tools")
    b.end_message()


def render_chat(tokenizer, messages, *, tools=None, tool_choice=None, thinking=None, enable_thinking=None,
                reasoning_effort=None, response_format=None, add_generation_prompt=True) -> RenderedPrompt:
    """Render an OpenAI chat request into K3 prompt token ids (see docs/chat-format.md).

    ``messages``: list of dicts (or pydantic models) with ``role`` in system/developer/user/assistant/
    tool. Returns ``RenderedPrompt(token_ids, thinking, thinking_effort)``. Raises ``ValueError`` for
    unknown roles, unmatched tool messages, malformed tools/tool calls/content parts, invalid effort.
    """
    on, effort = resolve_thinking(thinking, enable_thinking, reasoning_effort)
    tool_list = validate_tools(tools)
    tool_names = [t["function"]["name"] for t in tool_list]
    choice_notice = _tool_choice_notice(tool_choice, tool_names)
    format_notice = _response_format_notice(response_format)
    if not isinstance(messages, list | tuple):
        raise ValueError("messages must be a list")
    msgs = []
    for i, m in enumerate(messages):
        m = _plain(m)
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object")
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}]: unknown role {m.get('role')!r} (expected one of {list(ROLES)})")
        msgs.append(m)

    b = _Builder(tokenizer)
    if tool_list:
        b.system_notice("tool-declare", f"{TOOLS_HEADER}```json\n{_json_compact(tool_list)}\n```")
    if effort is not None:
        b.system_notice(
            "thinking-effort",
            "`thinking_effort` guides on how much to think in your thinking channel (not including the "
            "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
            f"Now the system is invoked with `thinking_effort={effort}`.",
        )

    calls: list[tuple[str | None, str]] = []  # (id, name) of the latest assistant message's calls
    i = 0
    while i < len(msgs):
        m, where = msgs[i], f"messages[{i}]"
        role = m["role"]
        if role == "tool":
            block = []
            while i < len(msgs) and msgs[i]["role"] == "tool":
                block.append((i, msgs[i]))
                i += 1
            for r in _resolve_tool_block(block, calls):
                b.open("message", [("role", "tool"), ("tool", r.tool), ("index", r.index)])
                _render_content(b, r.message.get("content"), r.where)
                b.end_message()
            continue
        if role == "assistant":
            calls = []
            for k, c in enumerate(m.get("tool_calls") or []):
                name, _ = _call_function(c, f"{where}.tool_calls[{k}]")
                calls.append((_plain(c).get("id"), name))
            _render_assistant(b, m, where, on)
        elif role in ("system", "developer") and m.get("tools"):
            extra = validate_tools(m["tools"])
            b.system_notice("tool-declare", f"{DYNAMIC_TOOLS_HEADER}```json\n{_json_compact(extra)}\n```")
        else:
            attrs = [("role", "system" if role == "developer" else role)]
            if m.get("name"):
                attrs.append(("name", m["name"]))
            b.open("message", attrs)
            _render_content(b, m.get("content"), where)
            b.end_message()
        i += 1

    if choice_notice:
        b.system_notice("tool-choice", choice_notice)
    if format_notice:
        b.system_notice("response-format", format_notice)
    if add_generation_prompt:
        b.open("message", [("role", "assistant")])
        b.open("think" if on else "response")
    return RenderedPrompt(b.ids, on, effort)
