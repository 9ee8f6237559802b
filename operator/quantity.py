"""Kubernetes resource quantities (`64Gi`, `1.5G`, `500m`, 1024) to numbers."""

from __future__ import annotations

import re
from decimal import Decimal

_SUFFIX = {
    "": Decimal(1),
    "m": Decimal("0.001"),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}
_RE = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))((?:[KMGTPE]i)|[mkMGTPE]|[eE][+-]?[0-9]+)?$")


def parse(quantity: str | int | float) -> Decimal:
    """The value of a quantity; raises ValueError on anything Kubernetes would reject."""
    if isinstance(quantity, bool):
        raise ValueError(f"not a quantity: {quantity!r}")
    if isinstance(quantity, int | float):
        return Decimal(str(quantity))
    m = _RE.match(quantity.strip())
    if not m:
        raise ValueError(f"not a quantity: {quantity!r}")
    number, suffix = Decimal(m.group(1)), m.group(2) or ""
    if suffix[:1] in ("e", "E"):
        return number * (Decimal(10) ** int(suffix[1:]))
    return number * _SUFFIX[suffix]


def to_bytes(quantity: str | int | float) -> int:
    """Whole bytes of a memory quantity (rounded up, as the kubelet does)."""
    value = parse(quantity)
    whole = int(value)
    return whole + 1 if value > whole else whole
