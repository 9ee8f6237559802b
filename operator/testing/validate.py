"""Strict validation of any object the operator or chart produces.

Built-in kinds (and the CRD object itself) go to kubernetes-validate in strict mode; a
KimiK3Deployment goes to its own CRD schema; a LeaderWorkerSet to the LWS project's CRD schema
(`lws_schema.py`) and its pod templates to kubernetes-validate as core PodTemplates; PodMonitor /
ServiceMonitor to the hand-written schemas in `schemas.py`.
"""

from __future__ import annotations

KUBERNETES_VERSION = "1.33"


def _kv_errors(obj: dict, version: str) -> list[str]:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = ".".join(str(p) for p in e.absolute_path)
        return [f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}: {where}: {e.message}"]
    return []


def _schema_errors(obj: dict, schema: dict) -> list[str]:
    import jsonschema

    validator = jsonschema.Draft7Validator(schema)
    return [
        f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}: "
        f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
        for e in validator.iter_errors(obj)
    ]


def errors(obj: dict, version: str = KUBERNETES_VERSION) -> list[str]:
    """Every reason the object would be rejected; [] when valid."""
    from k3serve.operator import crd, validation
    from k3serve.operator.testing import lws_schema, schemas

    kind = obj.get("kind")
    if kind == crd.KIND:
        return validation.errors(obj)
    if kind == "LeaderWorkerSet":  # the CRD's own schema (lws_schema.py), then each pod template as a core one
        out = lws_schema.errors(obj)
        if not out:
            lwt = obj["spec"]["leaderWorkerTemplate"]
            for part in ("leaderTemplate", "workerTemplate"):
                if part in lwt:
                    out += _kv_errors(
                        {
                            "apiVersion": "v1",
                            "kind": "PodTemplate",
                            "metadata": {
                                "name": f"{obj['metadata']['name']}-{part.lower()}",
                                "namespace": obj["metadata"].get("namespace", "default"),
                            },
                            "template": lwt[part],
                        },
                        version,
                    )
        return out
    if kind in schemas.BY_KIND:
        return _schema_errors(obj, schemas.BY_KIND[kind])
    return _kv_errors(obj, version)
