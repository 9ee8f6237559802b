"""Prefill → decode state geometry: which bytes of which prefill rank each decode rank reads.

One pure function, `plan_pd_mapping(prefill, decode, decode_rank)`, used by the NIXL connector at
run time (workers/kv_transfer/) and, through `pd_geometry_problem`, by the operator's CR-time check.
Design doc §5.4 (heterogeneous TP) and §5.5 (block sizes):

* Block sizes: r = decode_block / prefill_block must be a whole number ≥ 1. Decode block i, sub-block
  k (tokens [i·Bd + k·Bp, i·Bd + (k+1)·Bp)) is the prefill block i·r + k of the same request.
* MLA: the latent is replicated over TP ranks, so decode rank d reads all of its pages from one prefill
  rank (d·P/D when decode has more ranks, d·|t| when prefill has more), no head offset.
* KDA: heads are sharded. A KDA page holds the conv state ([3P, K-1], "DS": the Q, K and V channel
  blocks one after another, each contiguous) and, at `ssm_offset`, the recurrent state [h, d, d] (heads
  outermost, so a run of heads is contiguous). With t = D_TP / P_TP:
  - t ≥ 1: decode rank d reads slice s = d mod t of prefill rank d // t's page: conv part j at
    j·size_j(P) + s·size_j(D), the state at ssm_offset(P) + s·ssm_bytes(D);
  - P_TP = m·D_TP: decode rank d reads the whole pages of prefill ranks d·m .. d·m + m-1, page i filling
    the i-th 1/m of every local part.
  Any other pair of TP sizes, or head counts the sizes do not divide, cannot be mapped: PDGeometryError.
"""

from __future__ import annotations

from dataclasses import dataclass

CONV_PARTS = ("q", "k", "v")


class PDGeometryError(ValueError):
    """The prefill and decode layouts cannot be mapped onto each other (the message says why)."""


@dataclass(frozen=True)
class SideGeometry:
    """One pool's per-rank state geometry (bytes), as its cache layout computes it."""

    tp_size: int
    block_size: int  # tokens per block
    kda_heads: int  # the model's KDA heads (all ranks)
    kda_head_dim: int
    conv_width: int  # K - 1
    conv_item: int  # bytes per conv-state element
    ssm_item: int  # bytes per recurrent-state element
    ssm_offset: int  # byte offset of the recurrent state inside a KDA page
    mla_token_bytes: int  # bytes of one token of one MLA layer (latent + rope)

    @property
    def local_heads(self) -> int:
        return self.kda_heads // self.tp_size

    @property
    def conv_part_bytes(self) -> int:
        """Bytes of one conv sub-projection (Q, K or V) of one rank's page."""
        return self.local_heads * self.kda_head_dim * self.conv_width * self.conv_item

    @property
    def ssm_bytes(self) -> int:
        return self.local_heads * self.kda_head_dim * self.kda_head_dim * self.ssm_item


@dataclass(frozen=True)
class KdaRead:
    """One contiguous read of a KDA page part: `nbytes` at `src_offset` of prefill rank `src_rank`'s page
    to `dst_offset` of the decode rank's page."""

    part: str  # "q" | "k" | "v" | "ssm"
    src_rank: int
    src_offset: int
    dst_offset: int
    nbytes: int


@dataclass(frozen=True)
class RankMapping:
    decode_rank: int
    block_ratio: int  # r = decode block / prefill block
    mla_src_rank: int
    kda_src_ranks: tuple[int, ...]
    kda_reads: tuple[KdaRead, ...]  # grouped by source rank, parts in page order

    def mla_block_pairs(self, prefill_blocks: list[int], decode_blocks: list[int]) -> list[tuple[int, int, int]]:
        """(prefill block, decode block, sub-block k) for each prefill block of one request, in order;
        the decode list must hold at least ceil(len(prefill_blocks) / r) blocks."""
        r = self.block_ratio
        if len(decode_blocks) * r < len(prefill_blocks):
            raise PDGeometryError(f"{len(decode_blocks)} decode blocks cannot hold {len(prefill_blocks)} "
                                  f"prefill blocks at ratio {r}")
        return [(p, decode_blocks[q // r], q % r) for q, p in enumerate(prefill_blocks)]


def _check_side(name: str, g: SideGeometry) -> None:
    if g.tp_size < 1 or g.block_size < 1:
        raise PDGeometryError(f"{name}: tensor-parallel size and block size must be positive "
                              f"(got {g.tp_size}, {g.block_size})")
    if g.kda_heads % g.tp_size:
        raise PDGeometryError(f"{name}: tensor-parallel size {g.tp_size} does not divide the {g.kda_heads} "
                              "KDA heads")


def plan_pd_mapping(prefill: SideGeometry, decode: SideGeometry, decode_rank: int) -> RankMapping:
    """What decode rank `decode_rank` reads from which prefill rank; PDGeometryError when unmappable."""
    _check_side("prefill", prefill)
    _check_side("decode", decode)
    if not 0 <= decode_rank < decode.tp_size:
        raise PDGeometryError(f"decode rank {decode_rank} is outside 0..{decode.tp_size - 1}")
    for field in ("kda_heads", "kda_head_dim", "conv_width", "conv_item", "ssm_item", "mla_token_bytes"):
        if getattr(prefill, field) != getattr(decode, field):
            raise PDGeometryError(f"{field} differs: prefill {getattr(prefill, field)}, decode "
                                  f"{getattr(decode, field)} (the two pools must serve the same model and dtypes)")
    if decode.block_size % prefill.block_size:
        raise PDGeometryError(
            f"decode block size {decode.block_size} is not a whole multiple of prefill block size "
            f"{prefill.block_size}: a decode block must hold a whole number of prefill blocks")
    r = decode.block_size // prefill.block_size
    P, D = prefill.tp_size, decode.tp_size
    reads: list[KdaRead] = []
    if D % P == 0:  # t >= 1: one prefill page, my slice of its heads
        t = D // P
        src, s = decode_rank // t, decode_rank % t
        part_d, part_p = decode.conv_part_bytes, prefill.conv_part_bytes
        for j, name in enumerate(CONV_PARTS):
            reads.append(KdaRead(name, src, j * part_p + s * part_d, j * part_d, part_d))
        reads.append(KdaRead("ssm", src, prefill.ssm_offset + s * decode.ssm_bytes, decode.ssm_offset,
                             decode.ssm_bytes))
        srcs = (src,)
        mla_src = src
    elif P % D == 0:  # prefill has m times the ranks: m whole pages fill my page
        m = P // D
        srcs = tuple(range(decode_rank * m, (decode_rank + 1) * m))
        part_d, part_p = decode.conv_part_bytes, prefill.conv_part_bytes
        for i, src in enumerate(srcs):
            for j, name in enumerate(CONV_PARTS):
                reads.append(KdaRead(name, src, j * part_p, j * part_d + i * part_p, part_p))
            reads.append(KdaRead("ssm", src, prefill.ssm_offset, decode.ssm_offset + i * prefill.ssm_bytes,
                                 prefill.ssm_bytes))
        mla_src = srcs[0]
    else:
        raise PDGeometryError(
            f"prefill tensor-parallel size {P} and decode tensor-parallel size {D} do not divide one another: "
            "KDA state is sharded by heads, so one side's head shards must be whole multiples of the other's")
    return RankMapping(decode_rank, r, mla_src, srcs, tuple(reads))


def pd_geometry_problem(prefill_tp: int, decode_tp: int, kda_heads: int, prefill_block: int | None = None,
                        decode_block: int | None = None) -> str | None:
    """The CR-time form (operator): None when every decode rank can be mapped, else the reason.

    Byte sizes do not decide mappability, so unit sizes stand in for them; a block size that is not
    set (derived by the engine at run time) is checked at run time instead.
    """
    both = prefill_block is not None and decode_block is not None
    pb, db = (prefill_block, decode_block) if both else (1, 1)
    ssm = lambda tp: (kda_heads // tp if tp and kda_heads % tp == 0 else 1)  # noqa: E731
    try:
        for rank in range(max(decode_tp, 1)):
            plan_pd_mapping(
                SideGeometry(prefill_tp, pb, kda_heads, 1, 1, 1, 1, 3 * ssm(prefill_tp), 1),
                SideGeometry(decode_tp, db, kda_heads, 1, 1, 1, 1, 3 * ssm(decode_tp), 1), rank)
    except PDGeometryError as e:
        return str(e)
    return None
