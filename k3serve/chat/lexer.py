"""Streaming XTML lexer over detokenized text (markers arrive as literal ``<|open|>`` etc.).

Splits text into :class:`XToken` s: ``text``, ``open`` (``<|open|>NAME attrs<|sep|>``), ``close``
(``<|close|>NAME<|sep|>``) and ``eom`` (``<|end_of_msg|>``). Whitespace around the name inside a marker
is tolerated. A marker that does not form a well-formed element (no ``<|sep|>`` before the next marker
or within :data:`MAX_HEADER` characters, a malformed header, a lone ``<|sep|>``) is literal text.

Split invariance: the token sequence (up to how text runs are split) depends only on the full text,
never on how it was chunked, because the lexer holds back (a) a suffix that could start a marker and
(b) an unfinished element header, and decides only when the text settles it or at :meth:`finish`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from k3serve.chat.xtml import (
    CLOSE,
    END_OF_MSG,
    MARKERS,
    OPEN,
    SEP,
    parse_close_header,
    parse_open_header,
)

MAX_HEADER = 1024
_MARKER_RE = re.compile("|".join(re.escape(m) for m in MARKERS))
_MAX_MARKER = max(len(m) for m in MARKERS)


@dataclass
class XToken:
    kind: str  # "text" | "open" | "close" | "eom"
    raw: str  # the exact source text of this token
    name: str | None = None
    attrs: dict[str, str] = field(default_factory=dict)


def _partial_marker_suffix(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker."""
    for k in range(min(len(text), _MAX_MARKER - 1), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in MARKERS):
            return k
    return 0


class XtmlLexer:
    def __init__(self) -> None:
        self._buf = ""

    def feed(self, text: str) -> list[XToken]:
        self._buf += text
        return self._scan(final=False)

    def finish(self) -> list[XToken]:
        return self._scan(final=True)

    def _scan(self, final: bool) -> list[XToken]:
        buf, pos, out = self._buf, 0, []

        def text(s: str) -> None:
            if s:
                out.append(XToken("text", s))

        while True:
            m = _MARKER_RE.search(buf, pos)
            if m is None:
                keep = 0 if final else _partial_marker_suffix(buf[pos:])
                text(buf[pos:len(buf) - keep])
                pos = len(buf) - keep
                break
            text(buf[pos:m.start()])
            marker = m.group()
            if marker == END_OF_MSG:
                out.append(XToken("eom", marker))
                pos = m.end()
                continue
            if marker == SEP:
                text(marker)
                pos = m.end()
                continue
            m2 = _MARKER_RE.search(buf, m.end())
            if m2 is None and not final and len(buf) - m.end() <= MAX_HEADER + _MAX_MARKER:
                pos = m.start()  # header not finished yet: hold from the marker
                break
            tok = None
            if m2 is not None and m2.group() == SEP and m2.start() - m.end() <= MAX_HEADER:
                header = buf[m.end():m2.start()]
                raw = buf[m.start():m2.end()]
                if marker == OPEN:
                    parsed = parse_open_header(header)
                    if parsed is not None:
                        tok = XToken("open", raw, parsed[0], parsed[1])
                elif marker == CLOSE:
                    name = parse_close_header(header)
                    if name is not None:
                        tok = XToken("close", raw, name)
            if tok is None:
                text(marker)
                pos = m.end()
            else:
                out.append(tok)
                pos = m2.end()
        self._buf = buf[pos:]
        return out
