"""The two views of one page pool (design doc §5.1) as NIXL descriptor lists, and the §5.5 zero-fill.

The engine's pages (workers/engine/cache_layout.py) are one uint8 tensor [num_blocks, page_bytes] per
layer position j; block b of position j is at `base_j + b * page_bytes`, whichever group owns it.

* Token-level MLA view: per position j and block b, `r` descriptors of `sub_bytes = prefill_block ×
  mla_token_bytes` each (r = decode block / prefill block, k3serve/common/pd_geometry.py); on the
  prefill side r = 1 (a whole block's tokens).
* Request-level KDA view: per position j and block b, one descriptor per KDA read of the mapping
  (conv sub-projections Q, K, V and the recurrent state, each a separate part).

Descriptor ids: [all MLA | all KDA], each position-major, then block, then sub-block/part. Both sides
are prepared once (`prep_xfer_dlist`) and a request only picks ids, so per request the cost is the
id lists plus one `make_prepped_xfer`; NIXL merges descriptors that happen to be contiguous.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

from k3serve.common.pd_geometry import RankMapping, SideGeometry

VIEWS = ("mla", "kda_conv", "kda_ssm")  # metric label values (k3serve_kv_transfer_bytes{view})


@dataclass(frozen=True)
class PageGeometry:
    """One side's registered page pool, as exchanged in the handshake (`layout` JSON)."""

    num_blocks: int
    page_bytes: int
    block_size: int
    groups: tuple[tuple[str, int], ...]  # per cache group: (kind, number of layer positions it uses)
    mla_token_bytes: int
    mla_page_used: int
    kda_heads: int  # all ranks
    kda_head_dim: int
    conv_width: int
    conv_item: int
    ssm_item: int
    ssm_offset: int
    kda_page_used: int
    tp_size: int = 1
    tp_rank: int = 0

    @classmethod
    def of(cls, layout, num_blocks: int, tp_size: int = 1, tp_rank: int = 0) -> PageGeometry:
        """From a CacheLayout (per rank: its KDA heads are this rank's shard)."""
        h, d, _ = layout.ssm_shape
        item = lambda dt: _itemsize(dt)  # noqa: E731
        return cls(
            num_blocks=num_blocks, page_bytes=layout.page_bytes, block_size=layout.block_size,
            groups=tuple((g.kind, len(g.layer_ids)) for g in layout.groups),
            mla_token_bytes=layout.mla_token_elems * item(layout.mla_dtype), mla_page_used=layout.mla_page_used,
            kda_heads=h * tp_size, kda_head_dim=d, conv_width=layout.conv_width, conv_item=item(layout.conv_dtype),
            ssm_item=item(layout.ssm_dtype), ssm_offset=layout.ssm_offset, kda_page_used=layout.kda_page_used,
            tp_size=tp_size, tp_rank=tp_rank)

    def side(self) -> SideGeometry:
        return SideGeometry(self.tp_size, self.block_size, self.kda_heads, self.kda_head_dim, self.conv_width,
                            self.conv_item, self.ssm_item, self.ssm_offset, self.mla_token_bytes)

    @property
    def has_kda(self) -> bool:
        return any(k == "kda" for k, _ in self.groups)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PageGeometry:
        d = json.loads(text)
        d["groups"] = tuple((k, int(n)) for k, n in d["groups"])
        return cls(**d)

    def positions(self, kind: str) -> int:
        """Layer positions any group of `kind` uses (the page tensors that view spans)."""
        return max((n for k, n in self.groups if k == kind), default=0)


def _itemsize(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def _view_of(part: str) -> str:
    return "kda_ssm" if part == "ssm" else "kda_conv"


class DescriptorSide:
    """One side's descriptor array (Nx3 uint64: addr, len, dev) and its id arithmetic.

    `local=True`: the decode side (MLA sub-blocks at ratio r, KDA reads' destinations);
    `local=False`: the prefill side (r = 1, KDA reads' sources). One side per prefill rank read from
    (`src_rank`): its KDA parts only, and the MLA view only on the rank MLA is read from (`with_mla`;
    the latent is replicated, §5.4)."""

    def __init__(self, geom: PageGeometry, bases: list[int], mapping: RankMapping, sub_bytes: int, *, local: bool,
                 src_rank: int = 0, with_mla: bool = True):
        self.geom = geom
        self.r = mapping.block_ratio if local else 1
        self.sub_bytes = sub_bytes
        reads = [rd for rd in mapping.kda_reads if rd.src_rank == src_rank]
        self.parts = [(rd.part, rd.dst_offset if local else rd.src_offset, rd.nbytes) for rd in reads]
        self.n_mla_pos = geom.positions("mla") if with_mla else 0
        self.n_kda_pos = geom.positions("kda")
        nb, pb = geom.num_blocks, geom.page_bytes
        chunks = []
        if self.n_mla_pos:
            blk = np.arange(nb, dtype=np.uint64)[:, None] * np.uint64(pb) + \
                np.arange(self.r, dtype=np.uint64)[None, :] * np.uint64(sub_bytes)
            for j in range(self.n_mla_pos):
                addr = (np.uint64(bases[j]) + blk).reshape(-1)
                chunks.append(np.stack([addr, np.full_like(addr, sub_bytes), np.zeros_like(addr)], axis=1))
        self.n_mla = self.n_mla_pos * nb * self.r
        if self.n_kda_pos and self.parts:
            offs = np.array([o for _, o, _ in self.parts], dtype=np.uint64)
            lens = np.array([n for _, _, n in self.parts], dtype=np.uint64)
            blk = np.arange(nb, dtype=np.uint64)[:, None] * np.uint64(pb) + offs[None, :]
            for j in range(self.n_kda_pos):
                addr = (np.uint64(bases[j]) + blk).reshape(-1)
                chunks.append(np.stack([addr, np.tile(lens, nb), np.zeros_like(addr)], axis=1))
        self.descs = np.concatenate(chunks) if chunks else np.zeros((0, 3), dtype=np.uint64)

    def mla_id(self, pos: int, block: int, sub: int = 0) -> int:
        return (pos * self.geom.num_blocks + block) * self.r + sub

    def kda_id(self, pos: int, block: int, part: int) -> int:
        return self.n_mla + (pos * self.geom.num_blocks + block) * len(self.parts) + part


@dataclass
class RequestPlan:
    """The descriptor ids of one request's pull, and what it moves."""

    local_ids: np.ndarray
    remote_ids: np.ndarray
    bytes_by_view: dict[str, int]

    @property
    def num_descriptors(self) -> int:
        return len(self.local_ids)


def plan_request(local: DescriptorSide, remote: DescriptorSide, groups, mla_pairs: dict[int, list[tuple[int, int, int]]],
                 kda_pairs: dict[int, tuple[int, int]]) -> RequestPlan:
    """`groups`: the layout's groups ((kind, n positions) per group id); `mla_pairs[g]`: (prefill block,
    decode block, sub-block) per pulled prefill block; `kda_pairs[g]`: (prefill state block, decode block)."""
    lids, rids = [], []
    nbytes = dict.fromkeys(VIEWS, 0)
    for gid, (kind, npos) in enumerate(groups):
        if kind == "mla":
            pairs = mla_pairs.get(gid, [])
            for j in range(npos):
                for p, d, k in pairs:
                    lids.append(local.mla_id(j, d, k))
                    rids.append(remote.mla_id(j, p))
            nbytes["mla"] += npos * len(pairs) * local.sub_bytes
        elif gid in kda_pairs:
            p, d = kda_pairs[gid]
            for j in range(npos):
                for i, (part, _off, n) in enumerate(local.parts):
                    lids.append(local.kda_id(j, d, i))
                    rids.append(remote.kda_id(j, p, i))
                    nbytes[_view_of(part)] += n
    return RequestPlan(np.asarray(lids, dtype=np.int64), np.asarray(rids, dtype=np.int64), nbytes)


def zero_unreceived(pages, geom: PageGeometry, local, mla_loaded: dict[int, list[int]],
                    received_tokens: int, kda_blocks: dict[int, int]) -> int:
    """§5.5: zero every byte of the loaded pages that the pull did not write; returns the bytes zeroed.

    `mla_loaded[g]`: the decode blocks the load covers (from a block boundary on), of which
    the first `received_tokens` tokens were received; every later token of those pages, their page
    padding, and every later block in the list are zeroed. `kda_blocks[g]`: the state block, of which
    only the mapped parts were received: those of every side in `local` (a DescriptorSide, or one per
    prefill rank read from)."""
    zeroed = 0
    B, tok = geom.block_size, geom.mla_token_bytes
    for gid, blocks in mla_loaded.items():
        npos = geom.groups[gid][1]
        for i, b in enumerate(blocks):
            lo_tok = min(max(received_tokens - i * B, 0), B)
            lo = lo_tok * tok
            if lo >= geom.page_bytes:
                continue
            for j in range(npos):
                pages[j][b, lo:].zero_()
            zeroed += npos * (geom.page_bytes - lo)
    if kda_blocks:
        sides = local if isinstance(local, (list, tuple)) else [local]
        spans = sorted((o, o + n) for side in sides for _, o, n in side.parts)
        gaps, at = [], 0
        for lo, hi in spans:
            if lo > at:
                gaps.append((at, lo))
            at = max(at, hi)
        if at < geom.page_bytes:
            gaps.append((at, geom.page_bytes))
        for gid, b in kda_blocks.items():
            npos = geom.groups[gid][1]
            for j in range(npos):
                for lo, hi in gaps:
                    pages[j][b, lo:hi].zero_()
                    zeroed += hi - lo
    return zeroed
