"""Exact KDA rollback for speculative decoding: the interface both schemes implement, and multi-slot.

A decode request with k drafts is verified as ONE chunk of T = 1 + k tokens (the last sampled token,
then the drafts) in the step's forward pass, batched with other requests' decodes and prefills. The
KDA layers advance their recurrent state and conv window over all T tokens, but only the first
`accepted_len` = 1 + (accepted drafts) of them are kept, so the state after exactly `accepted_len`
tokens of the chunk must become the request's running state. How that state is kept is the rollback
scheme (docs/speculative-decoding.md, "KDA rollback"):

* `MultiSlotRollback` ("multi_slot"): `extra_slots(k) = k` private KDA pool blocks per KDA group
  per speculative request (allocated by the scheduler's coordinator, never exchanged by P/D or the
  store: `KVCacheCoordinator.block_ids` lists only the running block). The verify exports the state
  after 1, 2, .., T-1 tokens into those blocks through the in-pass checkpoint mechanism the prefix
  cache already uses (ForwardBatch.checkpoint_seq / offsets / slots, read by ops.kda_chunked and
  ops.causal_conv1d_varlen: conv window and recurrent state together); the running block ends at
  the state after all T tokens. Commit = copy the page of the accepted slot into the running block
  (nothing when every draft was accepted).
* RecoverSSM ("recover_ssm", workers/engine/spec/recover_ssm.py): `extra_slots(k) = 0`; the
  verify leaves the running block untouched (records per-token corrections and key/gate inputs in side
  buffers instead), commit folds the accepted prefix into it.

Call order, per step (the model runner, workers/engine/model_runner.py, drives it):

    scheme.begin_verify(rows, batch)      # after InputPreparer.prepare, before model.forward:
                                          #   rows: this step's VerifyRow list; may add checkpoint
                                          #   exports to `batch` or set `batch.spec.kda_mix`
    logits = model.forward(batch)         # K3ForwardModel._kda calls batch.spec.kda_mix when set
    ... the engine samples, accepts, applies stops ...
    scheme.commit(row, accepted_len, snapshots)   # per verified request that is still running
    scheme.end_verify()                   # after the last commit of the step

`commit(row, accepted_len, snapshots)`:
  * `accepted_len` in 1..row.num_tokens: tokens of the chunk whose state is kept (1 + accepted drafts);
    afterwards `row.running_slots` must hold the state after `row.start + accepted_len` tokens.
  * `snapshots`: [(offset, [block per KDA group])] for retained prefix-cache boundaries the accepted run
    crossed (row.start + 1 < row.start + offset <= row.start + accepted_len; the boundary row.start + 1
    is exported by the ordinary checkpoint path at schedule time): each block must receive the exact
    state (conv window + recurrent state) after `offset` tokens of the chunk, i.e. what the prefix
    cache would have exported without speculation. The coordinator has already keyed those blocks.
A request that finished inside its accepted run (EOS, stop id, max_tokens) gets no commit.

`kda_mix` (optional hook, for schemes that keep the verify out of the state slots): when
`batch.spec.kda_mix` is set, K3ForwardModel._kda calls

    o = kda_mix(model, i, j, gi, qkv, raw_g, b_logit, batch)

for every KDA layer i (layer position j in its group, KDA group index gi; qkv = the merged q|k|v
projection BEFORE the short conv [T, 3P]; raw_g [T, h, d] before ops.kda_gate; b_logit [T, h] before
the sigmoid) and uses the returned o [T, h, d] (the delta rule's output before o_norm) for all rows.
`default_kda_mix` below is exactly what the layer does without the hook; a scheme calls it for the
rows it does not handle itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from k3serve.kernels import ops


@dataclass
class VerifyRow:
    """One speculative request in this step's batch (plain data)."""

    request_id: str
    seq: int  # its sequence index in the ForwardBatch
    start: int  # tokens computed before this step (the chunk's first position)
    num_tokens: int  # T = 1 + number of drafts in the chunk
    running_slots: list[int]  # per KDA group: the request's running state block
    spec_slots: list[list[int]]  # per KDA group: the scheme's extra blocks (extra_slots(k) of them)


@dataclass
class SpecBatch:
    """What the forward pass needs to know about a verify step (ForwardBatch.spec)."""

    rows: list[VerifyRow]
    kda_mix: Callable | None = None
    extra: dict = field(default_factory=dict)  # a scheme's own per-step data


class RollbackScheme:
    """Base class: see the module docstring for the contract."""

    name = "base"

    def __init__(self, kv, layout, num_speculative_tokens: int, max_num_seqs: int):
        self.kv = kv  # workers/engine/cache_layout.py KVCacheTensors
        self.layout = layout
        self.k = num_speculative_tokens
        self.max_num_seqs = max_num_seqs

    @staticmethod
    def extra_slots(num_speculative_tokens: int) -> int:
        """KDA pool blocks per KDA group each speculative request holds besides its running block."""
        raise NotImplementedError

    def state_bytes(self) -> int:
        """Speculation-only KDA state memory for `max_num_seqs` speculative requests (benchmarks)."""
        raise NotImplementedError

    def begin_verify(self, rows: list[VerifyRow], batch) -> None:
        raise NotImplementedError

    def commit(self, row: VerifyRow, accepted_len: int, snapshots: list[tuple[int, list[int]]]) -> None:
        raise NotImplementedError

    def end_verify(self) -> None:
        pass


def default_kda_mix(model, i: int, j: int, gi: int, qkv: torch.Tensor, raw_g: torch.Tensor,
                    b_logit: torch.Tensor, b) -> torch.Tensor:
    """The KDA layer's short conv + gate + chunked delta rule over the whole batch (state slots and
    checkpoint exports as the batch says): o [T, h, d] in the accumulation dtype."""
    cfg = model.cfg
    w = model.w
    p = f"model.layers.{i}.self_attn."
    T = qkv.shape[0]
    h, d = cfg.kda_num_heads, cfg.kda_head_dim
    P = h * d
    ck = model._ckpt(b, gi)
    qkv = ops.causal_conv1d_varlen(qkv, model.conv_w[i], model.kv.conv_view(j), b.state_indices[gi],
                                   b.cu_seqlens, b.has_initial_state, activation="silu", **ck)
    q, k, v = (t.reshape(T, h, d) for t in qkv.split(P, dim=-1))
    g = ops.kda_gate(raw_g, w[p + "A_log"], w[p + "dt_bias"], cfg.gate_lower_bound)
    beta = torch.sigmoid(b_logit.to(model.acc))
    return ops.kda_chunked(q, k, v, g, beta, model.kv.ssm_view(j), b.state_indices[gi], b.cu_seqlens,
                           b.has_initial_state, scale=d ** -0.5, use_qk_l2norm=True, **ck)


class MultiSlotRollback(RollbackScheme):
    """Multi-slot: k extra state blocks per KDA group; the verify exports the state after each token."""

    name = "multi_slot"

    @staticmethod
    def extra_slots(num_speculative_tokens: int) -> int:
        return num_speculative_tokens

    def state_bytes(self) -> int:
        L = self.layout
        return (self.max_num_seqs * self.k * len(L.kda_groups) * L.page_bytes * L.group_size)

    def begin_verify(self, rows: list[VerifyRow], batch) -> None:
        """Add checkpoint exports: offsets 1..T-1 of each row into its spec slots (per KDA group)."""
        if not rows or not self.layout.kda_groups:
            return
        seq, off = [], []
        slots: list[list[int]] = [[] for _ in self.layout.kda_groups]
        for r in rows:
            for t in range(1, r.num_tokens):
                seq.append(r.seq)
                off.append(t)
                for gi, s in enumerate(r.spec_slots):
                    slots[gi].append(s[t - 1])
        if not seq:
            return
        dev = batch.input_ids.device
        lt = dict(dtype=torch.long, device=dev)
        new_seq, new_off = torch.tensor(seq, **lt), torch.tensor(off, **lt)
        new_slots = [torch.tensor(s, **lt) for s in slots]
        if batch.checkpoint_seq is None:
            batch.checkpoint_seq, batch.checkpoint_offsets, batch.checkpoint_slots = new_seq, new_off, new_slots
        else:
            batch.checkpoint_seq = torch.cat([batch.checkpoint_seq, new_seq])
            batch.checkpoint_offsets = torch.cat([batch.checkpoint_offsets, new_off])
            batch.checkpoint_slots = [torch.cat([a, s]) for a, s in zip(batch.checkpoint_slots, new_slots)]
        batch.is_decode = False

    def commit(self, row: VerifyRow, accepted_len: int, snapshots: list[tuple[int, list[int]]]) -> None:
        T = row.num_tokens
        if not 1 <= accepted_len <= T:
            raise ValueError(f"accepted_len {accepted_len} outside [1, {T}]")

        def slot(gi: int, offset: int) -> int:  # the block holding the state after `offset` tokens
            return row.running_slots[gi] if offset == T else row.spec_slots[gi][offset - 1]

        pairs = [(slot(gi, o), dst) for o, blocks in snapshots for gi, dst in enumerate(blocks)]
        if accepted_len < T:
            pairs += [(slot(gi, accepted_len), run) for gi, run in enumerate(row.running_slots)]
        if not pairs:
            return
        pages = self.kv.pages
        if pages[0].is_cuda and len(pairs) > 8:  # many pairs: indexed copies, indices sent without a host sync
            # (copy_blocks semantics: every source read before any target is written; the targets here are
            # distinct and no target is another pair's source except the running block, read by snapshots only,
            # which the running target's gather-then-scatter also respects)
            idx = torch.tensor(pairs, dtype=torch.long).pin_memory().to(pages[0].device, non_blocking=True)
            for page in pages:
                page[idx[:, 1]] = page[idx[:, 0]]
            return
        # one contiguous row copy per page and pair: on the CPU indexed assignment of the uint8 pages costs ~20x
        # more; on CUDA these are device-to-device copies with host indices, where copy_blocks would first copy
        # its index lists to the device (a host sync each). In list order: the snapshots (which may read the
        # running block) before the running target (which reads spec slots only).
        for src, dst in pairs:
            for page in self.kv.pages:
                page[dst].copy_(page[src])


SCHEMES: dict[str, type[RollbackScheme]] = {"multi_slot": MultiSlotRollback}


def scheme_class(name: str) -> type[RollbackScheme]:
    if name == "recover_ssm" and name not in SCHEMES:
        from k3serve.workers.engine.spec import recover_ssm  # noqa: F401  (registers itself in SCHEMES)
    try:
        return SCHEMES[name]
    except KeyError:
        raise ValueError(f"speculative_config: unknown rollback {name!r} (use multi_slot or recover_ssm)") from None
