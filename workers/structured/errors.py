"""The one error type of structured outputs (a ValueError, so the front ends answer 400)."""

from __future__ import annotations

import re

_CPP_PREFIX = re.compile(r"^\[[\d:.]+\]\s+\S+\.(?:cc|h|cpp):\d+:\s*")


class StructuredOutputError(ValueError):
    """An invalid or unsupported structured-output request; the message is XGrammar's."""


def xgrammar_message(exc: BaseException) -> str:
    """XGrammar's error text without its C++ source-location prefix ("[15:28:50] /x/y.cc:94: ")."""
    lines = [_CPP_PREFIX.sub("", ln).strip() for ln in str(exc).strip().splitlines()]
    return " ".join(ln for ln in lines if ln) or type(exc).__name__
