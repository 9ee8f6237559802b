"""Validate a KimiK3Deployment against the CRD's own openAPIV3Schema with a JSON-schema validator.

`strict_schema` mirrors the API server's strict field validation (kubectl's default): an object
node that lists `properties` rejects unknown fields. Messages name the field path, e.g.
`spec.router.policy: 'fastest' is not one of ['hybrid-prefix', ...]`.
"""

from __future__ import annotations

import copy
from typing import Any

from k3serve.operator import crd


def strict_schema(schema: dict) -> dict:
    out = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(out)
    # metadata is validated by the API server itself, not by the CRD schema.
    out["properties"]["metadata"] = {"type": "object"}
    return out


def _path(parts) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "<root>"


def _message(error) -> str:
    where = _path(error.absolute_path)
    if error.validator == "additionalProperties":
        extra = sorted(set(error.instance) - set(error.schema.get("properties", {})))
        return f"{where}: unknown field(s) {', '.join(repr(e) for e in extra)}"
    if error.validator == "required":
        return f"{where}: {error.message.replace(' is a required property', '')} is required"
    return f"{where}: {error.message}"


def errors(cr: dict) -> list[str]:
    """Every schema violation of the custom resource, sorted; [] when valid."""
    import jsonschema

    validator = jsonschema.Draft7Validator(strict_schema(crd.openapi_schema()))
    return sorted(_message(e) for e in validator.iter_errors(cr))


def pd_geometry_problems(spec: dict) -> list[str]:
    """P/D pool geometry the NIXL connector cannot map (k3serve/common/pd_geometry.py, the same function
    the workers run at transfer time): [] in colocated mode or when every decode rank can be fed."""
    from k3serve.common.pd_geometry import pd_geometry_problem

    if int((spec.get("prefill") or {}).get("replicas", 0)) == 0:
        return []
    block = (spec.get("cache") or {}).get("blockSize")  # one block size for both pools: ratio 1
    problem = pd_geometry_problem(
        int(spec["prefill"]["tensorParallelSize"]), int(spec["decode"]["tensorParallelSize"]),
        int(spec["model"]["architecture"]["kdaHeads"]), block, block)
    return [f"spec.prefill/spec.decode: {problem}"] if problem else []
