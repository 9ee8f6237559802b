"""The compatibility hash of a P/D pair: the invariants both sides must share, checked before any byte moves.

Factors (design doc §5.3): the model fingerprint (config + weight bytes, k3serve/common/block_hash.py),
the cache dtypes, the layer layout (cache groups: kind and layer ids), the KDA state layout (heads,
head dim, conv kernel, DS conv layout, recurrent state [v][k] order), the MLA latent width, and the
connector version. Per-rank sizes (TP, block size, page bytes) are not hashed: they are checked at run
time by k3serve/common/pd_geometry.py, which maps the layouts it can.
"""

from __future__ import annotations

import hashlib
import json

CONNECTOR_VERSION = "k3serve-nixl/1"


class IncompatiblePeer(ValueError):
    """The two sides' invariants differ (the message names which)."""


def compatibility_factors(layout, model_fingerprint: bytes, tp_size: int = 1) -> dict:
    h, d, _ = layout.ssm_shape
    return {
        "connector_version": CONNECTOR_VERSION,
        "model_fingerprint": model_fingerprint.hex(),
        "mla_dtype": str(layout.mla_dtype).removeprefix("torch."),
        "conv_dtype": str(layout.conv_dtype).removeprefix("torch."),
        "ssm_dtype": str(layout.ssm_dtype).removeprefix("torch."),
        "groups": [[g.kind, list(g.layer_ids)] for g in layout.groups],
        "kda_heads": h * tp_size,
        "kda_head_dim": d,
        "conv_width": layout.conv_width,
        "state_layout": "conv[3P,K-1] DS (q|k|v) + ssm[h,v,k]",
        "mla_token_elems": layout.mla_token_elems,
    }


def canonical(factors: dict) -> str:
    return json.dumps(factors, sort_keys=True, separators=(",", ":"))


def compatibility_hash(factors: dict) -> bytes:
    return hashlib.sha256(b"k3serve/pd-compat/v1\0" + canonical(factors).encode()).digest()


def describe_mismatch(mine: dict, theirs: dict | None) -> str:
    """One line naming the factors that differ (theirs may be unknown: only the hash was seen)."""
    if not theirs:
        return "the peer's compatibility hash differs from ours (different model, dtype or cache layout)"
    diffs = []
    for k in sorted(set(mine) | set(theirs)):
        a, b = mine.get(k), theirs.get(k)
        if a != b:
            if k == "model_fingerprint" and a and b:
                a, b = a[:12] + "…", b[:12] + "…"
            diffs.append(f"{k}: ours {a}, peer {b}")
    return "incompatible P/D peer: " + ("; ".join(diffs) if diffs else "hash differs")


def check_compatible(mine: dict, their_hash: bytes, their_factors: dict | None = None) -> None:
    if bytes(their_hash) != compatibility_hash(mine):
        raise IncompatiblePeer(describe_mismatch(mine, their_factors))
