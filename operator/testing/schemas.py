"""Hand-written JSON schemas for the third-party custom resources the operator or chart renders.

No Python package carries the Prometheus-operator (monitoring.coreos.com/v1) CRDs, so these cover the
fields k3serve uses, written from the project's public API reference, strict (unknown fields rejected).
(LeaderWorkerSets are validated against the LWS project's own CRD schema: lws_schema.py.)
"""

from __future__ import annotations

_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": _LABELS,
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
        "namespace": {"type": "string"},
    },
}
_NAMESPACE_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}},
}


def _resource(api_version: str, kind: str, spec: dict) -> dict:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
            "status": {"type": "object"},
        },
    }


POD_MONITOR = _resource(
    "monitoring.coreos.com/v1",
    "PodMonitor",
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["selector"],
        "properties": {
            "selector": _LABEL_SELECTOR,
            "namespaceSelector": _NAMESPACE_SELECTOR,
            "jobLabel": {"type": "string"},
            "podTargetLabels": {"type": "array", "items": {"type": "string"}},
            "podMetricsEndpoints": {
                "type": "array",
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string"},
                        "path": {"type": "string", "pattern": "^/"},
                        "interval": _DURATION,
                        "scheme": {"enum": ["http", "https"]},
                    },
                },
            },
        },
    },
)

SERVICE_MONITOR = _resource(
    "monitoring.coreos.com/v1",
    "ServiceMonitor",
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["selector"],
        "properties": {
            "selector": _LABEL_SELECTOR,
            "namespaceSelector": _NAMESPACE_SELECTOR,
            "jobLabel": {"type": "string"},
            "endpoints": {
                "type": "array",
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string"},
                        "path": {"type": "string", "pattern": "^/"},
                        "interval": _DURATION,
                        "scheme": {"enum": ["http", "https"]},
                    },
                },
            },
        },
    },
)

BY_KIND = {"PodMonitor": POD_MONITOR, "ServiceMonitor": SERVICE_MONITOR}
