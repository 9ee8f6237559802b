"""K3 XTML vocabulary shared by the renderer and the output parsers.

An element is ``<|open|>NAME attr="v" ...<|sep|>BODY<|close|>NAME<|sep|>``; the three markers are
single special tokens. Attribute values escape ``&`` -> ``&amp;`` then ``"`` -> ``&quot;``; decoding
reverses this in the opposite order. Tool-call argument values are typed: ``string`` values are raw
text (no escaping); ``number`` (also JSON integers), ``boolean``, ``null``, ``object`` and ``array``
values are JSON text.
"""

from __future__ import annotations

import json
import re
from typing import Any

OPEN = "<|open|>"
CLOSE = "<|close|>"
SEP = "<|sep|>"
END_OF_MSG = "<|end_of_msg|>"
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
MARKERS = (OPEN, CLOSE, SEP, END_OF_MSG)

ARG_TYPES = ("string", "number", "boolean", "null", "object", "array")

_OPEN_HEADER_RE = re.compile(r'\s*([A-Za-z_][\w\-]*)((?:\s+[\w.\-]+="[^"]*")*)\s*', re.S)
_CLOSE_HEADER_RE = re.compile(r"\s*([A-Za-z_][\w\-]*)\s*")
_ATTR_RE = re.compile(r'([\w.\-]+)="([^"]*)"')


def escape_attr(value: Any) -> str:
    """Attribute value escaping: ``&`` first, then ``"``."""
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def unescape_attr(value: str) -> str:
    """Inverse of :func:`escape_attr` (``&quot;`` first, then ``&amp;``)."""
    return value.replace("&quot;", '"').replace("&amp;", "&")


def format_attrs(attrs: list[tuple[str, Any]]) -> list[str]:
    """Each attribute as its own text piece ``' key="escaped"'`` (the renderer encodes them one by one)."""
    return [f' {key}="{escape_attr(value)}"' for key, value in attrs]


def parse_open_header(header: str) -> tuple[str, dict[str, str]] | None:
    """``'call tool="f" index="1"'`` -> ``("call", {"tool": "f", "index": "1"})``; None if malformed."""
    m = _OPEN_HEADER_RE.fullmatch(header)
    if m is None:
        return None
    return m.group(1), {k: unescape_attr(v) for k, v in _ATTR_RE.findall(m.group(2))}


def parse_close_header(header: str) -> str | None:
    m = _CLOSE_HEADER_RE.fullmatch(header)
    return m.group(1) if m else None


def value_type(value: Any) -> str:
    """XTML argument type of a JSON value."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list | tuple):
        return "array"
    raise ValueError(f"tool call argument value of unsupported type {type(value).__name__}")


def render_value(value: Any) -> str:
    """Argument body text: strings raw, everything else JSON (non-ASCII kept)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def decode_value(raw: str, type_: str | None) -> Any:
    """Argument body -> JSON value: ``string`` (or no type) is raw text; other types are decoded as
    JSON, falling back to the raw text when it is not valid JSON."""
    if type_ is None or type_ == "string":
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw
