"""RecoverSSM: exact KDA rollback with one state block per request (the "recover_ssm" scheme).

The second implementation of workers/engine/spec/rollback.py's RollbackScheme (read its docstring
for the call order and the commit contract):

* `extra_slots(k) = 0`: a speculative request keeps only its running block per KDA group, which
  holds the checkpoint S0 (state + conv window after the tokens computed before this step).
* Verify (`kda_mix`, called by every KDA layer of the forward pass): the rows of verified requests
  run the short conv from their running block's window and the delta rule from S0 WITHOUT writing
  either (kernels/kda_recover.py `kda_recover_verify`); per layer, per request, per token the side
  buffers record the correction u_t (state dtype), the key k_t and raw gate (activation dtype) and
  the raw conv input (activation dtype). Every other row of the batch (prefills, plain decodes) goes
  through rollback.default_kda_mix unchanged.
* Commit (`commit(row, accepted_len, snapshots)`, folded at `end_verify` for every request of the
  step together, so the running blocks hold the committed state once end_verify returns): per KDA
  layer one `kda_recover_commit_rows` (kernels/kda_recover.py: the gate recomputed from the recorded
  raw gate, state = S0 decayed + the accepted corrections, conv window = the last K-1 raw inputs of
  [window | accepted inputs]; two Triton launches on CUDA). A rejected draft costs nothing extra: it
  is only a shorter fold. A retained prefix-cache boundary crossed inside the accepted run gets the
  fold of ITS length written into its block (the exact snapshot), in the same call.
* Conv rows: the design's (K-1+k)-row conv buffer is, here, the K-1 rows of the running block's
  window (in the page, unchanged by the verify) plus the T raw inputs of the side buffer.

The side buffers live outside the paged KV cache (sized by max_num_seqs and the KDA layers, not by
the pool), so the page layout that P/D and the store exchange is unchanged. Per request and KDA
layer they hold T = 1 + k tokens of: H·V corrections (state dtype) + H·2K key|gate + 3·H·K conv
inputs (activation dtype); `state_bytes()` gives the total, the multi-slot scheme's counterpart is
k whole pages per KDA group.
"""

from __future__ import annotations

import dataclasses

import torch

from k3serve.kernels import ops
from k3serve.kernels.kda_recover import kda_recover_commit_rows, kda_recover_verify

from .rollback import SCHEMES, RollbackScheme, SpecBatch, VerifyRow, default_kda_mix


@dataclasses.dataclass
class _Step:
    """This step's verified rows, indexed for the forward pass (plain data)."""

    rows: list[VerifyRow]
    buf_row: dict[str, int]  # request_id -> its row in the side buffers
    tok: torch.Tensor  # [Tv] flat token indices of the verified rows in the batch
    row_of_tok: torch.Tensor  # [Tv] buffer row of each of those tokens
    pos_of_tok: torch.Tensor  # [Tv] its position in its chunk
    cu: torch.Tensor  # [R+1] cumulative chunk lengths of the verified rows
    run_slots: list[torch.Tensor]  # per KDA group [R] running blocks
    has_init: torch.Tensor  # [R] bool
    has_init_list: list[bool]
    run_slots_list: list[list[int]]  # the same running blocks as Python ints
    checkpoints: list[tuple[int, int, list[int]]]  # (buffer row, offset, block per KDA group) of the batch
    other: object | None  # the batch with verified rows padded out, None when every row is verified
    whole: bool = False  # the verified rows are the whole batch, in order (no gathers needed)
    lens: list[int] = dataclasses.field(default_factory=list)  # tokens per verified row (host)


class RecoverSSMRollback(RollbackScheme):
    name = "recover_ssm"

    def __init__(self, kv, layout, num_speculative_tokens: int, max_num_seqs: int):
        super().__init__(kv, layout, num_speculative_tokens, max_num_seqs)
        self.T = 1 + num_speculative_tokens
        h, V, K = layout.ssm_shape
        self.h, self.V, self.K = h, V, K
        self.layers = [(i, gi, j) for gi, grp in enumerate(layout.kda_groups) for j, i in enumerate(grp.layer_ids)]
        dev = kv.pages[0].device if kv is not None and kv.pages else torch.device("cpu")
        n, T = max_num_seqs, self.T
        self.corr = {i: torch.zeros((n, T, h, V), dtype=layout.ssm_dtype, device=dev) for i, _, _ in self.layers}
        self.key_gate = {i: torch.zeros((n, T, h, 2 * K), dtype=layout.conv_dtype, device=dev)
                         for i, _, _ in self.layers}
        self.conv_in = {i: torch.zeros((n, T, layout.conv_channels), dtype=layout.conv_dtype, device=dev)
                        for i, _, _ in self.layers}
        self._step: _Step | None = None
        self._model = None
        self._pending: list[tuple[int, list[tuple[int, list[int]]]]] = []  # commits folded at end_verify

    @staticmethod
    def extra_slots(num_speculative_tokens: int) -> int:
        return 0

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for bufs in (self.corr, self.key_gate, self.conv_in) for t in bufs.values())

    # -- verify ---------------------------------------------------------------------------------
    def begin_verify(self, rows: list[VerifyRow], batch) -> None:
        self._flush()  # (end_verify normally did this)
        self._step = None
        if not rows or not self.layers:
            return
        if len(rows) > self.max_num_seqs:
            raise ValueError(f"recover_ssm: {len(rows)} verified requests > max_num_seqs {self.max_num_seqs}")
        dev = batch.input_ids.device
        cu_b = [int(c) for c in batch.cu_seqlens.tolist()]
        tok, row_of, pos_of, lens = [], [], [], []
        for r, row in enumerate(rows):
            n = cu_b[row.seq + 1] - cu_b[row.seq]
            if n != row.num_tokens or not 1 <= n <= self.T:
                raise ValueError(f"recover_ssm: request {row.request_id} has {n} tokens in the batch, "
                                 f"row says {row.num_tokens} (at most {self.T})")
            tok += range(cu_b[row.seq], cu_b[row.seq + 1])
            row_of += [r] * n
            pos_of += range(n)
            lens.append(n)
        lt = dict(dtype=torch.long, device=dev)
        seqs = torch.tensor([row.seq for row in rows], **lt)
        cu = torch.tensor([0] + lens, **lt).cumsum(0)
        run_slots = [torch.tensor([row.running_slots[gi] for row in rows], **lt)
                     for gi in range(len(self.layout.kda_groups))]
        seq_to_row = {row.seq: r for r, row in enumerate(rows)}
        checkpoints, other = self._split_checkpoints(batch, seq_to_row)
        num_seqs = len(cu_b) - 1
        if len(rows) < num_seqs:
            padded = []
            for si in batch.state_indices:
                si = si.clone()
                si[seqs] = -1  # a negative state index: the default ops skip these rows entirely
                padded.append(si)
            other = dataclasses.replace(batch, state_indices=padded, **other)
        else:
            other = None
        whole = other is None and [row.seq for row in rows] == list(range(num_seqs)) and cu_b[-1] == len(tok)
        self._step = _Step(rows=list(rows), whole=whole, buf_row={row.request_id: r for r, row in enumerate(rows)},
                           tok=torch.tensor(tok, **lt), row_of_tok=torch.tensor(row_of, **lt),
                           pos_of_tok=torch.tensor(pos_of, **lt), cu=cu, run_slots=run_slots,
                           has_init=batch.has_initial_state[seqs].clone(), checkpoints=checkpoints,
                           has_init_list=[bool(v) for v in batch.has_initial_state[seqs].tolist()],
                           run_slots_list=[[row.running_slots[gi] for row in rows]
                                           for gi in range(len(self.layout.kda_groups))],
                           other=other, lens=lens)
        if getattr(batch, "spec", None) is None:
            batch.spec = SpecBatch(rows=list(rows))
        batch.spec.kda_mix = self.kda_mix
        batch.is_decode = False

    @staticmethod
    def _split_checkpoints(batch, seq_to_row):
        """The batch's checkpoint exports of verified rows (done by this scheme), and the others'."""
        if batch.checkpoint_seq is None:
            return [], {}
        seq = batch.checkpoint_seq.tolist()
        off = batch.checkpoint_offsets.tolist()
        slots = [s.tolist() for s in batch.checkpoint_slots]
        mine = [n for n, s in enumerate(seq) if s in seq_to_row]
        rest = [n for n, s in enumerate(seq) if s not in seq_to_row]
        checkpoints = [(seq_to_row[seq[n]], off[n], [s[n] for s in slots]) for n in mine]
        if not rest:
            fields = dict(checkpoint_seq=None, checkpoint_offsets=None, checkpoint_slots=None)
        else:
            idx = torch.tensor(rest, dtype=torch.long, device=batch.checkpoint_seq.device)
            fields = dict(checkpoint_seq=batch.checkpoint_seq[idx], checkpoint_offsets=batch.checkpoint_offsets[idx],
                          checkpoint_slots=[s[idx] for s in batch.checkpoint_slots])
        return checkpoints, fields

    def kda_mix(self, model, i: int, j: int, gi: int, qkv: torch.Tensor, raw_g: torch.Tensor,
                b_logit: torch.Tensor, batch) -> torch.Tensor:
        st = self._step
        if st is None:
            return default_kda_mix(model, i, j, gi, qkv, raw_g, b_logit, batch)
        self._model = model
        cfg, w = model.cfg, model.w
        p = f"model.layers.{i}.self_attn."
        h, K, V = self.h, self.K, self.V
        T = qkv.shape[0]
        if st.whole:
            o = None
            x, rg, bl = qkv, raw_g, b_logit
        else:
            if st.other is not None:
                o = default_kda_mix(model, i, j, gi, qkv, raw_g, b_logit, st.other)
            else:
                o = torch.zeros((T, h, V), dtype=qkv.dtype, device=qkv.device)
            x, rg, bl = qkv[st.tok], raw_g[st.tok], b_logit[st.tok]
        if x.dtype != self.conv_in[i].dtype or rg.dtype != self.key_gate[i].dtype:
            raise TypeError(f"recover_ssm: activations {x.dtype}/{rg.dtype} vs side buffers "
                            f"{self.conv_in[i].dtype} (the cache layout's activation dtype)")
        R = len(st.rows)
        self.conv_in[i][st.row_of_tok, st.pos_of_tok] = x
        walk = not x.is_cuda and max(st.lens) <= WALK_MAX_TOKENS  # the CPU token walks (below)
        if walk:
            y = _conv_walk(x, model.conv_w[i], model.kv.conv_view(j), st.run_slots_list[gi], st.has_init_list,
                           st.lens)
        else:  # the conv runs on a private copy of the running windows, so the running block is not written
            window = model.kv.conv_view(j)[st.run_slots[gi]]
            ar = torch.arange(R, dtype=torch.long, device=x.device)
            y = ops.causal_conv1d_varlen(x, model.conv_w[i], window, ar, st.cu, st.has_init, activation="silu")
        q, k, v = (t.reshape(-1, h, K) for t in y.split(h * K, dim=-1))  # the page's state is [h, d, d]: V == K
        self.key_gate[i][st.row_of_tok, st.pos_of_tok] = torch.cat([k, rg], dim=-1)
        g = ops.kda_gate(rg, w[p + "A_log"], w[p + "dt_bias"], cfg.gate_lower_bound)
        beta = torch.sigmoid(bl.to(model.acc))
        if walk:
            ov = _verify_walk(q, k, v, g, beta, model.kv.ssm_view(j), st.run_slots_list[gi], st.has_init_list,
                              st.lens, self.corr[i], scale=K ** -0.5)
        else:
            ov = kda_recover_verify(q, k, v, g, beta, model.kv.ssm_view(j), st.run_slots[gi], st.cu, st.has_init,
                                    self.corr[i], scale=K ** -0.5, use_qk_l2norm=True)
        if o is None:
            o = ov
        else:
            o[st.tok] = ov.to(o.dtype)
        if st.checkpoints:  # exports the batch asked for at verified rows (offset 1: always accepted)
            by_row: dict[int, list[tuple[int, int]]] = {}
            for r, off, blocks in st.checkpoints:
                by_row.setdefault(r, []).append((off, blocks[gi]))
            lt = dict(dtype=torch.long, device=qkv.device)
            for r, entries in by_row.items():
                entries.sort()
                self._commit_layer(model, i, j, s0=st.run_slots[gi][r : r + 1], inits=st.has_init[r : r + 1],
                                   rec_rows=torch.tensor([r], **lt), seg=torch.tensor([0, len(entries)], **lt),
                                   counts=torch.tensor([off for off, _ in entries], **lt),
                                   outs=torch.tensor([blk for _, blk in entries], **lt))
        return o

    # -- commit ---------------------------------------------------------------------------------
    def commit(self, row: VerifyRow, accepted_len: int, snapshots: list[tuple[int, list[int]]]) -> None:
        st = self._step
        if st is None or row.request_id not in st.buf_row:
            raise ValueError(f"recover_ssm: commit of {row.request_id!r}, which this step did not verify")
        if not 1 <= accepted_len <= row.num_tokens:
            raise ValueError(f"accepted_len {accepted_len} outside [1, {row.num_tokens}]")
        if self._model is None:
            raise RuntimeError("recover_ssm: commit before any KDA layer ran the verify (batch.spec.kda_mix unused)")
        if any(not 1 <= off <= accepted_len for off, _ in snapshots):
            raise ValueError(f"recover_ssm: snapshot offsets {[o for o, _ in snapshots]} outside [1, {accepted_len}]")
        r = st.buf_row[row.request_id]
        if any(p == r for p, _ in self._pending):
            raise ValueError(f"recover_ssm: {row.request_id!r} committed twice in one step")
        entries = sorted(snapshots, key=lambda e: e[0])
        entries.append((accepted_len, row.running_slots))  # the longest last: it overwrites the checkpoint
        self._pending.append((r, entries))

    def end_verify(self) -> None:
        """Fold every commit of the step: per KDA layer one kda_recover_commit_rows for all requests."""
        self._flush()
        self._step = None

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        st = self._step
        dev = self.corr[self.layers[0][0]].device
        recs = [r for r, _ in pending]
        if dev.type == "cpu":  # the CPU walk (below): the same states, without the reference's per-request gathers
            for gi in range(len(self.layout.kda_groups)):
                s0 = [st.run_slots_list[gi][r] for r in recs]
                entries = [[(off, blocks[gi]) for off, blocks in e] for _, e in pending]
                for i, g2, j in self.layers:
                    if g2 == gi:
                        self._fold_walk(self._model, i, j, s0, [st.has_init_list[r] for r in recs], recs, entries)
            return
        lt = dict(dtype=torch.long, device=dev)
        seg = [0]
        for _, entries in pending:
            seg.append(seg[-1] + len(entries))
        counts = torch.tensor([off for _, entries in pending for off, _ in entries], **lt)
        meta = dict(inits=torch.tensor([st.has_init_list[r] for r in recs], dtype=torch.bool, device=dev),
                    rec_rows=torch.tensor(recs, **lt), seg=torch.tensor(seg, **lt), counts=counts)
        for gi in range(len(self.layout.kda_groups)):
            s0 = torch.tensor([st.run_slots_list[gi][r] for r in recs], **lt)
            outs = torch.tensor([blocks[gi] for _, entries in pending for _, blocks in entries], **lt)
            for i, g2, j in self.layers:
                if g2 == gi:
                    self._commit_layer(self._model, i, j, s0=s0, outs=outs, **meta)

    def _fold_walk(self, model, i: int, j: int, s0: list[int], inits: list[bool], recs: list[int],
                   entries: list[list[tuple[int, int]]]) -> None:
        """kda_recover_commit_rows on the CPU, every request of the step at once: the gate recomputed from the
        recorded raw gate, then the recurrence S_t = S_{t-1} diag(e^{g_t}) + u_t k̂_tᵀ from S0 for the recorded
        corrections (the fold's sum, token by token), the conv windows as slices of [window | inputs]; request r's
        entry (count, block) gets the state and window after `count` tokens. Every S0 is read first."""
        from k3serve.kernels.reference._varlen import compute_dtype
        from k3serve.kernels.reference.norms import l2_normalize

        w, cfg = model.w, model.cfg
        p = f"model.layers.{i}.self_attn."
        K = self.K
        pool, conv = model.kv.ssm_view(j), model.kv.conv_view(j)
        R = len(recs)
        cmax = max(c for e in entries for c, _ in e)
        rec = torch.tensor(recs)
        kg = self.key_gate[i].index_select(0, rec)[:, :cmax]  # [R, c, H, 2K]
        dt = compute_dtype(pool, kg)
        g = ops.kda_gate(kg[..., K:].reshape(R * cmax, self.h, K), w[p + "A_log"], w[p + "dt_bias"],
                         cfg.gate_lower_bound).to(dt).view(R, cmax, self.h, 1, K)
        kh = l2_normalize(kg[..., :K].to(dt), 1e-6).view(R, cmax, self.h, 1, K)
        u = self.corr[i].index_select(0, rec)[:, :cmax].to(dt)  # [R, c, H, V]
        S = pool.index_select(0, torch.tensor(s0)).to(dt)
        if not all(inits):
            S = torch.where(torch.tensor(inits)[:, None, None, None], S, 0)
        Sh = torch.empty(R, cmax + 1, self.h, self.V, K, dtype=dt)  # Sh[:, c] = the state after c tokens
        Sh[:, 0] = S
        eg = torch.exp(g)
        for t in range(cmax):
            S = torch.addcmul(S * eg[:, t], u[:, t, :, :, None], kh[:, t])
            Sh[:, t + 1] = S
        hist = conv.index_select(0, torch.tensor(s0))  # [R, C, W-1]
        if not all(inits):
            hist = torch.where(torch.tensor(inits)[:, None, None], hist, 0)
        x = self.conv_in[i].index_select(0, rec)[:, :cmax].to(conv.dtype)  # [R, c, C]
        full = torch.cat([hist, x.transpose(1, 2)], dim=2)  # [R, C, W-1+c]
        Wm1 = conv.shape[2]
        wins = full.unfold(2, Wm1, 1).transpose(1, 2)  # [R, c+1, C, W-1]: the window after 0..c tokens
        src = torch.tensor([r * (cmax + 1) + c for r, e in enumerate(entries) for c, _ in e])
        dst = torch.tensor([blk for e in entries for _, blk in e])
        pool.index_copy_(0, dst, Sh.view(R * (cmax + 1), self.h, self.V, K).index_select(0, src).to(pool.dtype))
        conv.index_copy_(0, dst, wins.reshape(R * (cmax + 1), *wins.shape[2:]).index_select(0, src))

    def _commit_layer(self, model, i: int, j: int, *, s0, inits, rec_rows, seg, counts, outs) -> None:
        """kda_recover_commit_rows at KDA layer i (page position j) over this step's side buffers."""
        w = model.w
        p = f"model.layers.{i}.self_attn."
        kda_recover_commit_rows(model.kv.ssm_view(j), model.kv.conv_view(j), s0, inits, rec_rows, seg,
                                self.key_gate[i], self.corr[i], self.conv_in[i], w[p + "A_log"], w[p + "dt_bias"],
                                model.cfg.gate_lower_bound, counts, outs)


WALK_MAX_TOKENS = 9
"""Longest verified chunk the CPU token walk takes (1 + k for k <= 8; kernels/cpu/kda_verify.py's bound)."""


def _row_starts(lens: list[int]) -> list[int]:
    """Where each of the back-to-back rows of `lens` tokens starts."""
    starts, at = [], 0
    for n in lens:
        starts.append(at)
        at += n
    return starts


def _conv_walk(x: torch.Tensor, conv_weight: torch.Tensor, conv_states: torch.Tensor, slots: list[int],
               init: list[bool], lens: list[int]) -> torch.Tensor:
    """ops.causal_conv1d_varlen(activation="silu") over the verified rows (x [Tv, C], `lens` tokens each) from their
    windows conv_states[slots] (zeros where not init), which are only READ: every row's [history | chunk] at once
    and the window product, as kernels/cpu/kda_verify.py does (a grouped conv per row costs several times more at
    these sizes). Returns y [Tv, C] in x's dtype."""
    from k3serve.kernels.cpu.kda_verify import conv_over_history, padded_token_index
    from k3serve.kernels.reference._varlen import compute_dtype

    Tv, C = x.shape
    R, Lt = len(lens), max(lens)
    dt = compute_dtype(x, conv_states)
    w = conv_weight.squeeze(1) if conv_weight.dim() == 3 else conv_weight  # [C, W]
    dense = all(n == Lt for n in lens)
    if dense:
        xp = x.to(dt).view(R, Lt, C)
    else:
        tok = padded_token_index(_row_starts(lens), lens, Tv)
        xp = torch.cat([x.to(dt), x.new_zeros((1, C), dtype=dt)])[tok]
    _, y = conv_over_history(conv_states, torch.tensor(slots), init, xp, w)  # [R, Lt, C]
    if dense:
        return y.reshape(Tv, C).to(x.dtype)
    return torch.cat([y[r, :lens[r]] for r in range(R)]).to(x.dtype)


def _verify_walk(q, k, v, g, beta, state_pool, slots: list[int], init: list[bool], lens: list[int],
                 corrections: torch.Tensor, *, scale: float) -> torch.Tensor:
    """kernels/kda_recover.py `kda_recover_verify` (use_qk_l2norm=True) on the CPU for short chunks: the delta rule
    token by token from S0 (read, never written), every row at once in a padded [R, Lt] layout (a padding token has
    g = 0 and beta = 0: no change), as kernels/cpu/kda_verify.py walks it, instead of the chunked WY form with its
    triangular solve. The correction of token t is u_t = beta_t (v_t - S'_{t-1} k_t), S'_{t-1} the decayed state
    (the WY form's pseudo-value: S_t = S'_{t-1} + u_t k_tᵀ); o_t = S_t q_t. q, k, g [Tv, H, K], v [Tv, H, V], beta
    [Tv, H] for the verified rows back to back (`lens` tokens each); row r's corrections go to corrections[r, :lens[r]].
    Returns o [Tv, H, V] in v's dtype."""
    from k3serve.kernels.cpu.kda_verify import padded_token_index
    from k3serve.kernels.reference._varlen import compute_dtype
    from k3serve.kernels.reference.norms import l2_normalize

    Tv, H, K = q.shape
    V = v.shape[-1]
    R, Lt = len(lens), max(lens)
    dt = compute_dtype(q, k, v, g, beta, state_pool)
    dense = all(n == Lt for n in lens)
    if dense:
        def pad(t):
            return t.to(dt).reshape(R, Lt, *t.shape[1:])
    else:  # row Tv of the padded inputs is the padding token (zeros)
        cu = _row_starts(lens) + [sum(lens)]
        tok = padded_token_index(cu[:-1], lens, Tv)

        def pad(t):
            return torch.cat([t.to(dt), t.new_zeros((1, *t.shape[1:]), dtype=dt)])[tok]
    qk = l2_normalize(torch.cat([pad(q), pad(k)], 2), 1e-6)  # [R, Lt, 2H, K]: q and k normalised together
    qn = qk[:, :, :H] * scale
    kn = qk[:, :, H:, None, :]  # [R, Lt, H, 1, K]
    vv, eg, bb = pad(v), torch.exp(pad(g)).unsqueeze(3), pad(beta).unsqueeze(3)
    idx = torch.tensor(slots)
    S = state_pool.index_select(0, idx).to(dt)
    if not all(init):
        S = torch.where(torch.tensor(init)[:, None, None, None], S, 0)
    U = torch.empty(R, Lt, H, V, dtype=dt)
    O = torch.empty(R, Lt, H, V, dtype=dt)
    for t in range(Lt):
        S = S * eg[:, t]
        u = (vv[:, t] - (S * kn[:, t]).sum(-1)).mul_(bb[:, t])  # [R, H, V]
        U[:, t] = u
        S = S.add_(u[..., None] * kn[:, t])
        O[:, t] = (S * qn[:, t, :, None, :]).sum(-1)
    if dense:
        corrections[:R, :Lt] = U.to(corrections.dtype)
        return O.reshape(Tv, H, V).to(v.dtype)
    out = torch.empty(Tv, H, V, dtype=dt)
    for r in range(R):
        corrections[r, :lens[r]] = U[r, :lens[r]].to(corrections.dtype)
        out[cu[r]:cu[r + 1]] = O[r, :lens[r]]
    return out.to(v.dtype)


SCHEMES[RecoverSSMRollback.name] = RecoverSSMRollback
