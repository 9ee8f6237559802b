"""`load_model_weights(model_dir, dtype, device)` -> (K3Config, canonical weight dict).

The checkpoint is validated from the safetensors headers before any tensor data is read: every
missing, unexpected, duplicated or wrongly shaped tensor is reported in one `CheckpointError`.
Tensors are then read straight onto `device` and cast to their target dtype (see `spec.py` for which
tensors stay float32 / uint8); stacked expert tensors are allocated once and filled expert by expert.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from .checkpoint import (
    CheckpointError,
    Piece,
    fused_row_counts,
    list_checkpoint_files,
    map_disk_name,
    piece_dst_shape,
    squeezed,
)
from .config import K3Config
from .functional import acc_dtype
from .spec import WeightSpec, expected_weights

_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
_BYTE_DTYPES = {"U8", "F8_E8M0"}


def target_dtype(spec: WeightSpec, dtype: torch.dtype) -> torch.dtype:
    """The dtype a canonical tensor is returned in for model dtype `dtype`."""
    if spec.kind == "uint8":
        return torch.uint8
    if spec.kind == "fp32":
        return acc_dtype(dtype)
    return dtype


def _expert_slots(name: str, spec: WeightSpec, cfg: K3Config) -> dict[tuple, str]:
    """For a stacked expert tensor: (expert, dst_rows) -> the disk name that fills that slot."""
    base, leaf = name.rsplit("experts.", 1)
    which, _, kind = leaf.partition("_")
    suffix = {"": "weight", "packed": "weight_packed", "scale": "weight_scale"}[kind]
    inter = cfg.moe_intermediate_size
    slots = {}
    for e in range(spec.shape[0]):
        if which == "w13":
            slots[(e, (0, inter))] = f"{base}experts.{e}.w1.{suffix}"
            slots[(e, (inter, 2 * inter))] = f"{base}experts.{e}.w3.{suffix}"
        else:
            slots[(e, None)] = f"{base}experts.{e}.w2.{suffix}"
    return slots


def plan_load(cfg: K3Config, headers: dict[str, tuple[tuple[int, ...], str]], model_dir="<checkpoint>"):
    """Validate disk tensors (name -> (shape, safetensors dtype string)) against the config.

    Returns `(pieces, specs)`; raises CheckpointError listing every problem.
    """
    specs = expected_weights(cfg)
    unexpected, mismatched, pieces = [], [], []
    covered: dict[str, set] = defaultdict(set)
    for disk, (shape, sdtype) in headers.items():
        mapped = map_disk_name(disk, cfg)
        if mapped is None:
            unexpected.append(disk)
            continue
        if mapped and mapped[0].src_rows is not None:
            total = sum(p.src_rows[1] - p.src_rows[0] for p in mapped)
            padded = -(-total // 16) * 16 if "in_proj_qkvgfab" in disk else total
            if not shape or shape[0] not in (total, padded):
                mismatched.append(f"{disk}: {list(shape)} (fused rows must be {total}"
                                  + (f" or {padded}" if padded != total else "") + ")")
                continue
        for p in mapped:
            spec = specs.get(p.target)
            if spec is None:
                unexpected.append(disk if p.target == disk else f"{disk} (as {p.target})")
                break
            if spec.default == "tied":
                break  # a tied lm_head stored anyway: accepted, the embedding is used
            if p.expert is not None and not 0 <= p.expert < spec.shape[0]:
                unexpected.append(f"{disk} (expert {p.expert} >= num_experts {spec.shape[0]})")
                break
            src = list(shape)
            if p.src_rows is not None:
                src[0] = p.src_rows[1] - p.src_rows[0]
            dst = piece_dst_shape(spec, p)
            ok_dtype = sdtype in (_BYTE_DTYPES if spec.kind == "uint8" else _FLOAT_DTYPES)
            key = (p.expert, p.dst_rows) if p.expert is not None else "whole"
            if squeezed(src) != squeezed(dst) or not ok_dtype:
                mismatched.append(f"{disk}: {list(shape)} {sdtype}, expected {list(dst)} "
                                  f"{'uint8' if spec.kind == 'uint8' else 'float'} for {p.target}")
                covered[p.target].add(key)  # reported once, as mismatched (not also as missing)
                continue
            if key in covered[p.target] or ("whole" in covered[p.target] and p.expert is not None):
                unexpected.append(f"{disk} (duplicates data already given for {p.target})")
                continue
            covered[p.target].add(key)
            pieces.append(p)
    missing = []
    for name, spec in specs.items():
        got = covered.get(name, set())
        if spec.default is not None or "whole" in got:
            continue
        if ".experts.w" in name:
            slots = _expert_slots(name, spec, cfg)
            if got:
                missing.extend(disk for key, disk in slots.items() if key not in got)
            else:
                missing.append(f"{name} (or its per-expert tensors, e.g. {next(iter(slots.values()))})")
        else:
            missing.append(name)
    if missing or unexpected or mismatched:
        raise CheckpointError(model_dir, missing, unexpected, mismatched)
    return pieces, specs


def read_headers(files: dict[str, Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = defaultdict(list)
    for k, f in files.items():
        by_file[f].append(k)
    out = {}
    for f, keys in by_file.items():
        with safe_open(str(f), framework="pt") as fh:
            present = set(fh.keys())
            for k in keys:
                if k not in present:
                    raise CheckpointError(f.parent, missing=[f"{k} (listed in the index, absent from {f.name})"])
                sl = fh.get_slice(k)
                out[k] = (tuple(sl.get_shape()), sl.get_dtype())
    return out


def load_model_weights(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[K3Config, dict[str, torch.Tensor]]:
    """Read config.json and the safetensors of `model_dir` -> (K3Config, canonical weights on `device`).

    Float tensors come back in `dtype`, except the fp32-kind ones (float32, float64 when dtype is float64);
    MXFP4 tensors stay uint8. A tied lm_head is the embedding tensor itself.
    """
    from safetensors import safe_open

    cfg = K3Config.from_pretrained(model_dir)
    files = list_checkpoint_files(model_dir)
    pieces, specs = plan_load(cfg, read_headers(files), model_dir)
    device = torch.device(device)
    out: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[Piece]] = defaultdict(list)
    for p in pieces:
        by_file[files[p.disk]].append(p)
    dev_str = "cpu" if device.type == "cpu" else str(device)
    for f, plist in by_file.items():
        with safe_open(str(f), framework="pt", device=dev_str) as fh:
            cache: dict[str, torch.Tensor] = {}
            for p in plist:
                spec = specs[p.target]
                tdt = target_dtype(spec, dtype)
                if p.disk not in cache:
                    t = fh.get_tensor(p.disk)
                    if t.dtype == getattr(torch, "float8_e8m0fnu", None):
                        t = t.view(torch.uint8)
                    cache = {p.disk: t}  # fused tensors feed consecutive pieces; keep only the current one
                t = cache[p.disk]
                if p.src_rows is not None:
                    t = t[p.src_rows[0] : p.src_rows[1]]
                t = t.reshape(piece_dst_shape(spec, p)).to(tdt)
                if p.expert is None:
                    out[p.target] = t.contiguous()
                    continue
                buf = out.get(p.target)
                if buf is None:
                    buf = out[p.target] = torch.empty(spec.shape, dtype=tdt, device=device)
                rows = slice(*p.dst_rows) if p.dst_rows is not None else slice(None)
                buf[p.expert, rows].copy_(t)
    for name, spec in specs.items():
        if name in out:
            continue
        if spec.default == "zeros":
            out[name] = torch.zeros(spec.shape, dtype=target_dtype(spec, dtype), device=device)
        elif spec.default == "tied":
            out[name] = out["model.embed_tokens.weight"]
    return cfg, {k: out[k] for k in specs if k in out}


__all__ = ["CheckpointError", "fused_row_counts", "load_model_weights", "plan_load", "target_dtype"]
