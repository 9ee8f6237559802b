"""Which layouts can shard a model, and each rank's config and weight shard (one checkpoint, any rank count).

    check_layout(cfg, args)                      # ValueError naming every reason, before any rank starts
    plan = ShardPlan.make(cfg, rank, tp, expert_parallel)
    rank_cfg, shard = shard_weights(cfg, weights, plan, dtype)

Slicing (canonical names of workers/model/spec.py; "rows" = dim 0, "cols" = dim 1):
* KDA, by head: q/k/v/g/f_b/g_b projections, b_proj, the q/k/v conv weights, A_log, dt_bias by rows;
  o_proj by cols; f_a_proj, g_a_proj, o_norm replicated. The conv and recurrent state of a rank then hold
  its heads only (its KDA page is 1/tp of the single-rank page: workers/engine/cache_layout.py tp_size).
* MLA, by head: q_proj or q_b_proj, kv_b_proj, g_proj by rows; o_proj by cols; the latent path
  (q_a_proj, kv_a_proj_with_mqa and their norms) replicated, so every rank writes the same latent cache.
* Dense MLP and shared experts: gate/up by rows (column-parallel), down by cols (row-parallel); under
  sequence parallelism the shared experts are replicated (they run on each token's own rank).
* Routed experts: tensor parallel = each expert's intermediate slice (w13's gate and up halves by rows,
  w2 by cols); expert parallel = whole experts, rank r holding `ExpertMap.physical[r]`. The router, the
  latent down/up projections and the latent norm are replicated.
* Embedding and LM head: vocab-parallel, the vocabulary padded to a multiple of tp with zero rows.
MXFP4 experts are dequantized before slicing (the CPU path computes with dense experts anyway), and
MTP layers are dropped (the engine's forward does not run them).

`selection(cfg, plan, name, shape)` states these rules once: `shard_weights` cuts full tensors with it and
`load_shard` reads only those slices from the checkpoint (workers/model/loader.py `keep=`: safetensors
get_slice), so a spawned rank never holds the whole model. MXFP4 experts are cut packed (output rows of
w13; whole experts under EP; w2's input columns when each rank's share is a whole number of 32-element
scale blocks, else w2 is read whole, dequantized, then cut).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from k3serve.workers.model.loader import Selection, apply_selection

_KDA_ROWS = ("q_proj", "k_proj", "v_proj", "g_proj", "f_b_proj", "g_b_proj", "b_proj",
             "q_conv1d", "k_conv1d", "v_conv1d")
_MLA_ROWS = ("q_proj", "q_b_proj", "kv_b_proj", "g_proj")


def check_layout(cfg, args) -> None:
    """Raise one ValueError naming every reason `args` (EngineArgs) cannot shard `cfg`, or return."""
    tp = int(getattr(args, "tensor_parallel_size", 1) or 1)
    ep = bool(getattr(args, "enable_expert_parallel", False))
    sp = bool(getattr(args, "enable_sequence_parallel", False))
    from k3serve.workers.engine.parallel.nodes import layout_problem

    nodes = layout_problem(  # the worker's own check (workers/worker.py)
        tp, int(getattr(args, "nnodes", 1) or 1), int(getattr(args, "node_rank", 0) or 0))
    if nodes:  # e.g. nnodes=2 with one rank: the same one-line error the worker gives
        raise ValueError(nodes)
    why = []
    if tp < 1:
        why.append(f"tensor_parallel_size must be >= 1 (got {tp})")
    if int(getattr(args, "data_parallel_size", 1) or 1) != 1:  # DEP layouts: dp_engine.check_dp_layout
        why.append("data_parallel_size > 1 is checked by workers/engine/parallel/dp_engine.py check_dp_layout")
    if tp > 1:
        if not str(getattr(args, "device", "cpu")).startswith("cpu"):
            why.append(f"device={args.device}: tensor parallelism runs on CPU ranks (gloo) only")
        others = [c for c in (getattr(args, "kv_connectors", None) or ()) if c != "nixl"]  # P/D: every rank's pages
        if getattr(args, "kv_offload_memory", None) or others or getattr(args, "kv_store", None):
            why.append("KV connectors (offload, store) are not implemented with tensor_parallel_size > 1 "
                       "(the P/D connector is)")
        if cfg.kda_layer_ids and cfg.kda_num_heads % tp:
            why.append(f"KDA heads ({cfg.kda_num_heads}) are not divisible by tensor_parallel_size={tp}")
        if cfg.mla_layer_ids and cfg.num_attention_heads % tp:
            why.append(f"MLA heads ({cfg.num_attention_heads}) are not divisible by tensor_parallel_size={tp}")
        dense = [i for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)]
        if dense and cfg.intermediate_size % tp:
            why.append(f"intermediate_size ({cfg.intermediate_size}) is not divisible by tensor_parallel_size={tp}")
        if cfg.moe_layer_ids:
            if sp and not ep:
                why.append("enable_sequence_parallel needs enable_expert_parallel (the MoE all-to-all moves "
                           "each token shard to whole experts)")
            if cfg.num_shared_experts and cfg.shared_intermediate_size % tp and not sp:  # SP: replicated
                why.append(f"the shared experts' intermediate size ({cfg.shared_intermediate_size}) is not "
                           f"divisible by tensor_parallel_size={tp}")
            if ep and cfg.num_experts % tp:
                why.append(f"routed experts ({cfg.num_experts}) are not divisible over {tp} expert-parallel ranks")
            if not ep and cfg.moe_intermediate_size % tp:
                why.append(f"moe_intermediate_size ({cfg.moe_intermediate_size}) is not divisible by "
                           f"tensor_parallel_size={tp} (enable_expert_parallel shards whole experts instead)")
    if why:
        raise ValueError(f"tensor_parallel_size={tp}: this layout cannot shard the model: " + "; ".join(why))


@dataclass(frozen=True)
class ExpertMap:
    """Logical expert -> (rank, physical slot). `physical[r]` lists the logical experts rank r holds, in
    slot order; the default placement is contiguous. A load balancer moves experts by building another
    map (and reloading the moved experts' weights); the forward only reads `local_index(rank)`."""

    num_experts: int
    physical: tuple[tuple[int, ...], ...]

    @classmethod
    def contiguous(cls, num_experts: int, ranks: int) -> ExpertMap:
        n = num_experts // ranks
        return cls(num_experts, tuple(tuple(range(r * n, (r + 1) * n)) for r in range(ranks)))

    def __post_init__(self):
        placed = sorted(e for p in self.physical for e in p)
        if placed != list(range(self.num_experts)):
            raise ValueError("ExpertMap: every logical expert must be placed exactly once")

    def owner(self, expert: int) -> tuple[int, int]:
        for r, p in enumerate(self.physical):
            if expert in p:
                return r, p.index(expert)
        raise KeyError(expert)

    def local_index(self, rank: int) -> torch.Tensor:
        """[num_experts] int64: the slot of each logical expert on `rank`, -1 where another rank has it."""
        m = torch.full((self.num_experts,), -1, dtype=torch.long)
        for slot, e in enumerate(self.physical[rank]):
            m[e] = slot
        return m


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    size: int
    expert_parallel: bool
    vocab_size: int  # the full vocabulary (logits are cut back to it)
    vocab_per_rank: int
    expert_map: ExpertMap | None
    sequence_parallel: bool = False  # token-sharded residual stream: workers/engine/parallel/seq_parallel.py

    @classmethod
    def make(cls, cfg, rank: int, size: int, expert_parallel: bool, sequence_parallel: bool = False) -> ShardPlan:
        ep = bool(expert_parallel and cfg.num_experts)
        return cls(rank, size, ep, cfg.vocab_size, -(-cfg.vocab_size // size),
                   ExpertMap.contiguous(cfg.num_experts, size) if ep else None, bool(sequence_parallel and size > 1))

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank


def rank_config(cfg, size: int):
    """The config one rank computes with: its share of the KDA and MLA heads (MXFP4 experts come dense)."""
    return dataclasses.replace(cfg, kda_num_heads=cfg.kda_num_heads // size,
                               num_attention_heads=cfg.num_attention_heads // size, experts_mxfp4=False)


def _chunk(n: int, plan: ShardPlan) -> tuple[int, int]:
    """Rank `plan.rank`'s [start, stop) of `n` in torch.chunk's split (equal parts when size divides n)."""
    c = -(-n // plan.size)
    return min(plan.rank * c, n), min((plan.rank + 1) * c, n)


def _span(dim: int, n: int, plan: ShardPlan) -> Selection:
    return Selection(dim=dim, spans=(_chunk(n, plan),))


WHOLE = Selection()


def selection(cfg, plan: ShardPlan, name: str, shape: tuple[int, ...]) -> Selection | None:
    """What rank `plan.rank` keeps of canonical tensor `name` (full shape `shape`); None: nothing (MTP layers).
    The one statement of the slicing rules above: shard_weights cuts full tensors with it, load_shard
    reads only it from the checkpoint."""
    if name.startswith("model.layers."):
        i = int(name.split(".")[2])
        if i >= cfg.num_hidden_layers:
            return None  # MTP layers: not run by the engine's forward
        return _layer_selection(cfg, i, name.split(".", 3)[3], shape, plan)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):  # then zero-padded to vocab_per_rank rows
        v = shape[0]
        a = min(plan.vocab_start, v)
        return Selection(dim=0, spans=((a, min(plan.vocab_start + plan.vocab_per_rank, v)),))
    return WHOLE


def _layer_selection(cfg, i: int, rest: str, shape, plan: ShardPlan) -> Selection:
    parts = rest.split(".")
    mod, leaf = parts[0], parts[1]
    if mod == "self_attn":
        rows = _KDA_ROWS + ("A_log", "dt_bias") if cfg.is_kda_layer(i) else _MLA_ROWS
        if leaf in rows:
            return _span(0, shape[0], plan)
        if leaf == "o_proj":
            return _span(1, shape[1], plan)
        return WHOLE  # the replicated pieces (f_a / g_a, o_norm; the MLA latent path)
    if mod == "block_sparse_moe" and leaf == "shared_experts" and plan.sequence_parallel:
        return WHOLE  # sequence parallel: the shared experts run whole on each token's own rank
    if mod == "mlp" or (mod == "block_sparse_moe" and leaf == "shared_experts"):
        proj = parts[-2]
        if proj in ("gate_proj", "up_proj"):
            return _span(0, shape[0], plan)
        if proj == "down_proj":
            return _span(1, shape[1], plan)
        return WHOLE
    if mod == "block_sparse_moe" and leaf == "experts":
        which = parts[2]
        if plan.expert_parallel:
            return Selection(experts=tuple(plan.expert_map.physical[plan.rank]))
        if which in ("w13_packed", "w13_scale"):
            which = "w13"  # MXFP4 packs along the input dim: output rows cut as the dense tensor's
        elif which in ("w2_packed", "w2_scale"):  # [E, Dout, I/2] nibble pairs, [E, Dout, I/32] block scales
            if not _mxfp4_cols_sliceable(cfg, plan):
                return WHOLE  # read whole, dequantized, then cut as the dense tensor below
            per = 2 if which == "w2_packed" else 32
            (a, b), = _span(2, shape[2] * per, plan).spans
            return Selection(dim=2, spans=((a // per, b // per),))
        if which == "w13":  # [E, 2I, Din]: gate rows then up rows, each sliced
            half = shape[1] // 2
            (a, b), = _span(1, half, plan).spans
            return Selection(dim=1, spans=((a, b), (half + a, half + b)))
        if which == "w2":  # [E, Dout, I]
            return _span(2, shape[2], plan)
        raise ValueError(f"unexpected expert tensor {rest!r}")
    return WHOLE  # norms, AttnRes, router, latent projections: replicated


def _mxfp4_cols_sliceable(cfg, plan: ShardPlan) -> bool:
    """Whether each rank's share of the MXFP4 w2 input dim starts and ends on a 32-element scale block."""
    inter = cfg.moe_intermediate_size
    return inter % plan.size == 0 and (inter // plan.size) % 32 == 0


def shard_weights(cfg, weights: dict[str, torch.Tensor], plan: ShardPlan, dtype: torch.dtype, *,
                  presliced: bool = False):
    """(rank config, this rank's weight dict) from the full canonical weights, or from the `presliced` ones
    load_shard read (then only the vocabulary padding and the MXFP4 experts read whole remain to do)."""
    fresh: set[str] = set()
    if cfg.experts_mxfp4:
        from k3serve.workers.model.reference import dequantize_experts

        dense = dequantize_experts(weights, dtype)
        fresh = set(dense) - set(weights)
        weights = dense
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        sel = selection(cfg, plan, name, tuple(t.shape))
        if sel is None:
            continue
        cut_dense = name in fresh and not plan.expert_parallel and name.endswith("experts.w2") and \
            not _mxfp4_cols_sliceable(cfg, plan)  # MXFP4 w2 read whole (see _layer_selection)
        if not presliced or cut_dense:
            t = apply_selection(t, sel)  # a copy unless whole (cat / index_select)
        if name in ("model.embed_tokens.weight", "lm_head.weight") and t.shape[0] < plan.vocab_per_rank:
            t = torch.cat([t, t.new_zeros(plan.vocab_per_rank - t.shape[0], t.shape[1])])
        out[name] = t
    return rank_config(cfg, plan.size), out


def load_shard(model_dir, dtype: torch.dtype, rank: int, size: int, expert_parallel: bool,
               sequence_parallel: bool = False, stats: dict | None = None):
    """-> (config, plan, rank config, shard): rank `rank`'s weights, reading only its slices of the checkpoint
    (equal to shard_weights of the full read; `stats["bytes_read"]`: the tensor bytes read)."""
    from k3serve.workers.model.config import K3Config
    from k3serve.workers.model.loader import load_model_weights

    cfg = K3Config.from_pretrained(model_dir)
    plan = ShardPlan.make(cfg, rank, size, expert_parallel, sequence_parallel)
    cfg, weights = load_model_weights(model_dir, dtype=dtype, device="cpu",
                                      keep=lambda name, shape: selection(cfg, plan, name, shape), stats=stats)
    rank_cfg, shard = shard_weights(cfg, weights, plan, dtype, presliced=True)
    return cfg, plan, rank_cfg, shard
