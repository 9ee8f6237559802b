"""The K3 tool-call region of a constrained chat output (docs/chat-format.md section 3 and 4).

    <|open|>tools<|sep|>
      <|open|>call tool="NAME" index="K"<|sep|>
        <|open|>argument key="KEY" type="T"<|sep|>VALUE<|close|>argument<|sep|> ...
      <|close|>call<|sep|> ...
    <|close|>tools<|sep|>

`tool_choice`: "none" -> no region; "auto" -> optional, one or more calls to any tool (a strict tool's
arguments follow its schema, a non-strict tool's are free); "required" -> one or more calls, every
tool's arguments per its schema; a named function -> exactly one call to it (index 1), arguments per
its schema. `parallel_tool_calls` false -> at most one call.

Arguments per schema: the object's properties in declaration order, each required one present and
each optional one at most once (a stricter, order-fixed form of K3's order-free arguments; no extra
keys). Values by the property's type: `string` values are raw text (an enum/const is one of its
strings, a `pattern` is that regex, a `minLength`/`maxLength` bound is a bounded run of characters
other than `<`, otherwise free text without XTML markers); `integer`/`number` (type attribute
"number"), `boolean`, `null`, `object`, `array` values are compact JSON per the property's schema
with the root `$defs` re-attached; a property with several types is any of them; a property without
a type (anyOf, $ref, ...) is compact JSON per its schema with a non-string type attribute (the parser
decodes every non-string type as JSON).
"""

from __future__ import annotations

from k3serve.chat.xtml import escape_attr
from k3serve.sampling_params import StructuredOutputsParams
from k3serve.workers.structured.errors import StructuredOutputError
from k3serve.workers.structured.grammar import (
    alt,
    close_marker,
    free_text,
    json_format,
    open_marker,
    optional,
    regex,
    seq,
    text,
    token,
)
from k3serve.workers.structured.vocab import Markers

MAX_BOUNDED_STRING = 4096
_JSON_ATTR = {"integer": "number", "number": "number", "boolean": "boolean", "null": "null", "object": "object",
              "array": "array"}


def tools_region(so: StructuredOutputsParams, m: Markers) -> dict | None:
    if so.tool_choice == "none" or not so.tools:
        return None
    name = so.tool_name()
    if name is not None:
        (tool,) = [t for t in so.tools if t["name"] == name]
        return seq(*open_marker(m, "tools"), _call(tool, m, True, index="1"), *close_marker(m, "tools"))
    enforce = so.tool_choice == "required"
    calls = alt(*(_call(t, m, enforce or bool(t.get("strict"))) for t in so.tools))
    body = {"type": "plus", "content": calls} if so.parallel_tool_calls else calls
    region = seq(*open_marker(m, "tools"), body, *close_marker(m, "tools"))
    return region if enforce else optional(region)


def _call(tool: dict, m: Markers, use_schema: bool, index: str | None = None) -> dict:
    name = tool["name"]
    head = [token(m.open), text(f'call tool="{escape_attr(name)}" index="')]
    head += [text(index)] if index is not None else [regex("[1-9][0-9]?")]
    head += [text('"'), token(m.sep)]
    params = tool.get("parameters") or {"type": "object", "properties": {}}
    args = _schema_arguments(params, m, f"tools.{name}.parameters") if use_schema else [_free_arguments(m)]
    return seq(*head, *args, *close_marker(m, "call"))


def _argument(m: Markers, key: str, type_attr: dict, value: dict) -> dict:
    return seq(token(m.open), text(f'argument key="{escape_attr(key)}" type="'), type_attr, text('"'),
               token(m.sep), value, *close_marker(m, "argument"))


def _free_arguments(m: Markers) -> dict:
    """Any number of arguments with any key and any typed value (a non-strict tool under auto)."""
    key = regex('[A-Za-z0-9_.\\-]{1,64}')
    as_string = seq(text('string"'), token(m.sep), free_text())
    as_json = seq(regex("(number|boolean|null|object|array)"), text('"'), token(m.sep),
                  json_format(True, strict=False, where="arguments"))
    one = seq(token(m.open), text('argument key="'), key, text('" type="'), alt(as_string, as_json),
              *close_marker(m, "argument"))
    return {"type": "star", "content": one}


def _schema_arguments(params: dict, m: Markers, where: str) -> list[dict]:
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise StructuredOutputError(f"{where}: must be an object schema")
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    props = params.get("properties") or {}
    required = set(params.get("required") or [])
    missing = sorted(required - set(props))
    if missing:
        raise StructuredOutputError(f"{where}: required property {missing[0]!r} is not in properties")
    out = []
    for key, sub in props.items():
        arg = _property(key, sub, defs, m, f"{where}.properties.{key}")
        out.append(arg if key in required else optional(arg))
    return out


def _property(key: str, sub, defs: dict, m: Markers, where: str) -> dict:
    if sub is True or sub == {}:
        sub = {}
    if not isinstance(sub, dict):
        raise StructuredOutputError(f"{where}: a property schema must be an object")
    types = sub.get("type")
    if types is None and ("enum" in sub or "const" in sub):
        values = sub.get("enum", [sub.get("const")])
        if values and all(isinstance(v, str) for v in values):
            types = "string"
    if isinstance(types, list):
        return alt(*(_property(key, {**sub, "type": t}, defs, m, where) for t in types))
    if types == "string":
        return _argument(m, key, text("string"), _string_value(sub, where))
    if types in _JSON_ATTR:
        return _argument(m, key, text(_JSON_ATTR[types]), json_format({**sub, **defs}, where=where))
    if types is not None:
        raise StructuredOutputError(f"{where}: unsupported type {types!r}")
    return _argument(m, key, regex("(number|boolean|null|object|array)"), json_format({**sub, **defs}, where=where))


def _string_value(sub: dict, where: str) -> dict:
    if "const" in sub:
        return text(str(sub["const"]))
    if "enum" in sub:
        values = [v for v in sub["enum"] if isinstance(v, str)]
        if not values:
            raise StructuredOutputError(f"{where}: a string enum needs at least one string value")
        return alt(*(text(v) for v in values))
    if "pattern" in sub:
        return regex(sub["pattern"])
    lo, hi = sub.get("minLength"), sub.get("maxLength")
    if lo is not None or hi is not None:
        lo = int(lo or 0)
        if hi is not None and int(hi) < lo:
            raise StructuredOutputError(f"{where}: maxLength {hi} is less than minLength {lo}")
        if hi is not None and int(hi) <= MAX_BOUNDED_STRING:
            return regex(f"[^<]{{{lo},{int(hi)}}}")
        if lo > 0:
            return regex(f"[^<]{{{lo},}}")
    return free_text()

