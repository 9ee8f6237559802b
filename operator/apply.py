"""Idempotent apply of rendered objects, and pruning of children no longer rendered.

Client-side three-way apply with JSON merge patches (RFC 7396), which every API server and the test
emulator implement the same way (server-side apply is not emulated): each applied object records the
hash of what was applied (`k3serve.io/applied-hash`) and the applied document itself
(`k3serve.io/last-applied`). An unchanged hash means no write at all; otherwise the patch sets every
field whose live value differs from the desired one and removes (null) the fields that the last
applied document had and the desired one no longer has. Fields others added are left alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from k3serve.operator import names as n
from k3serve.operator.kube import BY_KIND, KubeClient, KubeError, Resource
from k3serve.operator.render_context import canonical_json, config_hash

_MISSING = object()


def merge_patch(live: dict, desired: dict, last: dict | None) -> dict:
    """A JSON merge patch turning `live` into something that contains `desired`, deleting what `last`
    (the previously applied document) had and `desired` dropped."""
    last = last if isinstance(last, dict) else {}
    patch: dict = {}
    for key, want in desired.items():
        have = live.get(key, _MISSING)
        if isinstance(want, dict) and isinstance(have, dict):
            sub = merge_patch(have, want, last.get(key) if isinstance(last.get(key), dict) else None)
            if sub:
                patch[key] = sub
        elif have != want:
            patch[key] = want
    for key in last:
        if key not in desired and key in live:
            patch[key] = None
    return patch


def stamp(obj: dict) -> dict:
    """`obj` with the applied-hash and last-applied annotations (computed without them)."""
    bare = json.loads(canonical_json(obj))
    annotations = bare["metadata"].get("annotations") or {}
    annotations.pop(n.ANN_APPLIED_HASH, None)
    annotations.pop(n.ANN_LAST_APPLIED, None)
    if annotations:
        bare["metadata"]["annotations"] = annotations
    else:
        bare["metadata"].pop("annotations", None)
    text = canonical_json(bare)
    out = json.loads(text)
    out["metadata"].setdefault("annotations", {}).update(
        {n.ANN_APPLIED_HASH: config_hash(bare), n.ANN_LAST_APPLIED: text}
    )
    return out


@dataclass
class ApplyReport:
    created: list[str] = field(default_factory=list)
    patched: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)

    def summary(self) -> str:
        parts = [
            f"{len(v)} {k}"
            for k, v in (
                ("created", self.created),
                ("patched", self.patched),
                ("unchanged", self.unchanged),
                ("deleted", self.deleted),
            )
            if v
        ]
        return ", ".join(parts) or "nothing to do"


def ref(obj: dict) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


async def apply_one(client: KubeClient, obj: dict, report: ApplyReport) -> dict:
    desired = stamp(obj)
    meta = desired["metadata"]
    res = BY_KIND[desired["kind"]]
    live = await client.get(res, meta["namespace"], meta["name"])
    if live is None:
        report.created.append(ref(obj))
        return await client.create(desired)
    conflict = foreign(live, obj)
    if conflict:
        raise KubeError(409, "Conflict", f"{ref(obj)} already exists and {conflict}; rename or delete it")
    live_ann = (live.get("metadata") or {}).get("annotations") or {}
    if live_ann.get(n.ANN_APPLIED_HASH) == meta["annotations"][n.ANN_APPLIED_HASH]:
        report.unchanged.append(ref(obj))
        return live
    try:
        last = json.loads(live_ann.get(n.ANN_LAST_APPLIED, "{}"))
    except ValueError:
        last = {}
    patch = merge_patch(live, desired, last)
    report.patched.append(ref(obj))
    return await client.patch(res, meta["namespace"], meta["name"], patch)


def foreign(live: dict, desired: dict) -> str:
    """Why `live` must not be taken over by the deployment that renders `desired` ("" if it may):
    it is not labelled as managed for that deployment, or another object controls it. Unowned objects
    labelled for the deployment (left by an orphaning delete) are adopted."""
    labels = desired["metadata"]["labels"]
    if not labelled_for(live, labels[n.LABEL_DEPLOYMENT]):
        return "is not managed by this KimiK3Deployment"
    mine = {r["uid"] for r in desired["metadata"].get("ownerReferences") or []}
    for owner in (live.get("metadata") or {}).get("ownerReferences") or []:
        if owner.get("controller") and mine and owner.get("uid") not in mine:
            return f"is controlled by {owner.get('kind')}/{owner.get('name')}"
    return ""


def owned_by(obj: dict, uid: str) -> bool:
    return any(r.get("uid") == uid for r in (obj.get("metadata") or {}).get("ownerReferences") or [])


def labelled_for(obj: dict, name: str) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return labels.get(n.LABEL_DEPLOYMENT) == name and labels.get(n.LABEL_MANAGED_BY) == n.MANAGED_BY


async def list_children(
    client: KubeClient, resources: list[Resource], namespace: str, name: str
) -> list[dict]:
    """Objects in the namespace labelled as managed for deployment `name` (filtered client-side)."""
    out: list[dict] = []
    for res in resources:
        out += [o for o in await client.list(res, namespace) if labelled_for(o, name)]
    return out


async def prune(
    client: KubeClient,
    resources: list[Resource],
    namespace: str,
    name: str,
    uid: str,
    keep: set[tuple[str, str]],
    report: ApplyReport,
) -> None:
    """Delete children owned by `uid` that are no longer rendered ((kind, name) not in `keep`)."""
    for obj in await list_children(client, resources, namespace, name):
        key = (obj["kind"], obj["metadata"]["name"])
        if key not in keep and owned_by(obj, uid):
            if await client.delete(BY_KIND[obj["kind"]], namespace, obj["metadata"]["name"]):
                report.deleted.append(ref(obj))
