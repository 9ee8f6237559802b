"""The MTP drafter as fixed-shape steps, captured in CUDA graphs on CUDA (workers/engine/spec/proposers.py
`MTPProposer` is the eager form; this one drafts the same tokens).

Per engine step the drafter makes two calls, each a fixed-shape batch of `size` rows (`size` the smallest capture
size, workers/engine/model_runner.py `capture_sizes`, >= the number of requests), so on CUDA each is ONE graph
replay per size:

* observe: every decode/verify chunk of the step as T = 1 + k query pairs (h_t, x_{t+1}) at positions
  start..start+T-1, of which the first `nvalid` (the verified tokens) are real; each MTP layer writes the T latents
  into the request's row of a pooled cache, and layer 0 runs ONE query, the pair at `nvalid - 1` (the only one whose
  outputs are read), for the greedy token and hidden state per request (`last_tok`, `last_h`); the pool marks
  positions start..start+nvalid-1 valid.
* draft: the k - 1 further draft steps for every drafting request; draft step s runs MTP layer s % n with one query,
  the pair s - 1, over the request's valid pool entries before its first draft position and the pairs drafted so
  far, and takes its argmax. A drafted pair's latent is written into the pool row at its position (entries at or
  after the next observe's start, which rewrites them before any read), so each draft step projects only the pairs
  new to its layer (one when n == 1). The k drafts stay on the device until one copy to the host.

The cache: per MTP layer a pool [slots + 1, L, r + dr] (the latent and the rope key side by side: one gather, one
score GEMM) on the device and one additive mask `bias` [slots + 1, L] in the accumulation dtype (0 = valid, -inf;
the last slot takes padding rows). Entry t of a request's row is the latent of the pair (h_t, x_{t+1}); a query of
an observe attends to the VALID entries before the chunk's start and to the chunk's own pairs up to itself, a
draft query to the valid entries before its request's first draft position and to the drafted pairs up to itself:
the eager form's keys (its cache = the entries of verified positions; its recomputation drops entries from the
recomputed start, which these masks never read). The step's mask is made once (the observe's query and then the
draft steps, one scatter each). Rows are reused by later requests after their `bias` row is cleared. The pool grows
(doubling slots or positions) when a request or a position (a chunk and the drafts after it) does not fit; the
captured graphs are then dropped and recaptured. Prefill chunks (more than T tokens) are observed eagerly through
the same pool (one request at a time). The layer's ops are the engine decode layer's (workers/engine/k3_forward.py:
merged projections, ops.rms_norm / ops.linear, the 16-bit gate sigmoid), with q absorbed through kv_b into one GEMM
(MLA without RoPE); benchmarks/mtp_drafter_ops.py counts a step's ops.
Before a size is captured its first warm-up runs with CUDA's sync debug mode "error": a step that waits for the host
(an op without a sync-free kernel here) keeps these calls eager, with one warning.
"""

from __future__ import annotations

import logging

import torch

from k3serve.kernels import ops
from k3serve.workers.engine.k3_forward import expert_act, gate_sigmoid, route
from k3serve.workers.engine.spec.proposers import MTPProposer
from k3serve.workers.engine.spec.staging import Staging
from k3serve.workers.model.functional import acc_dtype, rope_interleaved

log = logging.getLogger(__name__)


class GraphMTPProposer(MTPProposer):
    """Greedy MTP drafts from fixed-shape (on CUDA: graph-replayed) observe and draft steps."""

    def __init__(
        self,
        cfg,
        weights,
        dtype,
        num_speculative_tokens: int,
        graphs: bool | None = None,
        max_batch: int = 256,
        slots: int = 4,
        positions: int = 256,
    ):
        from k3serve.workers.engine.model_runner import capture_sizes

        super().__init__(cfg, weights, dtype, num_speculative_tokens)
        self.T = self.k + 1
        self.use_graphs = self.device.type == "cuda" if graphs is None else bool(graphs)
        self.sizes = capture_sizes(max_batch)
        self.slot_of: dict[str, int] = {}
        self.last_pos: dict[str, int] = {}  # request -> the position of its last observed (verified) row
        self.graphs: dict[tuple[str, int], tuple] = {}
        self._staging: dict[tuple[str, int], Staging] = {}
        self._pool = None
        self.graph_pool = None  # the CUDA graphs' memory pool (shared by every size)
        self.num_replays = 0  # observe and draft calls served by a graph replay
        self.num_eager = 0  # the same calls run eagerly (CPU, capture refused) and eager prefill observes
        self._merge_weights()
        self._alloc(slots, positions)

    def _merge_weights(self) -> None:
        """Per MTP layer, made once as the engine's decode layer has them (workers/engine/k3_forward.py): the
        attention's projections of x as one matrix (q or its low-rank input | kv_a | output gate), kv_b split into
        its q-absorption and value halves, the LatentMoE's latent down-projection and shared experts' gate|up as
        one matrix, the router in the accumulation dtype, the embedding in the compute dtype."""
        cfg, dt = self.cfg, self.dtype
        dn = cfg.qk_nope_head_dim
        self.acc = acc_dtype(dt)
        self.m_in, self.m_split, self.m_moe, self.m_moe_split = [], [], [], []
        self.m_uk, self.m_uv, self.m_embed, self.m_q = [], [], [], []
        h, dr, r = cfg.num_attention_heads, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        for j in range(self.n):
            p = f"model.layers.{cfg.num_hidden_layers + j}."
            aw = self.layer_w[j].sub("self_attn.")
            names = ["q_a_proj" if cfg.q_lora_rank is not None else "q_proj", "kv_a_proj_with_mqa"]
            names += ["g_proj"] if cfg.mla_use_output_gate else []
            parts = [aw[n + ".weight"].to(dt) for n in names]
            self.m_uk.append(self.wkv[j][:, :dn, :].contiguous())
            self.m_uv.append(self.wkv[j][:, dn:, :].contiguous())
            self.m_embed.append(self.embed[j].to(dt))
            # q's absorbed form in one GEMM (MLA without RoPE): [q_lat | q_pe] per head = kv_b's q half composed
            # with q_b (or with q_proj, then in x's merged projection itself), made in float64 once
            qw = aw["q_b_proj.weight" if cfg.q_lora_rank is not None else "q_proj.weight"].to(torch.float64)
            if cfg.mla_use_nope or dr == 0:
                qw = qw.view(h, dn + dr, -1)
                lat = torch.einsum("hdr,hdk->hrk", self.wkv[j][:, :dn, :].to(torch.float64), qw[:, :dn])
                self.m_q.append(torch.cat([lat, qw[:, dn:]], 1).reshape(h * (r + dr), -1).to(dt))
                if cfg.q_lora_rank is None:
                    parts[0] = self.m_q[-1]
            else:
                self.m_q.append(None)
            self.m_in.append(torch.cat(parts))
            self.m_split.append([t.shape[0] for t in parts])
            m = p + "block_sparse_moe."
            fused_moe = (
                cfg.is_moe_layer(cfg.num_hidden_layers + j)
                and self.experts[j] is not None
                and cfg.routed_expert_hidden_size
                and cfg.num_shared_experts
            )
            if fused_moe:
                parts = [
                    self.w[m + "routed_expert_down_proj.weight"].to(dt),
                    self.gate_up[m + "shared_experts."],
                ]
                self.m_moe.append(torch.cat(parts))
                self.m_moe_split.append([t.shape[0] for t in parts])
            else:
                self.m_moe.append(None)
                self.m_moe_split.append(None)

    # -- the pool ----------------------------------------------------------------------------------
    def _alloc(self, slots: int, positions: int) -> None:
        cfg, dev, dt = self.cfg, self.device, self.dtype
        old = self._pool
        S, L = slots + 1, positions
        new = dict(
            S=slots,
            L=L,
            kv=[
                torch.zeros(S, L, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=dt, device=dev)
                for _ in range(self.n)
            ],
            bias=torch.full((S, L), float("-inf"), dtype=acc_dtype(dt), device=dev),
            kpos=torch.arange(L, device=dev),
            tpos=torch.arange(max(self.T, self.k), device=dev),
            rowT=torch.arange(self.sizes[-1], device=dev) * self.T - 1,  # (+ nv: a row's last valid pair)
            last_tok=torch.zeros(S, dtype=torch.long, device=dev),
            last_h=torch.zeros(S, cfg.hidden_size, dtype=dt, device=dev),
            h=torch.zeros(self.sizes[-1], self.T, cfg.hidden_size, dtype=dt, device=dev),
            am=torch.zeros(self.sizes[-1], self.T, dtype=torch.long, device=dev),
        )
        if old is not None:  # the real rows keep their entries (the padding slot is the last one)
            s0, l0 = old["S"], old["L"]
            for a, b in zip(new["kv"], old["kv"]):
                a[:s0, :l0] = b[:s0]
            new["bias"][:s0, :l0] = old["bias"][:s0]
            new["last_tok"][:s0] = old["last_tok"][:s0]
            new["last_h"][:s0] = old["last_h"][:s0]
            new["h"].copy_(old["h"])
            new["am"].copy_(old["am"])
        self._pool = new
        self.graphs.clear()  # they read the old tensors
        self.free = [s for s in range(slots - 1, -1, -1) if s not in self.slot_of.values()]

    def _slot(self, rid: str, need_pos: int) -> int:
        P = self._pool
        if need_pos > P["L"]:
            self._alloc(P["S"], max(need_pos, 2 * P["L"]))
        s = self.slot_of.get(rid)
        if s is None:
            if not self.free:
                self._alloc(2 * self._pool["S"], self._pool["L"])
            s = self.free.pop()
            self.slot_of[rid] = s
            self._pool["bias"][s].fill_(float("-inf"))  # nothing of the row's previous request is read
        return s

    def cache_bytes(self) -> int:
        P = self._pool
        return sum(t.numel() * t.element_size() for t in P["kv"])

    def drop(self, request_id: str) -> None:
        s = self.slot_of.pop(request_id, None)
        self.last_pos.pop(request_id, None)
        if s is not None:
            self.free.append(s)

    # -- one MTP layer over the pool ---------------------------------------------------------------
    def _kv(self, j: int, h_prev, ids, pos, zero=None):
        """Layer j up to the latents of N flat pairs (h_prev [N, H], ids [N], positions pos [N]; zero [N] bool:
        the pairs whose embedding is zeroed, those at position 0): (u, x, pr: x's merged projection (q's input |
        kv_a | the gate's input), kv [N, r + dr]: the pool's entry). The engine's decode-layer ops (workers/engine/k3_forward.py): ONE projection of x for q, kv_a and
        the gate, the norms as ops.rms_norm; the same math as proposers.py `MTPProposer._project`."""
        cfg = self.cfg
        lw = self.layer_w[j]
        eps, r = cfg.rms_norm_eps, cfg.kv_lora_rank
        e = self.m_embed[j][ids]
        if zero is not None:
            e = e.masked_fill(zero[:, None], 0)
        u = ops.linear(
            torch.cat(
                [ops.rms_norm(e, lw["enorm.weight"], eps), ops.rms_norm(h_prev, lw["hnorm.weight"], eps)], -1
            ),
            lw["eh_proj.weight"],
        )
        x = ops.rms_norm(u, lw["input_layernorm.weight"], eps)
        pr = ops.linear(x, self.m_in[j])
        kv_a = pr.split(self.m_split[j], -1)[1]
        c = ops.rms_norm(kv_a[:, :r], lw["self_attn.kv_a_layernorm.weight"], eps)
        k_pe = kv_a[:, r:]
        if not cfg.mla_use_nope and cfg.qk_rope_head_dim > 0:
            k_pe = rope_interleaved(k_pe, pos, cfg.rope_theta)
        return u, x, pr, torch.cat([c, k_pe], -1)

    def _query(self, j: int, u, x, pr, pos, keys, mask):
        """Layer j from the latents on for ONE query per row (R rows: u, x [R, H], pr x's merged projection,
        pos [R]) over the row's pool entries keys [R, L, r + dr] (its own among them) with the additive mask
        [R, L] (0 = attended, -inf = not): (argmax token [R] (ties -> the lowest id), h_next [R, H]). Only rows
        that are read are computed (the attention, MoE and head of the other queries are never read)."""
        cfg, dt = self.cfg, self.dtype
        lw = self.layer_w[j]
        aw = lw.sub("self_attn.")
        eps = cfg.rms_norm_eps
        R = u.shape[0]
        h, dn, dr, dv, r = (
            cfg.num_attention_heads,
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
            cfg.kv_lora_rank,
        )
        q_in, _kv_a, *g = pr.split(self.m_split[j], -1)
        g = g[0] if g else None
        if cfg.q_lora_rank is not None:
            q_in = ops.rms_norm(q_in, aw["q_a_layernorm.weight"], eps)
        if self.m_q[j] is not None:  # [q_lat | q_pe] [R, h, r + dr] in one GEMM (without q_b: x's projection)
            qq = (ops.linear(q_in, self.m_q[j]) if cfg.q_lora_rank is not None else q_in).view(R, h, r + dr)
        else:
            if cfg.q_lora_rank is not None:
                q_in = ops.linear(q_in, aw["q_b_proj.weight"])
            q = q_in.view(R, h, dn + dr)
            q_pe = rope_interleaved(q[..., dn:], pos, cfg.rope_theta)
            q_lat = torch.bmm(q[..., :dn].transpose(0, 1), self.m_uk[j]).transpose(0, 1)  # [R, h, r]
            qq = torch.cat([q_lat, q_pe], -1)
        scores = torch.bmm(qq, keys.transpose(1, 2))  # [R, h, L]
        # the scale, the accumulation dtype and the mask in one op
        scores = torch.add(mask[:, None, :], scores, alpha=(dn + dr) ** -0.5)
        p = torch.softmax(scores, dim=-1).to(dt)
        o_lat = torch.bmm(p, keys[..., :r])  # [R, h, r]
        o = torch.bmm(o_lat.transpose(0, 1), self.m_uv[j].transpose(1, 2)).transpose(0, 1)  # [R, h, dv]
        if g is not None:
            o = o * gate_sigmoid(g.reshape(R, h, dv), g.dtype, self.acc)
        v = u + ops.linear(o.reshape(R, h * dv), aw["o_proj.weight"])
        y = ops.rms_norm(v, lw["post_attention_layernorm.weight"], eps)
        i = cfg.num_hidden_layers + j
        if self.m_moe[j] is not None:
            v = v + self._latent_moe(j, y)
        elif cfg.is_moe_layer(i):
            v = v + self._moe(j, y, lw.sub("block_sparse_moe."))
        else:
            v = v + self._dense_mlp(y, lw.sub("mlp."))
        logits = ops.linear(ops.rms_norm(v, lw["shared_head.norm.weight"], eps), self.head[j])
        return torch.argmax(logits, dim=-1), v  # (the argmax of the 16-bit logits == that of their fp32 cast)

    def _latent_moe(self, j: int, y):
        """The LatentMoE with the latent down-projection and the shared experts' gate|up as ONE GEMM (as
        workers/engine/k3_forward.py `_moe`); the router's GEMM in the accumulation dtype."""
        cfg = self.cfg
        w = self.layer_w[j].sub("block_sparse_moe.")
        gate_w, bias = self.router[j]
        weights, ids = route(cfg, ops.linear(y, gate_w, self.acc), bias)
        z, gu = ops.linear(y, self.m_moe[j]).split(self.m_moe_split[j], -1)
        r = ops.moe_experts(z, weights, ids, **expert_act(cfg), **self.experts[j]).to(y.dtype)
        if cfg.latent_moe_use_norm:
            r = ops.rms_norm(r, w["routed_expert_norm.weight"], cfg.rms_norm_eps)
        r = ops.linear(r, w["routed_expert_up_proj.weight"])
        a = (
            ops.situ_and_mul(gu, cfg.situ_beta, cfg.situ_linear_beta)
            if cfg.hidden_act == "situ"
            else ops.silu_and_mul(gu)
        )
        return r + ops.linear(a.to(y.dtype), w["shared_experts.down_proj.weight"])

    # -- the fixed-shape steps ---------------------------------------------------------------------
    def _observe_step(self, size: int):
        """Observe over staged inputs (slot, start, nvalid [size], ids [size, T]) and the hidden buffer."""
        d = self._staging[("observe", size)].dev
        self._observe(self._pool["h"][:size], d["slot"], d["start"], d["nvalid"], d["ids"])
        return None

    def _observe(self, hb, slot, start, nv, ids):
        """The observe of R rows of T pairs (hb [R, T, H], ids [R, T], device tensors slot, start, nv [R]): every
        MTP layer's latents at start..start+T-1 into the pool, the pool's mask valid there up to nv; layer 0's
        greedy token and hidden state at nv - 1 -> last_tok / last_h. Returns them and the mask its query read
        ([R, L]: the valid entries before start + nv: the drafts' mask to come)."""
        P = self._pool
        R, T = ids.shape
        # (a prefill chunk: longer than the buffer)
        ar = P["tpos"][:T] if T <= P["tpos"].numel() else torch.arange(T, device=slot.device)
        positions = start[:, None] + ar[None, :]  # [R, T]
        flat_pos = positions.reshape(-1)
        zero = flat_pos == 0  # the pair at position 0 has no embedding (the reference's rule)
        end = start + nv  # the first position after the valid pairs (nv >= 1 on every row)
        P["bias"][slot[:, None], positions] = torch.where(ar[None, :] < nv[:, None], self._zero, self._ninf)
        mask = P["bias"][slot].masked_fill(P["kpos"][None, :] >= end[:, None], float("-inf"))
        # each row's query: its last valid pair
        sel = (torch.arange(R, device=slot.device) * T - 1 if T > self.T else P["rowT"][:R]) + nv
        tok = h0 = None
        for j in range(self.n):
            u, x, pr, kv = self._kv(j, hb.reshape(R * T, -1), ids.reshape(-1), flat_pos, zero)
            P["kv"][j][slot[:, None], positions] = kv.view(R, T, -1)
            # the other layers' outputs at the observe are never read: their latents are all it needs
            if j == 0:
                tok, h0 = self._query(0, u[sel], x[sel], pr[sel], flat_pos[sel], P["kv"][0][slot], mask)
        P["last_tok"][slot] = tok
        P["last_h"][slot] = h0
        return tok, h0, mask, end

    @property
    def _zero(self):
        return self._consts()[0]

    @property
    def _ninf(self):
        return self._consts()[1]

    def _consts(self):
        c = getattr(self, "_const", None)
        if c is None:
            acc = acc_dtype(self.dtype)
            c = self._const = (
                torch.zeros((), dtype=acc, device=self.device),
                torch.full((), float("-inf"), dtype=acc, device=self.device),
            )
        return c

    def _draft_step(self, size: int) -> torch.Tensor:
        """The k drafts [size, k] of staged rows (slot, base [size]: the first draft position)."""
        d = self._staging[("draft", size)].dev
        P = self._pool
        slot, base = d["slot"], d["base"]
        mask = P["bias"][slot].masked_fill(P["kpos"][None, :] >= base[:, None], float("-inf"))
        return torch.stack(self._draft(slot, base, P["last_tok"][slot], P["last_h"][slot], mask), 1)

    def _draft(self, slot, base, tok0, h0, mask) -> list:
        """The k drafts ([R] each) from the first (tok0 [R], with its hidden state h0 [R, H]) at position base [R];
        mask [R, L]: the valid entries before base (0, else -inf), updated in place. Draft step s runs layer
        j = s % n with ONE query, the pair s - 1; its keys are the valid entries before base and the pairs drafted
        so far, whose latents are written into the pool's row at their positions base.. (those entries are
        rewritten by the next observe, which starts at base, before anything reads them): a pair's latent for
        layer j is computed once, at the first draft step of layer j after it."""
        P = self._pool
        toks, hs = [tok0], [h0]
        done = [0] * self.n  # pairs whose latent layer j holds
        # the drafted pairs' positions
        dpos = base[:, None] + P["tpos"][None, : self.k - 1] if self.k > 1 else None
        for s in range(1, self.k):
            j = s % self.n
            rows = range(done[j], s)  # the pairs new to layer j (one when n == 1)
            pos = dpos[:, done[j] : s]  # [R, m]
            m = s - done[j]
            hp = hs[-1] if m == 1 else torch.stack([hs[i] for i in rows], 1).reshape(-1, hs[0].shape[-1])
            ip = toks[-1] if m == 1 else torch.stack([toks[i] for i in rows], 1).reshape(-1)
            u, x, pr, kv = self._kv(j, hp, ip, pos.reshape(-1))
            P["kv"][j][slot[:, None], pos] = kv.view(pos.shape[0], m, -1)
            mask.scatter_(1, pos, 0.0)
            done[j] = s
            if m > 1:  # the query is the last pair's
                last = torch.arange(pos.shape[0], device=slot.device) * m + (m - 1)
                u, x, pr = u[last], x[last], pr[last]
            tok, hn = self._query(j, u, x, pr, pos[:, -1], P["kv"][j][slot], mask)
            toks.append(tok)
            hs.append(hn)
        return toks

    def _fused_step(self, size: int) -> torch.Tensor:
        """Greedy acceptance, observe and the next drafts of staged verify rows in one fixed-shape step: slot,
        start, ndraft [size], drafts [size, k], and the target's argmax per verify row in the pool's `am`
        [size, T] (its hidden states in `h`). Accepted count a = the longest prefix of drafts equal to the
        argmaxes (at most ndraft); the observe's pairs are (h_t, am_t), valid for the first a + 1 (the verified
        tokens and the bonus token: the accepted drafts ARE the argmaxes there); the drafts start at start + a + 1.
        Returns [size, T + 1 + k]: the argmaxes, a, the k next drafts (one device->host copy)."""
        d = self._staging[("fused", size)].dev
        P = self._pool
        slot, start, nd, dr = d["slot"], d["start"], d["ndraft"], d["drafts"]
        am = P["am"][:size]
        k = self.k
        match = (dr == am[:, :k]) & (P["tpos"][None, :k] < nd[:, None])
        acc = match.cumprod(1).sum(1)
        nv = acc + 1
        tok0, h0, mask, end = self._observe(P["h"][:size], slot, start, nv, am)
        drafts = self._draft(slot, end, tok0, h0, mask)
        return torch.cat([am, acc[:, None]] + [t[:, None] for t in drafts], 1)

    def _stage(self, kind: str, size: int) -> Staging:
        key = (kind, size)
        st = self._staging.get(key)
        if st is None:
            i64, T, k = torch.int64, self.T, self.k
            if kind == "observe":
                f = dict(
                    slot=(i64, (size,)), start=(i64, (size,)), nvalid=(i64, (size,)), ids=(i64, (size, T))
                )
            elif kind == "fused":
                f = dict(
                    slot=(i64, (size,)),
                    start=(i64, (size,)),
                    ndraft=(i64, (size,)),
                    drafts=(i64, (size, k)),
                    dst=(i64, (size * T,)),
                )
            else:
                f = dict(slot=(i64, (size,)), base=(i64, (size,)))
            st = self._staging[key] = Staging(f, self.device)
        return st

    def _run(self, kind: str, size: int):
        fn = {"observe": self._observe_step, "draft": self._draft_step, "fused": self._fused_step}[kind]
        if self.use_graphs:
            g = self.graphs.get((kind, size)) or self._capture(kind, size, fn)
            if g is not None:
                g[0].replay()
                self.num_replays += 1
                return g[1]
        self.num_eager += 1
        return fn(size)

    def _capture(self, kind: str, size: int, fn):
        """Warm up (the first run with CUDA's sync debug mode "error") and capture `fn(size)` on the staged
        inputs as they are (the caller staged this step's batch; the warm-up runs the real step, and so does the
        capture's replay right after: every op here is a pure function of the staged inputs and the pool, with
        writes that are idempotent for the same inputs)."""
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                prev = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    fn(size)
                finally:
                    torch.cuda.set_sync_debug_mode(prev)
                fn(size)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                out = fn(size)
            self.graph_pool = graph.pool()
        except RuntimeError as e:
            self.use_graphs = False
            log.warning(
                "CUDA graphs off for the MTP drafter (%s); it runs eagerly", str(e).splitlines()[0][:200]
            )
            return None
        self.graphs[(kind, size)] = (graph, out)
        return self.graphs[(kind, size)]

    # -- the engine's calls ------------------------------------------------------------------------
    @torch.inference_mode()
    def observe_batch(self, items) -> None:
        small = []
        for req, start, hidden, verified in items:
            if verified <= 0 or len(req.all_token_ids) < start + verified + 1:
                continue
            if verified <= self.T:
                small.append((req, start, hidden, verified))
            else:
                self._observe_long(req, start, hidden, verified)
        for i in range(0, len(small), self.sizes[-1]):
            self._observe_small(small[i : i + self.sizes[-1]])

    def _observe_long(self, req, start: int, hidden: torch.Tensor, v: int) -> None:
        """A prefill chunk: eagerly, alone (its v query pairs at start..start+v-1)."""
        rid = req.request_id
        slot_i = self._slot(rid, start + v + self.k)  # (+ the drafts after it)
        dev = self.device
        slot = torch.tensor([slot_i], device=dev)
        ids = torch.tensor(req.all_token_ids[start + 1 : start + v + 1], device=dev)[None]
        self._observe(
            hidden[None, :v].to(self.dtype),
            slot,
            torch.tensor([start], device=dev),
            torch.tensor([v], device=dev),
            ids,
        )
        self.last_pos[rid] = start + v - 1
        self.num_eager += 1

    def _observe_small(self, items) -> None:
        n = len(items)
        size = next(s for s in self.sizes if s >= n)
        T = self.T
        # (room for the drafts after the chunk too)
        slots = [self._slot(req.request_id, start + T + self.k) for req, start, _h, _v in items]
        st = self._stage("observe", size)
        h = st.host()
        P = self._pool  # (after any growth in _slot)
        h["slot"][:] = P["S"]
        h["slot"][:n] = slots
        h["start"][:] = 0
        h["nvalid"][:] = 1  # (padding rows: one valid pair of the padding slot, so every query has a key)
        h["ids"][:] = 0
        hb = P["h"]
        for b, (req, start, hidden, v) in enumerate(items):
            h["start"][b] = start
            h["nvalid"][b] = v
            h["ids"][b, :v] = req.all_token_ids[start + 1 : start + v + 1]
            hb[b, :v].copy_(hidden[:v])  # device to device (asynchronous)
            self.last_pos[req.request_id] = start + v - 1
        st.send()
        self._run("observe", size)

    @torch.inference_mode()
    def propose_batch(self, reqs) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in reqs]
        ready = [
            i for i, req in enumerate(reqs) if self.last_pos.get(req.request_id, -2) == req.num_tokens - 2
        ]
        for c in range(0, len(ready), self.sizes[-1]):
            part = ready[c : c + self.sizes[-1]]
            n = len(part)
            size = next(s for s in self.sizes if s >= n)
            st = self._stage("draft", size)
            h = st.host()
            h["slot"][:] = self._pool["S"]
            h["base"][:] = 0
            h["slot"][:n] = [self.slot_of[reqs[i].request_id] for i in part]
            h["base"][:n] = [self.last_pos[reqs[i].request_id] + 1 for i in part]
            st.send()
            drafts = self._run("draft", size)[:n].cpu().numpy()  # the one device->host copy
            for i, d in zip(part, drafts):
                out[i] = d.tolist()
        return out

    # -- one host wait a step (greedy): acceptance, observe and drafts after the verify, on the device ----
    def can_fuse(self, n: int) -> bool:
        """A step of n verify chunks can take `verify_and_draft` (one fixed-shape batch of them)."""
        return 1 <= n <= self.sizes[-1]

    @torch.inference_mode()
    def verify_and_draft(self, items, logits: torch.Tensor, hidden: torch.Tensor):
        """A step whose every chunk is a greedy verify chunk: items = (req, start, drafts) per chunk in the
        logits' order (rows back to back, 1 + len(drafts) each; `hidden` the same rows' pre-final-norm states).
        The argmax of every row and the hidden states go into the fixed-shape buffers (eagerly: two kernels),
        then ONE fixed-shape step (`_fused_step`; on CUDA one graph replay) accepts, observes and drafts, and
        ONE device->host copy brings back the tokens, the accepted counts and the next drafts. Returns per
        item (tokens [a + 1], a, next drafts [k]); the drafts are valid for the request's next step if it keeps
        all a + 1 tokens (`drafts_for`)."""
        n = len(items)
        size = next(s for s in self.sizes if s >= n)
        T = self.T
        # (room for the drafts after the chunk too)
        slots = [self._slot(req.request_id, start + T + self.k) for req, start, _d in items]
        st = self._stage("fused", size)
        h = st.host()
        P = self._pool  # (after any growth in _slot)
        h["slot"][:] = P["S"]
        h["slot"][:n] = slots
        h["start"][:] = 0
        h["ndraft"][:] = 0
        h["drafts"][:] = -1
        dst, o = h["dst"], 0
        for b, (_req, start, drafts) in enumerate(items):
            c = len(drafts)
            h["start"][b] = start
            h["ndraft"][b] = c
            h["drafts"][b, :c] = drafts
            dst[o : o + 1 + c] = range(b * T, b * T + 1 + c)
            o += 1 + c
        d = st.send()
        idx = d["dst"][:o]
        P["am"].view(-1).index_copy_(0, idx, logits[:o].argmax(dim=-1))  # ties -> the lowest id
        P["h"].view(-1, P["h"].shape[-1]).index_copy_(0, idx, hidden[:o].to(P["h"].dtype))
        res = self._run("fused", size)[:n].cpu().numpy()  # the step's one device->host copy
        out = []
        for b, (req, start, _d) in enumerate(items):
            a = int(res[b, T])
            self.last_pos[req.request_id] = start + a
            out.append((res[b, : a + 1].tolist(), a, res[b, T + 1 :].tolist()))
        return out

    def drafts_for(self, req, drafts: list[int]) -> list[int]:
        """The drafts `verify_and_draft` made for `req`, if they continue what it kept (else none)."""
        return drafts if self.last_pos.get(req.request_id, -2) == req.num_tokens - 2 else []
