"""`load_model_weights(model_dir, dtype, device)` -> (K3Config, canonical weight dict).

The checkpoint is validated from the safetensors headers before any tensor data is read: every
missing, unexpected, duplicated or wrongly shaped tensor is reported in one `CheckpointError`.
Tensors are then read straight onto `device` and cast to their target dtype (see `spec.py` for which
tensors stay float32 / uint8); stacked expert tensors are allocated once and filled expert by expert.

Shard-only reads (`keep=`, one tensor-parallel rank: workers/engine/parallel/shard.py decides): for each
canonical tensor a `Selection` (some experts of a stacked expert tensor, or spans along one dim) or None
(not needed); only those bytes are read from the files (safetensors `get_slice`), mapped through fused
row ranges, per-expert tensors and size-1 dims of the disk spelling. `apply_selection` is the same cut
of a tensor in memory, so a shard read from disk equals the full read cut afterwards.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Selection:
    """The part of one canonical tensor a reader keeps: `experts` (indices into dim 0, in the order kept)
    or the concatenation of `spans` ([start, stop) ranges) along `dim`; neither = the whole tensor."""

    experts: tuple[int, ...] | None = None
    dim: int | None = None
    spans: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        if self.experts is not None and self.dim is not None:
            raise ValueError("a Selection keeps experts or spans along one dim, not both")

    @property
    def whole(self) -> bool:
        return self.experts is None and self.dim is None

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        out = list(shape)
        if self.experts is not None:
            out[0] = len(self.experts)
        elif self.dim is not None:
            out[self.dim] = sum(b - a for a, b in self.spans)
        return tuple(out)


Keep = Callable[[str, tuple[int, ...]], "Selection | None"]  # (canonical name, full shape) -> what to read


def apply_selection(t: torch.Tensor, sel: Selection) -> torch.Tensor:
    """`sel` of an in-memory tensor (a new contiguous tensor unless `sel` is whole)."""
    if sel.experts is not None:
        return t.index_select(0, torch.tensor(sel.experts, dtype=torch.long, device=t.device)).contiguous()
    if sel.dim is not None:
        return torch.cat([t.narrow(sel.dim, a, b - a) for a, b in sel.spans], dim=sel.dim).contiguous()
    return t


def _disk_dim(region: tuple[int, ...], disk: tuple[int, ...], dim: int) -> int:
    """The disk dim holding `region`'s dim `dim` (the two shapes differ only by size-1 dims)."""
    k = sum(1 for s in region[:dim] if s != 1)
    return [i for i, s in enumerate(disk) if s != 1][k]


def _read_region(sl, disk_shape, src_rows, region, dim, spans):
    """Read `spans` along `region`'s dim `dim` (None: all of it) of one disk tensor (`src_rows`: the rows of a
    fused tensor the region is); -> (tensor shaped like the region with that dim cut, bytes read)."""
    disk = list(disk_shape)
    base = [slice(None)] * len(disk)
    if src_rows is not None:
        disk[0] = src_rows[1] - src_rows[0]
        base[0] = slice(*src_rows)
    parts = []
    if dim is None:
        parts.append(sl[tuple(base)])
        shape = region
    else:
        dd = _disk_dim(region, tuple(disk), dim)
        off = src_rows[0] if (src_rows is not None and dd == 0) else 0
        for a, b in spans:
            idx = list(base)
            idx[dd] = slice(off + a, off + b)
            parts.append(sl[tuple(idx)])
        shape = list(region)
        shape[dim] = sum(b - a for a, b in spans)
        parts = [torch.cat(parts, dim=dd)] if len(parts) > 1 else parts
    t = parts[0]
    return t.reshape(tuple(shape)), t.numel() * t.element_size()


def _intersect(spans, lo: int, hi: int):
    """Spans (full-tensor coords) within [lo, hi): (start - lo, stop - lo, offset in the kept tensor)."""
    out, at = [], 0
    for a, b in spans:
        x, y = max(a, lo), min(b, hi)
        if x < y:
            out.append((x - lo, y - lo, at + x - a))
        at += b - a
    return out


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
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    keep: Keep | None = None, stats: dict | None = None,
) -> tuple[K3Config, dict[str, torch.Tensor]]:
    """Read config.json and the safetensors of `model_dir` -> (K3Config, canonical weights on `device`).

    Float tensors come back in `dtype`, except the fp32-kind ones (float32, float64 when dtype is float64);
    MXFP4 tensors stay uint8. A tied lm_head is the embedding tensor itself. `keep`: read only each
    tensor's Selection (None: leave it out); `stats["bytes_read"]` counts the tensor bytes read.
    """
    from safetensors import safe_open

    cfg = K3Config.from_pretrained(model_dir)
    files = list_checkpoint_files(model_dir)
    headers = read_headers(files)
    pieces, specs = plan_load(cfg, headers, model_dir)
    if keep is not None:
        return cfg, _load_selected(cfg, files, headers, pieces, specs, dtype, torch.device(device), keep, stats)
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
    if stats is not None:
        stats["bytes_read"] = stats.get("bytes_read", 0) + sum(
            _disk_bytes(headers[d]) for d in {p.disk for p in pieces})
    _fill_defaults(out, specs, dtype, device)
    return cfg, {k: out[k] for k in specs if k in out}


_ITEM = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "U8": 1, "F8_E8M0": 1}


def _disk_bytes(header) -> int:
    shape, sdtype = header
    n = 1
    for s in shape:
        n *= int(s)
    return n * _ITEM.get(sdtype, 1)


def _fill_defaults(out, specs, dtype, device, keep: Keep | None = None) -> None:
    for name, spec in specs.items():
        if name in out:
            continue
        if spec.default == "zeros":
            sel = keep(name, spec.shape) if keep is not None else Selection()
            if sel is not None:
                out[name] = torch.zeros(sel.shape(spec.shape), dtype=target_dtype(spec, dtype), device=device)
        elif spec.default == "tied" and "model.embed_tokens.weight" in out:
            out[name] = out["model.embed_tokens.weight"]


def _load_selected(cfg, files, headers, pieces, specs, dtype, device, keep: Keep, stats) -> dict[str, torch.Tensor]:
    """The `keep` reads of load_model_weights: per piece only its selected rows / columns / experts."""
    from safetensors import safe_open

    sels = {name: keep(name, spec.shape) for name, spec in specs.items()}
    out: dict[str, torch.Tensor] = {}
    nbytes = 0
    by_file: dict[Path, list[Piece]] = defaultdict(list)
    for p in pieces:
        if sels[p.target] is not None:
            by_file[files[p.disk]].append(p)
    for f, plist in by_file.items():
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for p in plist:
                spec, sel = specs[p.target], sels[p.target]
                tdt = target_dtype(spec, dtype)
                sl = fh.get_slice(p.disk)
                region = piece_dst_shape(spec, p)
                if p.expert is None:  # a whole canonical tensor (or the rows of a fused one)
                    if sel.experts is not None:
                        dim, spans = 0, tuple((e, e + 1) for e in sel.experts)
                    else:
                        dim, spans = sel.dim, sel.spans
                    t, n = _read_region(sl, headers[p.disk][0], p.src_rows, region, dim, spans)
                    nbytes += n
                    out[p.target] = _as(t, tdt, device)
                    continue
                # one expert's tensor into a stacked canonical tensor [E, ...]
                if sel.experts is not None and p.expert not in sel.experts:
                    continue
                buf = out.get(p.target)
                if buf is None:
                    buf = out[p.target] = torch.empty(sel.shape(spec.shape), dtype=tdt, device=device)
                slot = sel.experts.index(p.expert) if sel.experts is not None else p.expert
                lo, hi = p.dst_rows if p.dst_rows is not None else (0, region[0])
                if sel.dim == 1:  # rows of the expert: the spans that fall in this piece's rows
                    for a, b, at in _intersect(sel.spans, lo, hi):
                        t, n = _read_region(sl, headers[p.disk][0], p.src_rows, region, 0, ((a, b),))
                        nbytes += n
                        buf[slot, at: at + b - a].copy_(t)
                    continue
                dim = sel.dim - 1 if sel.dim is not None else None
                t, n = _read_region(sl, headers[p.disk][0], p.src_rows, region, dim, sel.spans)
                nbytes += n
                buf[slot, lo:hi].copy_(t)
    if stats is not None:
        stats["bytes_read"] = stats.get("bytes_read", 0) + nbytes
    _fill_defaults(out, specs, dtype, device, keep)
    return {k: out[k] for k in specs if k in out}


def _as(t: torch.Tensor, tdt: torch.dtype, device) -> torch.Tensor:
    if t.dtype == getattr(torch, "float8_e8m0fnu", None):
        t = t.view(torch.uint8)
    return t.to(device=device, dtype=tdt).contiguous()


__all__ = ["CheckpointError", "Selection", "apply_selection", "fused_row_counts", "load_model_weights", "plan_load",
           "target_dtype"]
