"""Tiny builders for OpenAPI v3 (structural) schema nodes, as Kubernetes CRDs want them.

Every builder returns a plain dict; `description` is what `kubectl explain` prints, so it is the
user documentation of the field. Only the keywords the API server accepts in structural schemas are
used (type, description, default, enum, minimum, maximum, pattern, maxLength, items, properties,
required, additionalProperties, anyOf without types inside, x-kubernetes-*).
"""

from __future__ import annotations

from typing import Any

# The Kubernetes resource.Quantity grammar (as in apimachinery's quantity.go).
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)"
    r"|(\.[0-9]+))))?$"
)


def _put(node: dict, **kw: Any) -> dict:
    for key, value in kw.items():
        if value is not None:
            node[key] = value
    return node


def integer(
    description: str,
    *,
    default: int | None = None,
    minimum: int | None = None,
    maximum: int | None = None,
    enum: list[int] | None = None,
) -> dict:
    return _put(
        {"type": "integer", "description": description},
        default=default,
        minimum=minimum,
        maximum=maximum,
        enum=enum,
    )


def string(
    description: str,
    *,
    default: str | None = None,
    enum: list[str] | None = None,
    pattern: str | None = None,
    max_length: int | None = None,
    min_length: int | None = None,
) -> dict:
    return _put(
        {"type": "string", "description": description},
        default=default,
        enum=enum,
        pattern=pattern,
        maxLength=max_length,
        minLength=min_length,
    )


def boolean(description: str, *, default: bool | None = None) -> dict:
    return _put({"type": "boolean", "description": description}, default=default)


def obj(
    description: str,
    properties: dict[str, dict],
    *,
    required: list[str] | None = None,
    default: dict | None = None,
    validations: list[dict] | None = None,
) -> dict:
    node = {"type": "object", "description": description, "properties": properties}
    return _put(
        node,
        required=required or None,
        default=default,
        **({"x-kubernetes-validations": validations} if validations else {}),
    )


def array(
    description: str,
    items: dict,
    *,
    max_items: int | None = None,
    list_type: str | None = None,
    map_keys: list[str] | None = None,
) -> dict:
    node = _put({"type": "array", "description": description, "items": items}, maxItems=max_items)
    if list_type:
        node["x-kubernetes-list-type"] = list_type
    if map_keys:
        node["x-kubernetes-list-map-keys"] = map_keys
    return node


def string_map(description: str) -> dict:
    return {"type": "object", "description": description, "additionalProperties": {"type": "string"}}


def int_or_string(
    description: str,
    *,
    default: int | str | None = None,
    pattern: str | None = None,
    minimum: int | None = None,
) -> dict:
    """An int-or-string node. Value checks sit beside the canonical anyOf, as controller-gen writes
    them: `pattern` applies to strings only and `minimum` to integers only."""
    node = {
        "description": description,
        "x-kubernetes-int-or-string": True,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
    }
    return _put(node, default=default, pattern=pattern, minimum=minimum)


def quantity(description: str, *, default: str | None = None) -> dict:
    return int_or_string(description, default=default, pattern=QUANTITY_PATTERN, minimum=0)


def resource_requirements(description: str) -> dict:
    amounts = {
        "type": "object",
        "description": "Resource name to quantity.",
        "additionalProperties": quantity("A quantity, e.g. 8, 500m, 64Gi."),
    }
    return obj(
        description,
        {
            "requests": dict(amounts, description="Minimum resources (resource name to quantity)."),
            "limits": dict(amounts, description="Maximum resources (resource name to quantity)."),
        },
    )


def tolerations(description: str) -> dict:
    return array(
        description,
        obj(
            "A Kubernetes toleration.",
            {
                "key": string("Taint key; empty with operator Exists matches every taint."),
                "operator": string("Exists or Equal (default Equal).", enum=["Exists", "Equal"]),
                "value": string("Taint value (operator Equal)."),
                "effect": string(
                    "Taint effect to match; empty matches all.",
                    enum=["NoSchedule", "PreferNoSchedule", "NoExecute"],
                ),
                "tolerationSeconds": integer("How long a NoExecute taint is tolerated.", minimum=0),
            },
        ),
    )


def env_list(description: str) -> dict:
    return array(
        description,
        obj(
            "One environment variable.",
            {
                "name": string("Variable name.", pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"),
                "value": string("Variable value."),
                "valueFrom": obj(
                    "The value from a key of a Secret in the deployment's namespace (credentials such as "
                    "HF_TOKEN stay out of the CR).",
                    {
                        "secretKeyRef": obj(
                            "Secret key.",
                            {
                                "name": string("Secret name.", pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
                                               max_length=253),
                                "key": string("Key inside the Secret.", pattern=r"^[-._a-zA-Z0-9]+$"),
                                "optional": boolean("Start without the variable when the key is missing."),
                            },
                            required=["name", "key"],
                        )
                    },
                    required=["secretKeyRef"],
                ),
            },
            required=["name"],
            validations=[{"rule": "!(has(self.value) && has(self.valueFrom))",
                          "message": "set value or valueFrom, not both"}],
        ),
        list_type="map",
        map_keys=["name"],
    )
