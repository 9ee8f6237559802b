"""`StructuredOutputsParams` -> an XGrammar structural tag (plain dict in XGrammar's JSON format).

Shapes (docs/serving.md "Structured outputs"; the K3 envelope of docs/chat-format.md section 4):

* completions (`k3_chat` off): BODY, then the end of turn (XGrammar's stop token).
* chat, thinking off (the prompt ends with `<|open|>response<|sep|>`):
  BODY `<|close|>response<|sep|>` [TOOLS] `<|close|>message<|sep|>` `<|end_of_msg|>`
* chat, thinking on (the prompt ends with `<|open|>think<|sep|>`): free text (no XTML marker) then
  `<|close|>think<|sep|><|open|>response<|sep|>`, then as above.

BODY is the body constraint (JSON schema / JSON object / regex / choice / EBNF) or, in chat without
one, free text without XTML markers. TOOLS is built by `k3_tools.tools_region`. Markers are token
elements (see vocab.py), so they are always the special tokens, never spelled out in text. JSON is
generated compactly (XGrammar's `any_whitespace=False`: separators ", " and ": "), so a constrained
JSON output cannot pad itself with whitespace.
"""

from __future__ import annotations

import json
from functools import lru_cache

from k3serve.sampling_params import StructuredOutputsParams
from k3serve.workers.structured.errors import StructuredOutputError, xgrammar_message
from k3serve.workers.structured.vocab import MARKER_NAMES, Markers


def token(i: int) -> dict:
    return {"type": "token", "token": int(i)}


def text(s: str) -> dict:
    return {"type": "const_string", "value": s}


def seq(*elements: dict) -> dict:
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": list(elements)}


def alt(*elements: dict) -> dict:
    return elements[0] if len(elements) == 1 else {"type": "or", "elements": list(elements)}


def optional(content: dict) -> dict:
    return {"type": "optional", "content": content}


def free_text() -> dict:
    """Any text that contains no XTML marker (neither the special tokens nor their spelling)."""
    return {"type": "any_text", "excludes": list(MARKER_NAMES)}


def regex(pattern: str) -> dict:
    return {"type": "regex", "pattern": pattern}


def ebnf(grammar: str) -> dict:
    return {"type": "grammar", "grammar": grammar}


def open_marker(m: Markers, name: str) -> list[dict]:
    return [token(m.open), text(name), token(m.sep)]


def close_marker(m: Markers, name: str) -> list[dict]:
    return [token(m.close), text(name), token(m.sep)]


# XGrammar 0.2.9 writes a length-bounded JSON string's characters as [^"\\\r\n], which lets raw control
# characters (invalid in JSON) through; the unbounded string rule excludes \0-\x1f. Same fix here.
_BOUNDED_CHARS = '[^\\"\\\\\\r\\n]'
_JSON_CHARS = '[^\\"\\\\\\0-\\x1f]'


@lru_cache(maxsize=1024)
def _json_ebnf(schema_json: str, strict: bool) -> str:
    import xgrammar as xgr

    text = str(xgr.Grammar.from_json_schema(schema_json, any_whitespace=False, strict_mode=strict))
    return text.replace(_BOUNDED_CHARS, _JSON_CHARS)


def json_format(schema, *, strict: bool = True, where: str = "json") -> dict:
    """A compact-JSON format for `schema` (dict or bool); XGrammar's conversion errors name `where`."""
    try:
        # key order kept: XGrammar emits an object's properties in the schema's order
        return ebnf(_json_ebnf(json.dumps(schema), strict))
    except (RuntimeError, ValueError, TypeError) as e:
        raise StructuredOutputError(f"{where}: {xgrammar_message(e)}") from None


def body_format(so: StructuredOutputsParams) -> dict | None:
    """The body constraint's format, or None when the request has none."""
    kind = so.body_kind
    if kind == "json":
        return json_format(so.json, where="json schema")
    if kind == "json_object":
        return json_format({"type": "object"}, strict=False, where="json_object")
    if kind == "regex":
        return regex(so.regex)
    if kind == "grammar":
        return ebnf(so.grammar)
    if kind == "choice":
        return alt(*(text(c) for c in so.choice if c)) if any(so.choice) else text("")
    return None


def structural_tag(so: StructuredOutputsParams, markers: Markers) -> dict:
    """The whole constraint for `so` as XGrammar's structural-tag JSON object."""
    from k3serve.workers.structured.k3_tools import tools_region

    body = body_format(so)
    if not so.k3_chat:
        if body is None:
            raise StructuredOutputError("structured outputs: nothing to constrain (no json, json_object, "
                                        "regex, choice or grammar)")
        fmt = body
    else:
        elements: list[dict] = []
        if so.thinking:
            elements += [free_text(), *close_marker(markers, "think"), *open_marker(markers, "response")]
        elements += [body if body is not None else free_text(), *close_marker(markers, "response")]
        tools = tools_region(so, markers)
        if tools is not None:
            elements.append(tools)
        elements += close_marker(markers, "message")
        fmt = seq(*elements)
    return {"type": "structural_tag", "format": fmt}


def cache_key(so: StructuredOutputsParams) -> str:
    """One string per distinct constraint: JSON of the non-default fields, in their order (property order
    is part of a schema's meaning: it is the order the properties are generated in)."""
    return json.dumps(so.to_dict(), separators=(",", ":"), ensure_ascii=False)
