"""Structural defaulting, as the Kubernetes API server does it for custom resources.

For every object node: a missing property whose schema has a `default` gets a deep copy of it, then
defaulting recurses into present object values and array items. The operator applies this to every
spec it reads, so it behaves the same against an API server that defaulted the object (idempotent)
and against one that did not (an old CRD, or a test emulator).
"""

from __future__ import annotations

import copy
from typing import Any


def apply_defaults(schema: dict, value: Any) -> Any:
    """Return a defaulted deep copy of `value` (the input is not modified)."""
    return _default(schema, copy.deepcopy(value))


def _default(schema: dict, value: Any) -> Any:
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for key, sub in props.items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
        for key, item in value.items():
            if key in props:
                value[key] = _default(props[key], item)
            elif isinstance(schema.get("additionalProperties"), dict):
                value[key] = _default(schema["additionalProperties"], item)
        return value
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_default(schema["items"], item) for item in value]
    return value
