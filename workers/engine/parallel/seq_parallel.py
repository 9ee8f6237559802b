"""Sequence-parallel TEP: tensor-parallel attention, expert-parallel MoE, each rank owning a token shard.

`SequenceParallelK3ForwardModel` is the TP model (workers/engine/parallel/layers.py) with the residual
stream sharded by token between the attention layers (EngineArgs.enable_sequence_parallel, with
tensor_parallel_size > 1 and enable_expert_parallel):

* the batch's T tokens are padded to Tp = N·s (s = ceil(T / N)); rank r owns rows [r·s, (r+1)·s), the
  pad rows (global index >= T) only on the last ranks;
* embedding (vocab-parallel): a reduce-scatter of the masked rows instead of the all-reduce;
* attention: ONE all-gather of the normed shard restores the full batch (cut back to T rows, so pad rows
  never reach a projection that writes a cache) before the head-sharded QKV projection, and after
  o_proj a reduce-scatter (instead of the all-reduce) returns the rank's shard of the sum;
* Block AttnRes runs per shard (`partial`, `delta` and the block sums `blocks` of the forward in
  workers/engine/k3_forward.py hold the shard's rows only), as do the norms and the residual adds;
* MoE: router, latent down-projection, latent norm and up-projection on the shard's rows (replicated
  weights), the routed experts through the all-to-all of workers/engine/parallel/moe_a2a.py (pad rows are
  routed nowhere), the shared experts on the token's own rank (their weights are replicated under
  sequence parallelism, shard.py: memory for no communication);
* a dense MLP layer: all-gather, column/row-parallel MLP, reduce-scatter (the volume of one all-reduce);
* the LM head: each rank contributes the final-normed rows it owns among `logits_indices` (zeros
  elsewhere), one all-reduce of [S, H] assembles them, then the vocab-parallel head as in TP.

A step with fewer tokens than ranks (a small decode batch: some ranks would own only pad rows, and the
step's latency is the number of collectives, not their bytes) runs the replicated TP step instead
(layers.py: all-reduces), its MoE through the local experts and one all-reduce of the routed partial
(the shared experts, replicated, are added after it).

The inherited forward runs unchanged: it sees a batch whose `logits_indices` are all of its local rows,
and the overrides below add the collectives. Float64 sums differ from the single-rank forward only in
the order of additions (greedy tokens are compared in tests/test_parallel_sp.py).
"""

from __future__ import annotations

import dataclasses

import torch

from k3serve.kernels import ops
from k3serve.workers.engine.k3_forward import K3ForwardModel
from k3serve.workers.engine.parallel.layers import ParallelK3ForwardModel
from k3serve.workers.engine.parallel.moe_a2a import combine, dispatch
from k3serve.workers.model.functional import LayerWeights, linear


class SequenceParallelK3ForwardModel(ParallelK3ForwardModel):
    def __init__(self, config, weights, layout, kv, dtype, *, group, plan):
        if not plan.expert_parallel and config.moe_layer_ids:
            raise ValueError("sequence parallelism needs expert parallelism for the MoE layers")
        super().__init__(config, weights, layout, kv, dtype, group=group, plan=plan)
        self._T = self._s = 0
        self._logits_indices = None
        self._sharded = True  # this step: token shards (else the replicated TP step)

    # -- the token shard ------------------------------------------------------------------------
    def _pad(self, t: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [Tp, ...] with zero rows appended."""
        extra = self._s * self.group.size - t.shape[0]
        return torch.cat([t, t.new_zeros((extra, *t.shape[1:]))]) if extra else t

    def _scatter(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum of the ranks' [T, H] partials, this rank's shard [s, H] of it."""
        return self.group.reduce_scatter(self._pad(partial))

    def _gather(self, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's shard, the full [Tp, H] batch (pad rows last)."""
        return self.group.all_gather_cat(shard, dim=0)

    @torch.inference_mode()
    def forward(self, b):
        T = b.input_ids.shape[0]
        self._sharded = T >= self.group.size
        if not self._sharded:
            return super().forward(b)
        self._T, self._s = T, -(-T // self.group.size)
        self._logits_indices = b.logits_indices
        local = dataclasses.replace(b, logits_indices=torch.arange(self._s, device=b.logits_indices.device))
        return super().forward(local)

    # -- the layers -----------------------------------------------------------------------------
    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if not self._sharded:
            return super()._embed(ids)
        w = self.w["model.embed_tokens.weight"]
        local = ids - self.plan.vocab_start
        mine = (local >= 0) & (local < w.shape[0])
        rows = w[local.clamp(0, w.shape[0] - 1)].to(self.dtype)
        return self._scatter(torch.where(mine[:, None], rows, torch.zeros((), dtype=self.dtype)))

    def _attn(self, i: int, x: torch.Tensor, b) -> torch.Tensor:
        if not self._sharded:
            return super()._attn(i, x, b)
        return self._scatter(K3ForwardModel._attn(self, i, self._gather(x)[: self._T], b))

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.is_moe_layer(i):
            return self._moe(i, x)
        if not self._sharded:
            return super()._mlp(i, x)
        return self.group.reduce_scatter(K3ForwardModel._mlp(self, i, self._gather(x)))

    def _moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        w = LayerWeights(self.w, f"model.layers.{i}.block_sparse_moe.")
        weights, ids = self._route(w, linear(x.to(self.acc), self.acc_w[w.prefix + "gate.weight"]))
        z, parts = self._expert_input(w, x)
        ex = dict(w13=w["experts.w13"], w2=w["experts.w2"], **self._act)
        if self._sharded:
            real = self._T - self.group.rank * self._s  # rows of this shard below T (the rest are pad)
            if real < x.shape[0]:
                ids = ids.clone()
                ids[max(real, 0):] = -1
            d = dispatch(self.group, z, weights, ids, self.plan.expert_map)
            r = combine(self.group, d, ops.moe_experts(d.tokens, d.weights, d.slots, **ex))
        else:  # replicated tokens: this rank's experts (logical -> its slots, -1 elsewhere), one all-reduce
            ids = torch.where(ids >= 0, self.expert_index[ids.clamp(min=0)], -1)
            r = self.group.all_reduce(ops.moe_experts(z, weights, ids, **ex))
        r = self._latent_up(w, r)
        if cfg.num_shared_experts:
            r = r + self._dense_mlp(w.sub("shared_experts."), parts[0])
        return r

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """`h` [s, H]: this rank's final-normed rows; the rows of `logits_indices`, assembled, to the head."""
        if not self._sharded:
            return super()._logits(h)
        idx = self._logits_indices
        owner, row = idx // self._s, idx % self._s
        mine = owner == self.group.rank
        rows = h.new_zeros((idx.shape[0], h.shape[1]))
        rows[mine] = h[row[mine]]
        return super()._logits(self.group.all_reduce(rows))
