"""Byte sizes on the command line: the one parser behind every size flag (`--kv-cache-memory`, ...).

    parse_size("8G") == parse_size("8GiB") == parse_size("8Gi") == 8 << 30
    parse_size("512M") == 512 << 20;  parse_size("1.5K") == 1536;  parse_size("4096") == 4096
    parse_size("8GB") == 8 * 10**9     # the SI spellings (KB, MB, GB, TB) are decimal

K, M, G, T (alone, with `i`, or with `iB`) are binary, as in the engine's and vLLM's flags; a trailing
`B` alone means bytes. Case does not matter. The result is a whole, positive number of bytes;
anything else raises ValueError with a message naming the accepted forms. (The operator's CR fields
are Kubernetes quantities, parsed by operator/quantity.py, and rendered to plain bytes.)
"""

from __future__ import annotations

import re

_BINARY = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?:([kmgt])(i?b?)?|(b))?\s*$", re.IGNORECASE)
FORMS = "bytes, or a size such as 512M, 8G, 8GiB (binary) or 8GB (decimal)"


def parse_size(text: str | int) -> int:
    """Bytes in `text` (see the module docstring); ValueError if it is not a positive size."""
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r} ({FORMS})")
    if isinstance(text, int):
        value = text
    else:
        m = _RE.match(str(text))
        if not m:
            raise ValueError(f"not a size: {text!r} ({FORMS})")
        number, prefix, tail = m.group(1), (m.group(2) or "").lower(), (m.group(3) or "").lower()
        if prefix:
            mult = _DECIMAL[prefix] if tail == "b" else _BINARY[prefix]
        else:
            mult = 1
        whole, _, frac = number.partition(".")
        # exact arithmetic: "1.5G" is 1610612736, never a float rounding of it
        num, den = int(whole or "0") * 10 ** len(frac) + int(frac or "0"), 10 ** len(frac)
        if (num * mult) % den:
            raise ValueError(f"not a whole number of bytes: {text!r}")
        value = num * mult // den
    if value <= 0:
        raise ValueError(f"a size must be positive, got {text!r}")
    return value


def format_size(n: int) -> str:
    """The shortest exact binary spelling of `n` bytes (`8GiB`, `1536B`), for messages."""
    for suffix, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{suffix}"
    return f"{n}B"
