"""The LeaderWorkerSet CRD's own schema (leaderworkerset.x-k8s.io/v1), for strict validation of the
LeaderWorkerSets the operator renders (operator/render_lws.py).

crds/leaderworkerset-v0.10.0.json is the `openAPIV3Schema` of the CRD that kubernetes-sigs/lws ships at
tag v0.10.0 (its "source" names the file, commit and the file's sha256), with the description strings
dropped and nothing else changed. Validation is strict as the API server's field validation is
(operator/validation.py `strict_schema`: unknown fields rejected); the LWS CRD has no CEL rules (its
admission webhook's checks are not reproduced here).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

CRD_FILE = Path(__file__).with_name("crds") / "leaderworkerset-v0.10.0.json"


@functools.cache
def crd() -> dict:
    return json.loads(CRD_FILE.read_text(encoding="utf-8"))


@functools.cache
def _validator():
    import jsonschema

    from k3serve.operator.validation import strict_schema

    return jsonschema.Draft7Validator(strict_schema(crd()["openAPIV3Schema"]))


def errors(obj: dict) -> list[str]:
    """Every reason the CRD's schema rejects `obj`, sorted, each naming the field path; [] when valid."""
    from k3serve.operator.validation import _message

    where = f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"
    return sorted(f"{where}: {_message(e)}" for e in _validator().iter_errors(obj))
