"""SpeculativeConfig: what `speculative_config={...}` (EngineArgs / LLM) and `--speculative-config JSON` say.

    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                   "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    LLM(model, speculative_config={"method": "mtp", "num_speculative_tokens": 2, "rollback": "multi_slot"})
    k3serve serve --speculative-config '{"method": "mtp", "num_speculative_tokens": 2}'

Keys (vLLM's spelling): `method` "mtp" (the checkpoint's MTP layers, workers/engine/spec/mtp_proposer.py)
or "ngram" (prompt lookup, workers/model/ngram_proposer.py); `num_speculative_tokens` k >= 1;
`prompt_lookup_min` / `prompt_lookup_max` (ngram only; defaults 1 and 4); `rollback` "multi_slot"
(default) or "recover_ssm" (workers/engine/spec/rollback.py). Anything else is an error. The check that
needs the model (mtp on a checkpoint without MTP layers) is `check_model`, run by the engine.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

METHODS = ("mtp", "ngram")
ROLLBACKS = ("multi_slot", "recover_ssm")
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "rollback")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    rollback: str = "multi_slot"

    def as_dict(self) -> dict:
        d = asdict(self)
        if self.method != "ngram":  # the lookup bounds are ngram's (given for another method: an error)
            del d["prompt_lookup_min"], d["prompt_lookup_max"]
        return d

    def check_model(self, cfg) -> None:
        if self.method == "mtp" and int(getattr(cfg, "num_nextn_predict_layers", 0) or 0) < 1:
            raise ValueError("speculative_config: method 'mtp' needs a checkpoint with an MTP layer "
                             "(num_nextn_predict_layers = 0 in this model's config); use method 'ngram'")


def _int(d: dict, key: str, default: int | None = None) -> int:
    v = d.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"speculative_config: {key} must be an integer >= 1, got {v!r}")
    return v


def speculative_config_from(value) -> SpeculativeConfig | None:
    """A SpeculativeConfig from a dict, a JSON string, a SpeculativeConfig or None (no speculation)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config: expected a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(_KEYS)})")
    method = value.get("method")
    if method not in METHODS:
        raise ValueError(f"speculative_config: unknown method {method!r} (use mtp or ngram)")
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config: num_speculative_tokens is required")
    k = _int(value, "num_speculative_tokens")
    lo = _int(value, "prompt_lookup_min", 1)
    hi = _int(value, "prompt_lookup_max", max(4, lo))
    if lo > hi:
        raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
    if method != "ngram" and ("prompt_lookup_min" in value or "prompt_lookup_max" in value):
        raise ValueError("speculative_config: prompt_lookup_min / prompt_lookup_max apply to method 'ngram' only")
    rollback = value.get("rollback", "multi_slot")
    if rollback not in ROLLBACKS:
        raise ValueError(f"speculative_config: unknown rollback {rollback!r} (use multi_slot or recover_ssm)")
    return SpeculativeConfig(method, k, lo, hi, rollback)


def parse_speculative_config(text: str) -> dict:
    """The CLI parser of `--speculative-config JSON`: the checked dict (errors are ValueError)."""
    return speculative_config_from(text).as_dict()
