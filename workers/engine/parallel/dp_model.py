"""DEP: the engine's K3 forward on one data-parallel rank, with the routed experts expert-parallel.

Attention, embedding, LM head, dense MLPs, shared experts, the router and the latent down/up projections
run at TP=1 on the rank's own tokens (its own requests); only the routed experts are sharded over the M
data-parallel ranks (whole experts: rank r holds `ExpertMap.physical[r]`, workers/engine/parallel/shard.py).
So the one place the ranks meet is each MoE layer's expert computation, and every rank must take part in
every forward pass: one with no tokens of its own runs `idle()` (no cache is read or written) and still
computes its experts for the other ranks' tokens.

Dispatch and combine: workers/engine/parallel/moe_a2a.py (ragged all-to-all: each token goes once to every
rank holding one of its top-k experts, through the logical -> physical ExpertMap, and its weighted results
come back), so token counts may differ per rank and be 0.
"""

from __future__ import annotations

import dataclasses

import torch

from k3serve.kernels import ops
from k3serve.workers.engine.k3_forward import K3ForwardModel
from k3serve.workers.engine.parallel.group import RankGroup
from k3serve.workers.engine.parallel.moe_a2a import combine, dispatch
from k3serve.workers.engine.parallel.shard import ExpertMap
from k3serve.workers.model.functional import LayerWeights, linear


def dep_shard(cfg, weights: dict[str, torch.Tensor], rank: int, size: int, dtype: torch.dtype):
    """(rank config, this rank's weights, expert map): every weight replicated but the routed experts,
    of which the rank keeps its own (MXFP4 experts are dequantized first, as the CPU forward does)."""
    if cfg.experts_mxfp4:
        from k3serve.workers.model.reference import dequantize_experts

        weights = dequantize_experts(weights, dtype)
    emap = ExpertMap.contiguous(cfg.num_experts, size)
    mine = torch.tensor(emap.physical[rank], dtype=torch.long)
    out = {}
    for name, t in weights.items():
        if ".block_sparse_moe.experts." in name:
            t = t.index_select(0, mine).contiguous()
        out[name] = t
    return dataclasses.replace(cfg, experts_mxfp4=False), out, emap


class DEPForwardModel(K3ForwardModel):
    fuses_shared_experts = False  # its experts are split over the ranks, and its `_moe` is its own

    def __init__(self, config, weights, layout, kv, dtype, *, group: RankGroup, expert_map: ExpertMap):
        self.group = group
        self.expert_map = expert_map
        super().__init__(config, weights, layout, kv, dtype)

    @torch.inference_mode()
    def idle(self) -> None:
        """A forward pass with no tokens of this rank: only the MoE layers' expert work for the others."""
        cfg = self.cfg
        din = cfg.routed_expert_hidden_size or cfg.hidden_size
        k = cfg.num_experts_per_token
        for i in range(cfg.num_hidden_layers):
            if cfg.is_moe_layer(i):
                w = LayerWeights(self.w, f"model.layers.{i}.block_sparse_moe.")
                self._routed(w, torch.zeros(0, din, dtype=self.dtype), torch.zeros(0, k, dtype=self.acc),
                             torch.zeros(0, k, dtype=torch.long))

    def _routed(self, w: LayerWeights, z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every routed expert's share for this rank's tokens `z` [T, D] (ids: logical experts)."""
        d = dispatch(self.group, z, weights, ids, self.expert_map)
        return combine(self.group, d, ops.moe_experts(d.tokens, d.weights, d.slots, w13=w["experts.w13"],
                                                      w2=w["experts.w2"], **self._act))

    def _moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """K3ForwardModel._moe with the routed experts through `_routed`."""
        cfg = self.cfg
        w = LayerWeights(self.w, f"model.layers.{i}.block_sparse_moe.")
        weights, ids = self._route(w, linear(x.to(self.acc), self.acc_w[w.prefix + "gate.weight"]))
        z, parts = self._expert_input(w, x)
        r = self._latent_up(w, self._routed(w, z, weights, ids))
        if cfg.num_shared_experts:
            r = r + self._dense_mlp(w.sub("shared_experts."), parts[0])
        return r
