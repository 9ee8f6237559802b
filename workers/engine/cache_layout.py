"""Hybrid KV-cache layout: page size, block size, cache groups and pool size (design doc §2).

One pool of equal-size pages. Layers are bucketed by kind (MLA latent pages vs KDA state pages)
and each bucket is split round-robin into groups of `group_size` layers; a group has one block
table per request and every layer of the group uses it. Layer position j of every group shares
the byte tensor `pages[j]`, so a block id owned by group g means the same bytes for all groups —
safe because an id is owned by one group at a time. Total bytes = num_blocks × page_bytes ×
group_size.

Page bytes: an MLA page holds `block_size` tokens × (kv_lora_rank + rope_dim) elements; a KDA page
holds one layer's conv state ([3P, K-1], activation dtype, "DS" layout) plus its recurrent state
([h, d, d] stored [v][k], fp32; fp64 when the model runs in float64). The derived block size is the
smallest multiple of the alignment whose MLA page covers the KDA page; a user block size pads the
smaller of the two instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

CPU_KERNEL_BLOCK = 16  # alignment of block sizes (and of in-pass checkpoints) on the CPU path
_REGION_ALIGN = 64  # byte alignment of sub-regions inside a page


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass(frozen=True)
class CacheGroup:
    group_id: int
    kind: str  # "mla" | "kda"
    layer_ids: tuple[int, ...]  # model layer indices; position j uses page tensor j


@dataclass(frozen=True)
class CacheLayout:
    block_size: int
    page_bytes: int
    group_size: int
    groups: tuple[CacheGroup, ...]
    # MLA page geometry
    mla_token_elems: int  # kv_lora_rank + rope dim
    mla_dtype: torch.dtype
    # KDA page geometry
    conv_channels: int  # 3P
    conv_width: int  # K - 1
    conv_dtype: torch.dtype
    ssm_shape: tuple[int, int, int]  # (h, d, d)
    ssm_dtype: torch.dtype
    conv_bytes: int  # padded region size
    ssm_offset: int
    ssm_bytes: int
    mla_page_used: int  # bytes of an MLA page actually used
    kda_page_used: int

    @property
    def mla_groups(self) -> list[CacheGroup]:
        return [g for g in self.groups if g.kind == "mla"]

    @property
    def kda_groups(self) -> list[CacheGroup]:
        return [g for g in self.groups if g.kind == "kda"]

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id costs across all layer positions."""
        return self.page_bytes * self.group_size

    def layer_map(self) -> dict[int, tuple[CacheGroup, int]]:
        out = {}
        for g in self.groups:
            for j, layer in enumerate(g.layer_ids):
                out[layer] = (g, j)
        return out

    def min_blocks_for(self, max_model_len: int, prefix_caching: bool) -> int:
        """Blocks (null block included) one request of `max_model_len` tokens needs."""
        n = 1  # the null block
        n += len(self.mla_groups) * math.ceil(max_model_len / self.block_size)
        n += len(self.kda_groups) * (2 if prefix_caching else 1)
        n += 1  # one copy-on-write / snapshot block of headroom
        return n


def _group_layers(mla: list[int], kda: list[int]) -> tuple[int, list[CacheGroup]]:
    sizes = [len(b) for b in (mla, kda) if b]
    if not sizes:
        raise ValueError("model has no attention layers")
    lo, hi = min(sizes), max(sizes)
    group_size = hi if hi < 1.5 * lo else lo
    groups: list[CacheGroup] = []
    for kind, bucket in (("mla", mla), ("kda", kda)):
        if not bucket:
            continue
        n = math.ceil(len(bucket) / group_size)
        for i in range(n):
            groups.append(CacheGroup(len(groups), kind, tuple(bucket[i::n])))
    return group_size, groups


def plan_cache_layout(config, dtype: torch.dtype, block_size: int | None = None, tp_size: int = 1) -> CacheLayout:
    """Page and group geometry for `config` (a K3Config) with activations in `dtype`, on one of `tp_size`
    tensor-parallel ranks (its KDA page holds its share of the heads: workers/engine/parallel/shard.py)."""
    mla_layers = list(config.mla_layer_ids)
    kda_layers = list(config.kda_layer_ids)
    item = torch.empty((), dtype=dtype).element_size()
    ssm_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    ssm_item = torch.empty((), dtype=ssm_dtype).element_size()

    mla_elems = config.kv_lora_rank + config.qk_rope_head_dim if mla_layers else 0
    mla_tok_bytes = mla_elems * item
    if kda_layers:
        h, d, k = config.kda_num_heads // tp_size, config.kda_head_dim, config.conv_kernel_size
        conv_channels, conv_width = 3 * h * d, k - 1
        conv_bytes = _round_up(conv_channels * conv_width * item, _REGION_ALIGN)
        ssm_bytes = _round_up(h * d * d * ssm_item, _REGION_ALIGN)
        kda_page = conv_bytes + ssm_bytes
        ssm_shape = (h, d, d)
    else:
        conv_channels = conv_width = conv_bytes = ssm_bytes = kda_page = 0
        ssm_shape = (0, 0, 0)

    if block_size is None:
        if kda_layers and mla_layers:
            a = CPU_KERNEL_BLOCK
            block_size = a * math.ceil(kda_page / (a * mla_tok_bytes))
        else:
            block_size = CPU_KERNEL_BLOCK
    if block_size <= 0:
        raise ValueError(f"block_size must be positive (got {block_size})")
    mla_page = block_size * mla_tok_bytes
    page_bytes = _round_up(max(mla_page, kda_page, 1), _REGION_ALIGN)
    group_size, groups = _group_layers(mla_layers, kda_layers)
    return CacheLayout(
        block_size=block_size, page_bytes=page_bytes, group_size=group_size, groups=tuple(groups),
        mla_token_elems=mla_elems, mla_dtype=dtype, conv_channels=conv_channels, conv_width=conv_width,
        conv_dtype=dtype, ssm_shape=ssm_shape, ssm_dtype=ssm_dtype, conv_bytes=conv_bytes,
        ssm_offset=conv_bytes, ssm_bytes=ssm_bytes, mla_page_used=mla_page, kda_page_used=kda_page,
    )


class KVCacheTensors:
    """The page tensors (one uint8 [num_blocks, page_bytes] per layer position) and typed views."""

    def __init__(self, layout: CacheLayout, num_blocks: int, device: str | torch.device = "cpu"):
        self.layout = layout
        self.num_blocks = num_blocks
        self.pages = [torch.zeros(num_blocks, layout.page_bytes, dtype=torch.uint8, device=device)
                      for _ in range(layout.group_size)]

    def mla_view(self, j: int) -> torch.Tensor:
        L = self.layout
        raw = self.pages[j][:, : L.mla_page_used]
        return raw.view(L.mla_dtype).view(self.num_blocks, L.block_size, L.mla_token_elems)

    def conv_view(self, j: int) -> torch.Tensor:
        L = self.layout
        item = torch.empty((), dtype=L.conv_dtype).element_size()
        raw = self.pages[j][:, : L.conv_channels * L.conv_width * item]
        return raw.view(L.conv_dtype).view(self.num_blocks, L.conv_channels, L.conv_width)

    def ssm_view(self, j: int) -> torch.Tensor:
        L = self.layout
        h, d, d2 = L.ssm_shape
        item = torch.empty((), dtype=L.ssm_dtype).element_size()
        raw = self.pages[j][:, L.ssm_offset: L.ssm_offset + h * d * d2 * item]
        return raw.view(L.ssm_dtype).view(self.num_blocks, h, d, d2)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole pages src -> dst at every layer position (copy-on-write, state snapshots)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=self.pages[0].device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=self.pages[0].device)
        for t in self.pages:
            t[dst] = t[src]
