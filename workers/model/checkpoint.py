"""The on-disk checkpoint format: tensor-name mapping (disk <-> canonical), file discovery and writing.

Disk spellings accepted when reading (all map to the canonical names of `spec.expected_weights`):

* our K3 checkpoints and the hub's Kimi-Linear / K3 names: `self_attn.{q,k,v}_conv1d.weight [P,1,K]`,
  `A_log [1,1,h,1]`, `f_a_proj`, `g_proj` or `g_a_proj`/`g_b_proj`, `kv_a_proj_with_mqa`,
  `block_sparse_moe.experts.{e}.w{1,2,3}.weight` (or `.weight_packed` / `.weight_scale` for MXFP4),
  `block_sparse_moe.gate.e_score_correction_bias`, ...;
* transformers' save_pretrained names (the same, except that dense MLP layers also appear under
  `block_sparse_moe.`), and its in-memory names (`self_attn.forget_gate.*`, `self_attn.conv1d.weight`,
  `mlp.experts.gate_up_proj` / `down_proj`, `mlp.gate.*`);
* fused projections: KDA `in_proj_qkvgfab` ([q|k|v|g|f_a|b], zero-padded to a multiple of 16 rows) and
  `conv1d`, MLA `fused_qkv_a_g_proj` ([q_a|kv_a|g]) / `fused_qkv_a_proj` ([q_a|kv_a]), MLP `gate_up_proj`;
* the canonical names themselves; a `language_model.` prefix is stripped. For kimi_k3, vision tower and
  projector tensors are skipped (this is a text-only server).

Writing (`save_checkpoint`) uses the hub spelling with one tensor per expert.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import K3Config
from .spec import WeightSpec

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "mm_projector.", "vision_model.")

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^experts\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale)$")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; lists every problem at once."""

    def __init__(self, model_dir, missing=(), unexpected=(), mismatched=()):
        self.missing, self.unexpected, self.mismatched = list(missing), list(unexpected), list(mismatched)
        parts = []
        for title, items in (("missing tensors", self.missing), ("unexpected tensors", self.unexpected),
                             ("tensors with a wrong shape or dtype", self.mismatched)):
            if items:
                shown = items[:60]
                more = f"\n    ... and {len(items) - len(shown)} more" if len(items) > len(shown) else ""
                parts.append(f"  {title} ({len(items)}):\n    " + "\n    ".join(shown) + more)
        super().__init__(f"checkpoint {model_dir} does not match its config.json:\n" + "\n".join(parts))


@dataclass(frozen=True)
class Piece:
    """One disk tensor (or a row range of it) landing in (part of) one canonical tensor."""

    disk: str
    target: str
    src_rows: tuple[int, int] | None = None  # rows of the disk tensor (fused projections)
    expert: int | None = None  # index into the target's first dim (stacked experts)
    dst_rows: tuple[int, int] | None = None  # rows of target[expert] (w1 -> [0, I), w3 -> [I, 2I))


def _splits(disk: str, base: str, parts: list[tuple[str, int]]) -> list[Piece]:
    out, row = [], 0
    for name, n in parts:
        out.append(Piece(disk, base + name, (row, row + n)))
        row += n
    return out


def fused_row_counts(cfg: K3Config, kind: str) -> list[tuple[str, int]]:
    """Row layout of a fused projection (TP = 1) -> [(canonical suffix, rows), ...]."""
    if kind == "in_proj_qkvgfab":
        P, d, h = cfg.kda_proj_dim, cfg.kda_head_dim, cfg.kda_num_heads
        return [("q_proj.weight", P), ("k_proj.weight", P), ("v_proj.weight", P), ("g_proj.weight", P),
                ("f_a_proj.weight", d), ("b_proj.weight", h)]
    if kind == "conv1d":
        P = cfg.kda_proj_dim
        return [("q_conv1d.weight", P), ("k_conv1d.weight", P), ("v_conv1d.weight", P)]
    kv = [("kv_a_proj_with_mqa.weight", cfg.kv_lora_rank + cfg.qk_rope_head_dim)]
    q = [("q_a_proj.weight", cfg.q_lora_rank or 0)]
    if kind == "fused_qkv_a_proj":
        return q + kv
    if kind == "fused_qkv_a_g_proj":
        return q + kv + [("g_proj.weight", cfg.num_attention_heads * cfg.v_head_dim)]
    raise KeyError(kind)


def map_disk_name(name: str, cfg: K3Config) -> list[Piece] | None:
    """Pieces for one disk tensor name, [] to skip it on purpose, None when the name means nothing here."""
    disk = name
    if name.startswith("language_model."):
        name = name[len("language_model."):]
    if cfg.model_type == "kimi_k3" and name.startswith(VISION_PREFIXES):
        return []
    m = _LAYER_RE.match(name)
    if not m:
        return [Piece(disk, name)]
    i, rest = int(m.group(1)), m.group(2)
    p = f"model.layers.{i}."
    rest = rest.replace("self_attn.forget_gate.", "self_attn.")
    if rest.startswith(("mlp.", "block_sparse_moe.")):
        body = rest.split(".", 1)[1]
        if cfg.is_moe_layer(i):
            base = p + "block_sparse_moe."
            em = _EXPERT_RE.match(body)
            if em:
                e, which, kind = int(em.group(1)), em.group(2), em.group(3)
                suffix = {"weight": "", "weight_packed": "_packed", "weight_scale": "_scale"}[kind]
                inter = cfg.moe_intermediate_size
                if which == "w2":
                    return [Piece(disk, base + "experts.w2" + suffix, None, e, None)]
                rows = (0, inter) if which == "w1" else (inter, 2 * inter)
                return [Piece(disk, base + "experts.w13" + suffix, None, e, rows)]
            if body == "experts.gate_up_proj":
                return [Piece(disk, base + "experts.w13")]
            if body == "experts.down_proj":
                return [Piece(disk, base + "experts.w2")]
            if body == "shared_experts.gate_up_proj.weight":
                inter = cfg.shared_intermediate_size
                return _splits(disk, base + "shared_experts.", [("gate_proj.weight", inter), ("up_proj.weight", inter)])
            return [Piece(disk, base + body)]
        base = p + "mlp."
        if body == "gate_up_proj.weight":
            return _splits(disk, base, [("gate_proj.weight", cfg.intermediate_size),
                                        ("up_proj.weight", cfg.intermediate_size)])
        return [Piece(disk, base + body)]
    if rest.startswith("self_attn."):
        body = rest[len("self_attn."):]
        base = p + "self_attn."
        fused = body[: -len(".weight")] if body.endswith(".weight") else None
        if fused in ("in_proj_qkvgfab", "conv1d", "fused_qkv_a_proj", "fused_qkv_a_g_proj"):
            return _splits(disk, base, fused_row_counts(cfg, fused))
        return [Piece(disk, base + body)]
    return [Piece(disk, p + rest)]


def squeezed(shape) -> tuple[int, ...]:
    return tuple(int(s) for s in shape if s != 1)


def piece_dst_shape(spec: WeightSpec, piece: Piece) -> tuple[int, ...]:
    shape = list(spec.shape[1:] if piece.expert is not None else spec.shape)
    if piece.dst_rows is not None:
        shape[0] = piece.dst_rows[1] - piece.dst_rows[0]
    return tuple(shape)


# ------------------------------------------------------------------------------------------- files


def list_checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (from the index, the single file, or every *.safetensors)."""
    d = Path(model_dir)
    index = d / INDEX_FILE
    if index.is_file():
        wm = json.loads(index.read_text()).get("weight_map")
        if not isinstance(wm, dict):
            raise CheckpointError(d, unexpected=[f"{INDEX_FILE}: no weight_map object"])
        missing = sorted({f for f in wm.values() if not (d / f).is_file()})
        if missing:
            raise FileNotFoundError(f"{d}: shards named in {INDEX_FILE} are missing: {missing}")
        return {k: d / f for k, f in wm.items()}
    files = [d / SINGLE_FILE] if (d / SINGLE_FILE).is_file() else sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{d}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors")
    from safetensors import safe_open

    out: dict[str, Path] = {}
    dup = []
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                if k in out:
                    dup.append(f"{k} (in {out[k].name} and {f.name})")
                out[k] = f
    if dup:
        raise CheckpointError(d, unexpected=[f"duplicate tensor {x}" for x in dup])
    return out


# ------------------------------------------------------------------------------------------- writing


def disk_tensors(cfg: K3Config, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical weights -> our on-disk tensors (hub spelling, one tensor per expert, hub shapes)."""
    out: dict[str, torch.Tensor] = {}
    inter = cfg.moe_intermediate_size
    for name, t in weights.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.endswith(("conv1d.weight",)):
            out[name] = t.unsqueeze(1)  # [P, K] -> [P, 1, K]
        elif name.endswith("self_attn.A_log"):
            out[name] = t.reshape(1, 1, -1, 1)
        elif ".block_sparse_moe.experts." in name:
            base, leaf = name.rsplit("experts.", 1)  # leaf: w13[_packed|_scale] | w2[...]
            which, _, kind = leaf.partition("_")
            suffix = {"": "weight", "packed": "weight_packed", "scale": "weight_scale"}[kind]
            for e in range(t.shape[0]):
                if which == "w13":
                    out[f"{base}experts.{e}.w1.{suffix}"] = t[e, :inter]
                    out[f"{base}experts.{e}.w3.{suffix}"] = t[e, inter:]
                else:
                    out[f"{base}experts.{e}.w2.{suffix}"] = t[e]
        else:
            out[name] = t
    return out


def save_checkpoint(
    cfg: K3Config, weights: dict[str, torch.Tensor], out_dir: str | Path, max_shard_bytes: int | None = None
) -> list[Path]:
    """Write config.json and the safetensors (one file, or shards + index when max_shard_bytes is set and
    exceeded). Tensors move to the CPU shard by shard. Returns the safetensors paths written."""
    from safetensors.torch import save_file

    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    tensors = disk_tensors(cfg, weights)
    shards: list[list[str]] = [[]]
    size = 0
    for k, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        path = d / SINGLE_FILE
        save_file({k: tensors[k].detach().contiguous().cpu() for k in shards[0]}, str(path), metadata=meta)
        return [path]
    paths, weight_map, total = [], {}, 0
    for n, keys in enumerate(shards, 1):
        fname = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        chunk = {k: tensors[k].detach().contiguous().cpu() for k in keys}
        total += sum(t.numel() * t.element_size() for t in chunk.values())
        save_file(chunk, str(d / fname), metadata=meta)
        weight_map.update({k: fname for k in keys})
        paths.append(d / fname)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (d / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return paths
