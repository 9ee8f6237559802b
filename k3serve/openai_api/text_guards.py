"""Guards on request text before and around tokenization, shared by `k3serve serve` and the gateway.

A 400 naming the parameter instead of a tokenizer crash: overlong whitespace runs are refused before
tokenizing, and a panic inside the native tokenizer (a pyo3 PanicException, a BaseException) becomes
a ProtocolError.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable

from k3serve.openai_api import protocol as P

log = logging.getLogger(__name__)
_NOT_CAUGHT = (asyncio.CancelledError, KeyboardInterrupt, SystemExit, GeneratorExit)
# tiktoken's regex gives up (a Rust panic) on whitespace runs of about a million characters; longer runs
# than this are refused before any tokenizer sees them (no legitimate prompt holds one)
MAX_WHITESPACE_RUN = 200_000
_WHITESPACE = re.compile(r"\s+")  # maximal runs: one linear scan (a bounded repeat would be quadratic)


def _strings(obj):
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _strings(v)


def check_whitespace_runs(obj, param: str) -> None:
    """400 naming `param` if any string in `obj` has a whitespace run longer than MAX_WHITESPACE_RUN."""
    for text in _strings(obj):
        if len(text) > MAX_WHITESPACE_RUN and any(m.end() - m.start() > MAX_WHITESPACE_RUN
                                                  for m in _WHITESPACE.finditer(text)):
            raise P.ProtocolError(f"{param}: a run of more than {MAX_WHITESPACE_RUN} whitespace characters is not "
                                  "accepted; shorten or break it up", param=param)


def tokenize_guarded(fn: Callable, param: str | None):
    """`fn()` (a tokenizer call); a failure inside the native tokenizer (tiktoken's regex gives up on
    ~1M-character whitespace runs with a Rust panic, a BaseException) becomes a 400 naming `param`."""
    try:
        return fn()
    except _NOT_CAUGHT:
        raise
    except P.ProtocolError:
        raise
    except ValueError as e:
        raise P.ProtocolError(str(e), param=param) from None
    except BaseException as e:  # noqa: BLE001 - pyo3's PanicException derives from BaseException
        log.info("tokenizer failed on %s: %s: %s", param, type(e).__name__, str(e)[:200])
        raise P.ProtocolError(f"{param or 'input'}: the tokenizer cannot split this text (a very long run of "
                              "one kind of character, such as whitespace); shorten or break it up",
                              param=param) from None
