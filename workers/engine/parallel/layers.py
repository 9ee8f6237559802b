"""ParallelK3ForwardModel: the engine's K3 forward (workers/engine/k3_forward.py) on one rank of a TP group.

The rank computes with its shard (workers/engine/parallel/shard.py) and `rank_config` (its share of the
heads), so the inherited layer code runs unchanged on local shapes; this class adds the collectives:

* embedding (vocab-parallel): each rank looks up the ids in its vocabulary slice, zeros elsewhere, and
  one all-reduce sums the rows; LM head: each rank's logits slice, one all-gather, cut to the vocabulary;
* attention (KDA and MLA, head-sharded, o_proj row-parallel): one all-reduce of the output;
* dense MLP (column- then row-parallel): one all-reduce;
* MoE: the router and the latent down-projection run replicated (every rank has every token), each
  rank computes the routed experts it holds (expert parallel: whole experts through the logical ->
  physical map, ids of other ranks' experts become -1 and are skipped; tensor parallel: every expert's
  intermediate slice) and its slice of the shared experts; ONE all-reduce of [latent partial | shared
  partial] combines both, and then the latent norm and the up-projection run replicated. With the
  tokens already replicated by TP attention, the dispatch of expert parallelism is the identity and its
  combine is this all-reduce. The all-to-all form (workers/engine/parallel/moe_a2a.py) applies once the
  tokens are sharded: sequence-parallel TEP (workers/engine/parallel/seq_parallel.py, a subclass of this
  one) and data-parallel attention (workers/engine/parallel/dp_model.py).
"""

from __future__ import annotations

import torch

from k3serve.kernels import ops
from k3serve.workers.engine.k3_forward import K3ForwardModel
from k3serve.workers.engine.parallel.group import RankGroup
from k3serve.workers.engine.parallel.shard import ShardPlan
from k3serve.workers.model.functional import LayerWeights, linear


class ParallelK3ForwardModel(K3ForwardModel):
    fuses_shared_experts = False  # its experts and shared experts are sharded, and its `_moe` is its own

    def __init__(self, config, weights, layout, kv, dtype, *, group: RankGroup, plan: ShardPlan):
        self.group = group
        self.plan = plan
        self.expert_index = plan.expert_map.local_index(plan.rank) if plan.expert_parallel else None
        super().__init__(config, weights, layout, kv, dtype)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.w["model.embed_tokens.weight"]
        local = ids - self.plan.vocab_start
        mine = (local >= 0) & (local < w.shape[0])
        rows = w[local.clamp(0, w.shape[0] - 1)].to(self.dtype)
        return self.group.all_reduce(torch.where(mine[:, None], rows, torch.zeros((), dtype=self.dtype)))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_cat(super()._logits(h), dim=-1)[:, : self.plan.vocab_size]

    def _attn(self, i: int, x: torch.Tensor, b) -> torch.Tensor:
        return self.group.all_reduce(super()._attn(i, x, b))

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.is_moe_layer(i):
            return self._moe(i, x)
        return self.group.all_reduce(super()._mlp(i, x))

    def _moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        w = LayerWeights(self.w, f"model.layers.{i}.block_sparse_moe.")
        weights, ids = self._route(w, linear(x.to(self.acc), self.acc_w[w.prefix + "gate.weight"]))
        z, parts = self._expert_input(w, x)
        if self.expert_index is not None:  # logical -> this rank's physical slot, -1: another rank's expert
            ids = torch.where(ids >= 0, self.expert_index[ids.clamp(min=0)], -1)
        r = ops.moe_experts(z, weights, ids, w13=w["experts.w13"], w2=w["experts.w2"], **self._act)
        shared = self._dense_mlp(w.sub("shared_experts."), parts[0]) if cfg.num_shared_experts else None
        if shared is not None and cfg.routed_expert_hidden_size:
            both = self.group.all_reduce(torch.cat([r, shared.to(r.dtype)], dim=-1))
            r, shared = both[:, : r.shape[1]], both[:, r.shape[1]:]
        elif shared is not None:
            return self.group.all_reduce(r + shared)
        else:
            r = self.group.all_reduce(r)
        r = self._latent_up(w, r)
        return r if shared is None else r + shared
