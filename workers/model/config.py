"""K3Config: the text-model configuration of Kimi K3 (`model_type: kimi_k3`) and Kimi-Linear (`kimi_linear`).

`K3Config.from_dict(d)` accepts a whole `config.json`:

* `kimi_k3`: a wrapper whose `text_config` (model_type `kimi_linear`) holds the text model; a
  `quantization_config` may sit at the top level or inside `text_config`.
* `kimi_linear` in either spelling: the hub's (`linear_attn_config` with 1-based `kda_layers` /
  `full_attn_layers`, `first_k_dense_replace`, `moe_layer_freq`, ...) or the one Hugging Face
  transformers writes (`layer_types`, `mlp_layer_types`, `linear_num_heads`, `linear_head_dim`,
  `linear_conv_kernel_dim`, `num_experts`, `num_experts_per_token`, `num_expert_group`, ...).
  Old aliases (`num_local_experts`, `num_experts_per_tok`, `n_group`, `norm_topk_prob`,
  `n_shared_experts`, `n_routed_experts`, `model_max_length`) are read too; two spellings of one field
  that disagree are an error.

Every invalid, unknown or inconsistent value raises `ConfigError`, whose message names the field and
the rule. Unknown *keys* are ignored (real configs carry many keys the text model does not use).

Layer indices in the public API are 0-based; `kda_layers` / `full_attn_layers` on disk are 1-based.
A transformers-written config (detected by its `layer_types` key) defaults `mla_use_nope` to true,
because transformers' KimiLinear implements MLA without rotary embeddings.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

K3_ARCHITECTURE = "KimiK3ForConditionalGeneration"
KIMI_LINEAR_ARCHITECTURE = "KimiLinearForCausalLM"
MXFP4_FORMAT = "mxfp4-pack-quantized"

_REQUIRED = object()


class ConfigError(ValueError):
    """An invalid config value. `field` is the (dotted) field name, `rule` the violated rule."""

    def __init__(self, field_name: str, rule: str, value: Any = _REQUIRED):
        self.field = field_name
        self.rule = rule
        got = "" if value is _REQUIRED else f" (got {value!r})"
        super().__init__(f"config field `{field_name}`: {rule}{got}")


# --------------------------------------------------------------------------------------------------
# Small typed readers. Each takes the dict, the list of accepted spellings (first = canonical) and a
# default; reading two spellings that disagree is an error.


def _lookup(d: dict, names: list[str], default: Any, prefix: str = "") -> tuple[Any, str]:
    found = [(n, d[n]) for n in names if n in d]
    if not found:
        if default is _REQUIRED:
            raise ConfigError(prefix + names[0], "is required")
        return default, prefix + names[0]
    name0, v0 = found[0]
    for name, v in found[1:]:
        if v != v0:
            raise ConfigError(prefix + name, f"must equal `{prefix + name0}` ({v0!r}) when both are given", v)
    return v0, prefix + name0


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(d, names, default=_REQUIRED, *, minimum: int | None = None, optional=False, prefix=""):
    v, name = _lookup(d, names, default, prefix)
    if v is None and optional:
        return None
    if not _is_int(v):
        raise ConfigError(name, "must be an integer" + (" or null" if optional else ""), v)
    if minimum is not None and v < minimum:
        raise ConfigError(name, f"must be >= {minimum}", v)
    return v


def _float(d, names, default=_REQUIRED, *, optional=False, prefix=""):
    v, name = _lookup(d, names, default, prefix)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(name, "must be a finite number" + (" or null" if optional else ""), v)
    return float(v)


def _bool(d, names, default=_REQUIRED, *, prefix=""):
    v, name = _lookup(d, names, default, prefix)
    if not isinstance(v, bool):
        raise ConfigError(name, "must be true or false", v)
    return v


def _choice(d, names, choices: tuple[str, ...], default=_REQUIRED, *, prefix=""):
    v, name = _lookup(d, names, default, prefix)
    if v not in choices:
        raise ConfigError(name, f"must be one of {list(choices)}", v)
    return v


def _layer_list(v: Any, name: str, num_layers: int) -> list[int]:
    """A list of 1-based layer numbers -> sorted 0-based indices."""
    if not isinstance(v, list) or not all(_is_int(x) for x in v):
        raise ConfigError(name, "must be a list of 1-based layer numbers (integers)", v)
    bad = [x for x in v if not 1 <= x <= num_layers]
    if bad:
        raise ConfigError(name, f"layer numbers are 1-based and must lie in [1, num_hidden_layers={num_layers}]", bad)
    if len(set(v)) != len(v):
        raise ConfigError(name, "must not repeat a layer number", v)
    return sorted(x - 1 for x in v)


# --------------------------------------------------------------------------------------------------


@dataclass
class K3Config:
    """The text-model configuration (plain attributes; see the module docstring for parsing rules)."""

    model_type: str  # "kimi_k3" | "kimi_linear"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    # layer pattern (0-based)
    kda_layer_ids: list[int] = field(default_factory=list)
    mla_layer_ids: list[int] = field(default_factory=list)
    # KDA
    kda_num_heads: int = 0
    kda_head_dim: int = 0
    conv_kernel_size: int = 4
    gate_lower_bound: float | None = None
    use_full_rank_gate: bool = False
    # MLA
    num_attention_heads: int = 0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mla_use_nope: bool = False
    mla_use_output_gate: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    # Block Attention Residuals
    attn_res_block_size: int | None = None
    # MLP / MoE
    intermediate_size: int = 0
    hidden_act: str = "silu"  # "silu" | "situ"
    situ_beta: float | None = None
    situ_linear_beta: float | None = None
    num_experts: int | None = None
    num_experts_per_token: int = 0
    num_expert_group: int = 1
    topk_group: int = 1
    use_grouped_topk: bool = True
    topk_method: str = "noaux_tc"
    router_activation: str = "sigmoid"  # "sigmoid" | "softmax" (hub key moe_router_activation_func)
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    routed_expert_hidden_size: int | None = None
    latent_moe_use_norm: bool = False
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    experts_mxfp4: bool = False
    quantization_config: dict | None = None
    num_nextn_predict_layers: int = 0
    # kimi_k3 wrapper keys other than text_config/model_type/architectures/quantization_config
    wrapper_extra: dict = field(default_factory=dict)

    # ---------------------------------------------------------------- derived values
    def is_kda_layer(self, i: int) -> bool:
        """True iff 0-based layer i is KDA (MTP layers, i >= num_hidden_layers, are never KDA)."""
        return i in self._kda_set

    def is_moe_layer(self, i: int) -> bool:
        """True iff 0-based layer i uses the MoE block (else a dense MLP with intermediate_size)."""
        return self.num_experts is not None and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @property
    def _kda_set(self) -> frozenset[int]:
        return frozenset(self.kda_layer_ids)

    @property
    def num_attn_res_blocks(self) -> int:
        """NB = ceil(L / attn_res_block_size); 0 when AttnRes is off."""
        if self.attn_res_block_size is None:
            return 0
        return -(-self.num_hidden_layers // self.attn_res_block_size)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_proj_dim(self) -> int:
        """P = kda_num_heads * kda_head_dim."""
        return self.kda_num_heads * self.kda_head_dim

    @property
    def expert_hidden_size(self) -> int:
        """Din = Dout of the routed experts: the latent width under LatentMoE, else hidden_size."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def eos_token_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else ([e] if isinstance(e, int) else list(e))

    # ---------------------------------------------------------------- parsing
    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> K3Config:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, d: dict) -> K3Config:
        if not isinstance(d, dict):
            raise ConfigError("<root>", "the config must be a JSON object", type(d).__name__)
        mt = d.get("model_type")
        if mt == "kimi_k3":
            text = d.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError("text_config", "a kimi_k3 config needs a text_config object", text)
            if text.get("model_type", "kimi_linear") != "kimi_linear":
                raise ConfigError("text_config.model_type", "must be 'kimi_linear'", text.get("model_type"))
            qc_top, qc_text = d.get("quantization_config"), text.get("quantization_config")
            if qc_top is not None and qc_text is not None and qc_top != qc_text:
                raise ConfigError("quantization_config", "must equal text_config.quantization_config when both are given")
            extra = {
                k: copy.deepcopy(v)
                for k, v in d.items()
                if k not in ("text_config", "model_type", "architectures", "quantization_config")
            }
            return _parse_text(text, "kimi_k3", qc_text if qc_text is not None else qc_top, "text_config.", extra)
        if mt == "kimi_linear":
            return _parse_text(d, "kimi_linear", d.get("quantization_config"), "", {})
        raise ConfigError("model_type", "must be 'kimi_k3' or 'kimi_linear'", mt)

    # ---------------------------------------------------------------- serialization
    def text_config_dict(self) -> dict:
        """The text config in the hub spelling (what make-model writes; from_dict reads it back)."""
        t: dict[str, Any] = {
            "model_type": "kimi_linear",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "hidden_act": self.hidden_act,
            "activation_situ_beta": self.situ_beta,
            "activation_situ_linear_beta": self.situ_linear_beta,
            "intermediate_size": self.intermediate_size,
            "linear_attn_config": {
                "kda_layers": [i + 1 for i in self.kda_layer_ids],
                "full_attn_layers": [i + 1 for i in self.mla_layer_ids],
                "num_heads": self.kda_num_heads,
                "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.conv_kernel_size,
                "gate_lower_bound": self.gate_lower_bound,
                "use_full_rank_gate": self.use_full_rank_gate,
            },
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": self.mla_use_nope,
            "mla_use_output_gate": self.mla_use_output_gate,
            "rope_theta": self.rope_theta,
            "rope_scaling": copy.deepcopy(self.rope_scaling),
            "attn_res_block_size": self.attn_res_block_size,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "num_expert_group": self.num_expert_group,
            "topk_group": self.topk_group,
            "use_grouped_topk": self.use_grouped_topk,
            "topk_method": self.topk_method,
            "moe_router_activation_func": self.router_activation,
            "moe_renormalize": self.moe_renormalize,
            "routed_scaling_factor": self.routed_scaling_factor,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_shared_experts": self.num_shared_experts,
            "routed_expert_hidden_size": self.routed_expert_hidden_size,
            "latent_moe_use_norm": self.latent_moe_use_norm,
            "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": self.moe_layer_freq,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
        }
        if self.torch_dtype is not None:
            t["torch_dtype"] = self.torch_dtype
        if self.quantization_config is not None:
            t["quantization_config"] = copy.deepcopy(self.quantization_config)
        return t

    def to_dict(self) -> dict:
        """The whole config.json: a kimi_k3 wrapper around the text config, or a flat kimi_linear one."""
        text = self.text_config_dict()
        if self.model_type == "kimi_linear":
            return {"architectures": [KIMI_LINEAR_ARCHITECTURE], **text}
        out: dict[str, Any] = {"architectures": [K3_ARCHITECTURE], "model_type": "kimi_k3"}
        out.update(copy.deepcopy(self.wrapper_extra))
        out["text_config"] = text
        if self.quantization_config is not None:
            out["quantization_config"] = copy.deepcopy(self.quantization_config)
        return out

    def replace(self, **changes: Any) -> K3Config:
        """A validated copy with some fields changed (goes through to_dict/from_dict)."""
        names = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ConfigError(unknown[0], "is not a K3Config field")
        cur = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)}
        cur.update(changes)
        return K3Config.from_dict(K3Config(**cur).to_dict())


# --------------------------------------------------------------------------------------------------


def _parse_text(t: dict, model_type: str, qc: Any, p: str, wrapper_extra: dict) -> K3Config:  # noqa: C901
    """Parse and validate one text config `t`; `p` is the prefix used in error messages."""
    hf_spelling = "layer_types" in t
    L = _int(t, ["num_hidden_layers"], minimum=1, prefix=p)
    c: dict[str, Any] = {"model_type": model_type, "num_hidden_layers": L, "wrapper_extra": wrapper_extra}
    c["vocab_size"] = _int(t, ["vocab_size"], minimum=1, prefix=p)
    H = c["hidden_size"] = _int(t, ["hidden_size"], minimum=1, prefix=p)
    c["rms_norm_eps"] = _float(t, ["rms_norm_eps"], 1e-6, prefix=p)
    if c["rms_norm_eps"] <= 0:
        raise ConfigError(p + "rms_norm_eps", "must be > 0", c["rms_norm_eps"])
    c["tie_word_embeddings"] = _bool(t, ["tie_word_embeddings"], False, prefix=p)
    c["max_position_embeddings"] = _int(
        t, ["max_position_embeddings", "model_max_length"], 4096, minimum=1, prefix=p
    )
    for k in ("bos_token_id", "pad_token_id"):
        c[k] = _int(t, [k], None, optional=True, prefix=p)
    eos = t.get("eos_token_id")
    if eos is not None and not _is_int(eos) and not (isinstance(eos, list) and all(_is_int(x) for x in eos)):
        raise ConfigError(p + "eos_token_id", "must be an integer, a list of integers or null", eos)
    c["eos_token_id"] = eos
    dt = t.get("torch_dtype", t.get("dtype"))
    c["torch_dtype"] = dt if isinstance(dt, str) else None

    # ---- layer pattern
    lac = t.get("linear_attn_config")
    if lac is not None and not isinstance(lac, dict):
        raise ConfigError(p + "linear_attn_config", "must be an object or null", lac)
    kda_ids: list[int] | None = None
    if lac is not None:
        lp = p + "linear_attn_config."
        for k in ("kda_layers", "full_attn_layers"):
            if lac.get(k) is None:
                raise ConfigError(lp + k, "is required inside linear_attn_config")
        kda_ids = _layer_list(lac["kda_layers"], lp + "kda_layers", L)
        full_ids = _layer_list(lac["full_attn_layers"], lp + "full_attn_layers", L)
        both = sorted(set(kda_ids) & set(full_ids))
        if both:
            raise ConfigError(lp + "full_attn_layers", "must not share a layer with kda_layers", [i + 1 for i in both])
        missing = sorted(set(range(L)) - set(kda_ids) - set(full_ids))
        if missing:
            raise ConfigError(
                lp + "kda_layers",
                "kda_layers and full_attn_layers together must list every layer 1..num_hidden_layers",
                {"missing": [i + 1 for i in missing]},
            )
    lt = t.get("layer_types")
    if lt is not None:
        ok = {"linear_attention", "full_attention"}
        if not isinstance(lt, list) or len(lt) != L or any(x not in ok for x in lt):
            raise ConfigError(
                p + "layer_types", f"must be a list of num_hidden_layers={L} entries from {sorted(ok)}", lt
            )
        lt_ids = [i for i, x in enumerate(lt) if x == "linear_attention"]
        if kda_ids is not None and lt_ids != kda_ids:
            raise ConfigError(p + "layer_types", "disagrees with linear_attn_config.kda_layers", lt)
        kda_ids = lt_ids
    kda_ids = kda_ids or []
    c["kda_layer_ids"] = kda_ids
    c["mla_layer_ids"] = [i for i in range(L) if i not in set(kda_ids)]

    # ---- KDA
    lac = lac or {}
    lp = p + "linear_attn_config."
    pairs = [("num_heads", "linear_num_heads"), ("head_dim", "linear_head_dim"),
             ("short_conv_kernel_size", "linear_conv_kernel_dim")]
    kda_vals: dict[str, Any] = {}
    for hub, hf in pairs:
        a, b = lac.get(hub), t.get(hf)
        if a is not None and b is not None and a != b:
            raise ConfigError(p + hf, f"must equal linear_attn_config.{hub} ({a!r}) when both are given", b)
        kda_vals[hub] = a if a is not None else b
    if kda_ids:
        for hub, hf in pairs:
            v = kda_vals[hub]
            name = lp + hub if hub in lac else p + hf
            if v is None:
                raise ConfigError(lp + hub, "is required when there are KDA layers")
            if not _is_int(v) or v < 1:
                raise ConfigError(name, "must be a positive integer", v)
        c["kda_num_heads"] = kda_vals["num_heads"]
        c["kda_head_dim"] = kda_vals["head_dim"]
        c["conv_kernel_size"] = kda_vals["short_conv_kernel_size"]
        glb = _float(lac, ["gate_lower_bound"], None, optional=True, prefix=lp)
        if glb is not None and not -5.0 <= glb < 0.0:
            raise ConfigError(lp + "gate_lower_bound", "must lie in [-5, 0) or be null", glb)
        c["gate_lower_bound"] = glb
        c["use_full_rank_gate"] = _bool(lac, ["use_full_rank_gate"], False, prefix=lp)

    # ---- MLA
    mla_default = True if hf_spelling else False
    c["mla_use_nope"] = _bool(t, ["mla_use_nope"], mla_default, prefix=p)
    c["mla_use_output_gate"] = _bool(t, ["mla_use_output_gate"], False, prefix=p)
    c["rope_theta"] = _float(t, ["rope_theta"], 10000.0, prefix=p)
    rs = t.get("rope_scaling")
    if rs is not None:
        kind = rs.get("rope_type", rs.get("type")) if isinstance(rs, dict) else None
        if kind != "default":
            raise ConfigError(p + "rope_scaling", "only null or {'rope_type': 'default'} is supported", rs)
    c["rope_scaling"] = rs
    n_mtp = _int(t, ["num_nextn_predict_layers"], 0, minimum=0, prefix=p)
    if c["mla_layer_ids"] or n_mtp:  # MTP layers are MLA layers too
        nh = c["num_attention_heads"] = _int(t, ["num_attention_heads"], minimum=1, prefix=p)
        nkv = _int(t, ["num_key_value_heads"], None, optional=True, prefix=p)
        if nkv is not None and nkv != nh:
            raise ConfigError(p + "num_key_value_heads", f"MLA needs num_key_value_heads == num_attention_heads ({nh})", nkv)
        c["q_lora_rank"] = _int(t, ["q_lora_rank"], None, optional=True, minimum=1, prefix=p)
        c["kv_lora_rank"] = _int(t, ["kv_lora_rank"], minimum=1, prefix=p)
        c["qk_nope_head_dim"] = _int(t, ["qk_nope_head_dim"], minimum=1, prefix=p)
        c["qk_rope_head_dim"] = _int(t, ["qk_rope_head_dim"], minimum=0, prefix=p)
        c["v_head_dim"] = _int(t, ["v_head_dim"], minimum=1, prefix=p)
        if not c["mla_use_nope"] and c["qk_rope_head_dim"] % 2:
            raise ConfigError(p + "qk_rope_head_dim", "must be even when RoPE is used (mla_use_nope false)",
                              c["qk_rope_head_dim"])
        if c["rope_theta"] <= 0:
            raise ConfigError(p + "rope_theta", "must be > 0", c["rope_theta"])
    else:
        c["num_attention_heads"] = _int(t, ["num_attention_heads"], 0, minimum=0, prefix=p)

    # ---- Block Attention Residuals
    c["attn_res_block_size"] = _int(t, ["attn_res_block_size"], None, optional=True, minimum=1, prefix=p)

    # ---- activation
    act = c["hidden_act"] = _choice(t, ["hidden_act"], ("silu", "situ"), "silu", prefix=p)
    c["situ_beta"] = _float(t, ["activation_situ_beta"], None, optional=True, prefix=p)
    c["situ_linear_beta"] = _float(t, ["activation_situ_linear_beta"], None, optional=True, prefix=p)
    if act == "situ":
        if c["situ_beta"] is None or c["situ_beta"] <= 0:
            raise ConfigError(p + "activation_situ_beta", "must be a number > 0 when hidden_act is 'situ'",
                              c["situ_beta"])
        if c["situ_linear_beta"] is not None and c["situ_linear_beta"] <= 0:
            raise ConfigError(p + "activation_situ_linear_beta", "must be > 0 or null", c["situ_linear_beta"])

    # ---- MoE
    E = c["num_experts"] = _int(
        t, ["num_experts", "num_local_experts", "n_routed_experts"], None, optional=True, minimum=1, prefix=p
    )
    c["first_k_dense_replace"] = _int(t, ["first_k_dense_replace"], 0, minimum=0, prefix=p)
    c["moe_layer_freq"] = _int(t, ["moe_layer_freq"], 1, minimum=1, prefix=p)
    mlt = t.get("mlp_layer_types")
    if mlt is not None:
        if not isinstance(mlt, list) or len(mlt) != L or any(x not in ("dense", "sparse") for x in mlt):
            raise ConfigError(p + "mlp_layer_types", f"must be a list of {L} entries from ['dense', 'sparse']", mlt)
        fk, freq = _pattern_from_mlp_types(mlt, p)
        for key, val in (("first_k_dense_replace", fk), ("moe_layer_freq", freq)):
            if key in t and t[key] != val and "sparse" in mlt:
                raise ConfigError(p + key, f"disagrees with mlp_layer_types (which implies {val})", t[key])
        if "sparse" in mlt and E is None:
            raise ConfigError(p + "num_experts", "is required when mlp_layer_types has 'sparse' layers")
        if "sparse" not in mlt:
            c["num_experts"] = E = None
        else:
            c["first_k_dense_replace"], c["moe_layer_freq"] = fk, freq
    any_dense = any(
        not (E is not None and i >= c["first_k_dense_replace"] and i % c["moe_layer_freq"] == 0) for i in range(L)
    )
    c["intermediate_size"] = _int(t, ["intermediate_size"], _REQUIRED if any_dense else 0, minimum=1 if any_dense else 0,
                                  prefix=p)
    c["moe_renormalize"] = _bool(t, ["moe_renormalize", "norm_topk_prob"], True, prefix=p)
    c["routed_scaling_factor"] = _float(t, ["routed_scaling_factor"], 1.0, prefix=p)
    c["router_activation"] = _choice(t, ["moe_router_activation_func", "scoring_func"], ("sigmoid", "softmax"),
                                     "sigmoid", prefix=p)
    c["topk_method"] = _choice(t, ["topk_method"], ("noaux_tc",), "noaux_tc", prefix=p)
    c["use_grouped_topk"] = _bool(t, ["use_grouped_topk"], True, prefix=p)
    c["num_shared_experts"] = _int(t, ["num_shared_experts", "n_shared_experts"], 0, minimum=0, prefix=p)
    c["routed_expert_hidden_size"] = _int(t, ["routed_expert_hidden_size"], None, optional=True, minimum=1, prefix=p)
    c["latent_moe_use_norm"] = _bool(t, ["latent_moe_use_norm"], False, prefix=p)
    if E is not None:
        k = c["num_experts_per_token"] = _int(t, ["num_experts_per_token", "num_experts_per_tok"], minimum=1, prefix=p)
        if k > E:
            raise ConfigError(p + "num_experts_per_token", f"must be <= num_experts ({E})", k)
        g = c["num_expert_group"] = _int(t, ["num_expert_group", "n_group"], 1, minimum=1, prefix=p)
        tg = c["topk_group"] = _int(t, ["topk_group"], 1, minimum=1, prefix=p)
        if E % g:
            raise ConfigError(p + "num_expert_group", f"must divide num_experts ({E})", g)
        if tg > g:
            raise ConfigError(p + "topk_group", f"must be <= num_expert_group ({g})", tg)
        if g > 1:
            if not c["use_grouped_topk"]:
                raise ConfigError(p + "use_grouped_topk", "must be true when num_expert_group > 1", False)
            if E // g < 2:
                raise ConfigError(p + "num_expert_group", "grouped top-k scores a group by its top-2 experts, so "
                                  "every group needs >= 2 experts", g)
            if k > tg * (E // g):
                raise ConfigError(p + "num_experts_per_token", f"must be <= topk_group * experts per group "
                                  f"({tg * (E // g)})", k)
        c["moe_intermediate_size"] = _int(t, ["moe_intermediate_size"], minimum=1, prefix=p)
        if c["routed_scaling_factor"] <= 0:
            raise ConfigError(p + "routed_scaling_factor", "must be > 0", c["routed_scaling_factor"])
    elif c["routed_expert_hidden_size"] is not None:
        raise ConfigError(p + "routed_expert_hidden_size", "needs routed experts (num_experts is null)")
    if c["latent_moe_use_norm"] and c["routed_expert_hidden_size"] is None:
        raise ConfigError(p + "latent_moe_use_norm", "needs LatentMoE (routed_expert_hidden_size is null)", True)

    # ---- quantization (MXFP4 routed experts only)
    c["quantization_config"] = copy.deepcopy(qc) if qc is not None else None
    c["experts_mxfp4"] = _parse_quantization(qc, E, p)
    if c["experts_mxfp4"]:
        din = c["routed_expert_hidden_size"] or H
        for name, v in (("routed_expert_hidden_size" if c["routed_expert_hidden_size"] else "hidden_size", din),
                        ("moe_intermediate_size", c["moe_intermediate_size"])):
            if v % 32:
                raise ConfigError(p + name, "must be a multiple of 32 for MXFP4 experts (one scale per 32 inputs)", v)

    c["num_nextn_predict_layers"] = n_mtp
    return K3Config(**c)


def _pattern_from_mlp_types(mlt: list[str], p: str) -> tuple[int, int]:
    """(first_k_dense_replace, moe_layer_freq) reproducing a transformers `mlp_layer_types` list."""
    L = len(mlt)
    if "sparse" not in mlt:
        return L, 1
    fk = mlt.index("sparse")
    for freq in range(1, L + 1):
        if all((mlt[i] == "sparse") == (i >= fk and i % freq == 0) for i in range(L)):
            return fk, freq
    raise ConfigError(p + "mlp_layer_types", "is not expressible as first_k_dense_replace + moe_layer_freq "
                      "(MoE iff i >= first_k_dense_replace and i % moe_layer_freq == 0)", mlt)


def _parse_quantization(qc: Any, num_experts: int | None, p: str) -> bool:
    """True iff qc describes MXFP4 routed experts; None -> False; anything else -> ConfigError."""
    if qc is None:
        return False
    name = p + "quantization_config"
    if not isinstance(qc, dict):
        raise ConfigError(name, "must be an object or null", qc)
    if qc.get("quant_method") != "compressed-tensors":
        raise ConfigError(name + ".quant_method", "only 'compressed-tensors' (MXFP4 experts) is supported",
                          qc.get("quant_method"))
    formats = set()
    if qc.get("format") is not None:
        formats.add(qc["format"])
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise ConfigError(name + ".config_groups", "must be an object", groups)
    for gname, g in groups.items():
        if not isinstance(g, dict):
            raise ConfigError(f"{name}.config_groups.{gname}", "must be an object", g)
        if g.get("format") is not None:
            formats.add(g["format"])
        w = g.get("weights") or {}
        for key, want in (("num_bits", 4), ("group_size", 32), ("type", "float")):
            if key in w and w[key] != want:
                raise ConfigError(f"{name}.config_groups.{gname}.weights.{key}", f"MXFP4 needs {want!r}", w[key])
        if g.get("input_activations") is not None:
            raise ConfigError(f"{name}.config_groups.{gname}.input_activations",
                              "must be null (only weights are quantized)", g["input_activations"])
    if formats != {MXFP4_FORMAT}:
        raise ConfigError(name + ".format", f"must be '{MXFP4_FORMAT}'", sorted(formats) or None)
    if num_experts is None:
        raise ConfigError(name, "MXFP4 covers only routed experts, but the model has none (num_experts is null)")
    return True


def mxfp4_quantization_config() -> dict:
    """The compressed-tensors `quantization_config` our checkpoints carry: MXFP4 routed experts only."""
    return {
        "quant_method": "compressed-tensors",
        "format": MXFP4_FORMAT,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": [r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"],
                "weights": {
                    "num_bits": 4,
                    "type": "float",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": 32,
                    "dynamic": False,
                    "scale_dtype": "uint8",
                },
                "input_activations": None,
                "output_activations": None,
                "format": MXFP4_FORMAT,
            }
        },
        "ignore": ["lm_head"],
    }
