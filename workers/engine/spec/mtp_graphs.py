"""The MTP drafter as fixed-shape steps, captured in CUDA graphs on CUDA (workers/engine/spec/proposers.py
`MTPProposer` is the eager form; this one drafts the same tokens).

Per engine step the drafter makes two calls, each a fixed-shape batch of `size` rows (`size` the smallest capture
size, workers/engine/model_runner.py `capture_sizes`, >= the number of requests), so on CUDA each is ONE graph
replay per size:

* observe: every decode/verify chunk of the step as T = 1 + k query pairs (h_t, x_{t+1}) at positions
  start..start+T-1, of which the first `nvalid` (the verified tokens) are real; each MTP layer writes the T latents
  into the request's row of a pooled cache, the query at `nvalid - 1` leaves layer 0's greedy token and hidden state
  per request (`last_tok`, `last_h`), and the pool marks positions start..start+nvalid-1 valid.
* draft: the k - 1 further draft steps for every drafting request; draft step s runs MTP layer s % n over the s
  pairs drafted so far, over the request's valid pool entries before it plus those pairs (causally), and takes the
  argmax at the last one. The k drafts stay on the device until one copy to the host (the step's one sync here).

The cache: per MTP layer a pool [slots + 1, L, r] / [slots + 1, L, dr] on the device and one `valid` [slots + 1, L]
(the last slot takes padding rows). Entry t of a request's row is the latent of the pair (h_t, x_{t+1}); a query of
an observe attends to the VALID entries before the chunk's start and to the chunk's own queries up to itself, a
draft query to the valid entries before its request's first draft position and to the drafted pairs up to itself:
the eager form's keys (its cache = the entries of verified positions; its recomputation drops entries from the
recomputed start, which these masks never read: every entry at or after an observe's start is rewritten by it
before any later read). Rows are reused by later requests after their `valid` row is cleared. The pool grows
(doubling slots or positions) when a request or a position does not fit; the captured graphs are then dropped and
recaptured. Prefill chunks (more than T tokens) are observed eagerly through the same pool (one request at a time).
Before a size is captured its first warm-up runs with CUDA's sync debug mode "error": a step that waits for the host
(an op without a sync-free kernel here) keeps these calls eager, with one warning.
"""

from __future__ import annotations

import logging

import torch

from k3serve.workers.engine.spec.proposers import MTPProposer
from k3serve.workers.engine.spec.staging import Staging

log = logging.getLogger(__name__)


class GraphMTPProposer(MTPProposer):
    """Greedy MTP drafts from fixed-shape (on CUDA: graph-replayed) observe and draft steps."""

    def __init__(self, cfg, weights, dtype, num_speculative_tokens: int, graphs: bool | None = None,
                 max_batch: int = 256, slots: int = 4, positions: int = 256):
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
        self._alloc(slots, positions)

    # -- the pool ----------------------------------------------------------------------------------
    def _alloc(self, slots: int, positions: int) -> None:
        cfg, dev, dt = self.cfg, self.device, self.dtype
        old = self._pool
        S, L = slots + 1, positions
        new = dict(S=slots, L=L,
                   c=[torch.zeros(S, L, cfg.kv_lora_rank, dtype=dt, device=dev) for _ in range(self.n)],
                   pe=[torch.zeros(S, L, cfg.qk_rope_head_dim, dtype=dt, device=dev) for _ in range(self.n)],
                   valid=torch.zeros(S, L, dtype=torch.bool, device=dev),
                   last_tok=torch.zeros(S, dtype=torch.long, device=dev),
                   last_h=torch.zeros(S, cfg.hidden_size, dtype=dt, device=dev),
                   h=torch.zeros(self.sizes[-1], self.T, cfg.hidden_size, dtype=dt, device=dev),
                   am=torch.zeros(self.sizes[-1], self.T, dtype=torch.long, device=dev))
        if old is not None:  # the real rows keep their entries (the padding slot is the last one)
            s0, l0 = old["S"], old["L"]
            for a, b in zip(new["c"] + new["pe"], old["c"] + old["pe"]):
                a[:s0, :l0] = b[:s0]
            new["valid"][:s0, :l0] = old["valid"][:s0]
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
            self._pool["valid"][s].zero_()  # nothing of the row's previous request is read
        return s

    def cache_bytes(self) -> int:
        P = self._pool
        return sum(t.numel() * t.element_size() for t in P["c"] + P["pe"])

    def drop(self, request_id: str) -> None:
        s = self.slot_of.pop(request_id, None)
        self.last_pos.pop(request_id, None)
        if s is not None:
            self.free.append(s)

    # -- one MTP layer over the pool ---------------------------------------------------------------
    def _pooled(self, j: int, h_prev, next_ids, positions, slot, start, write: bool):
        """Layer j over R rows of s query pairs (h_prev [R, s, H], next_ids [R, s], positions [R, s]) of pool rows
        `slot` [R]; `start` [R] = the row's first query position. write: the queries' latents go into the pool at
        their positions (observe); else they are keys after the pool's (draft). Returns (logits [R, s, V],
        h_next [R, s, H])."""
        cfg, P = self.cfg, self._pool
        R, s = next_ids.shape
        h, r, dr, L = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, P["L"]
        u, x, q_lat, q_pe, c_kv, k_pe = self._project(j, h_prev.reshape(R * s, -1), next_ids.reshape(-1),
                                                      positions.reshape(-1))
        kpos = torch.arange(L, device=slot.device)
        before = P["valid"][slot] & (kpos[None, :] < start[:, None])  # [R, L]: valid entries before the queries
        if write:
            P["c"][j][slot[:, None], positions] = c_kv.view(R, s, r)
            P["pe"][j][slot[:, None], positions] = k_pe.view(R, s, dr)
            keys_c, keys_pe = P["c"][j][slot], P["pe"][j][slot]
            own = (kpos[None, None, :] >= start[:, None, None]) & (kpos[None, None, :] <= positions[:, :, None])
            mask = ~(before[:, None, :] | own)
        else:
            keys_c = torch.cat([P["c"][j][slot], c_kv.view(R, s, r)], 1)
            keys_pe = torch.cat([P["pe"][j][slot], k_pe.view(R, s, dr)], 1)
            causal = torch.ones(s, s, dtype=torch.bool, device=slot.device).triu(1)
            mask = torch.cat([~before[:, None, :].expand(R, s, L), causal[None].expand(R, s, s)], -1)
        o_lat = self._attend(q_lat.view(R, s, h, r), q_pe.reshape(R, s, h, dr), keys_c, keys_pe, mask)
        logits, v = self._finish(j, u, x, o_lat.reshape(R * s, h, r))
        return logits.view(R, s, -1), v.view(R, s, -1)

    # -- the fixed-shape steps ---------------------------------------------------------------------
    def _observe_step(self, size: int):
        """Observe over staged inputs (slot, start, nvalid [size], ids [size, T]) and the hidden buffer."""
        d = self._staging[("observe", size)].dev
        self._observe(size, d["slot"], d["start"], d["nvalid"], d["ids"])
        return None

    def _observe(self, size: int, slot, start, nv, ids):
        """The observe of `size` rows (device tensors): the pool's latents at start..start+T-1, valid up to
        nvalid; layer 0's greedy token and hidden state at nvalid - 1 -> last_tok / last_h (also returned)."""
        P = self._pool
        ar = torch.arange(self.T, device=slot.device)
        positions = start[:, None] + ar[None, :]
        rows = torch.arange(size, device=slot.device)
        last = (nv - 1).clamp(min=0)
        hb = P["h"][:size]
        tok = h0 = None
        for j in range(self.n):
            logits, h_next = self._pooled(j, hb, ids, positions, slot, start, write=True)
            if j == 0:
                tok = torch.argmax(logits[rows, last], dim=-1)  # ties -> the lowest id
                h0 = h_next[rows, last]
                P["last_tok"][slot] = tok
                P["last_h"][slot] = h0
        P["valid"][slot[:, None], positions] = ar[None, :] < nv[:, None]
        return tok, h0

    def _draft_step(self, size: int) -> torch.Tensor:
        """The k drafts [size, k] of staged rows (slot, base [size]: the first draft position)."""
        d = self._staging[("draft", size)].dev
        P = self._pool
        slot = d["slot"]
        return self._draft(slot, d["base"], P["last_tok"][slot], P["last_h"][slot])

    def _draft(self, slot, base, tok0, h0) -> torch.Tensor:
        """Drafts [R, k] from the first draft (tok0 [R], with its hidden state h0 [R, H]) at position base [R]."""
        toks, hs = [tok0], [h0]
        for s in range(1, self.k):
            j = s % self.n
            positions = base[:, None] + torch.arange(s, device=slot.device)[None, :]
            lg, hn = self._pooled(j, torch.stack(hs, 1), torch.stack(toks, 1), positions, slot, base, write=False)
            toks.append(torch.argmax(lg[:, -1], dim=-1))
            hs.append(hn[:, -1])
        return torch.stack(toks, 1)

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
        match = (dr == am[:, :k]) & (torch.arange(k, device=slot.device)[None, :] < nd[:, None])
        acc = match.long().cumprod(1).sum(1)
        nv = acc + 1
        tok0, h0 = self._observe(size, slot, start, nv, am)
        drafts = self._draft(slot, start + nv, tok0, h0)
        return torch.cat([am, acc[:, None], drafts], 1)

    def _stage(self, kind: str, size: int) -> Staging:
        key = (kind, size)
        st = self._staging.get(key)
        if st is None:
            i64, T, k = torch.int64, self.T, self.k
            if kind == "observe":
                f = dict(slot=(i64, (size,)), start=(i64, (size,)), nvalid=(i64, (size,)), ids=(i64, (size, T)))
            elif kind == "fused":
                f = dict(slot=(i64, (size,)), start=(i64, (size,)), ndraft=(i64, (size,)), drafts=(i64, (size, k)),
                         dst=(i64, (size * T,)))
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
            log.warning("CUDA graphs off for the MTP drafter (%s); it runs eagerly", str(e).splitlines()[0][:200])
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
            self._observe_small(small[i:i + self.sizes[-1]])

    def _observe_long(self, req, start: int, hidden: torch.Tensor, v: int) -> None:
        """A prefill chunk: eagerly, alone (its v query pairs at start..start+v-1)."""
        rid = req.request_id
        slot_i = self._slot(rid, start + v)
        P, dev = self._pool, self.device
        slot = torch.tensor([slot_i], device=dev)
        st = torch.tensor([start], device=dev)
        positions = st[:, None] + torch.arange(v, device=dev)[None, :]
        ids = torch.tensor(req.all_token_ids[start + 1:start + v + 1], device=dev)[None]
        for j in range(self.n):
            logits, h_next = self._pooled(j, hidden[None, :v], ids, positions, slot, st, write=True)
            if j == 0:
                P["last_tok"][slot] = torch.argmax(logits[:, v - 1], dim=-1)
                P["last_h"][slot] = h_next[:, v - 1]
        P["valid"][slot_i, start:start + v] = True
        self.last_pos[rid] = start + v - 1
        self.num_eager += 1

    def _observe_small(self, items) -> None:
        n = len(items)
        size = next(s for s in self.sizes if s >= n)
        T = self.T
        slots = [self._slot(req.request_id, start + T) for req, start, _h, _v in items]
        st = self._stage("observe", size)
        h = st.host()
        P = self._pool  # (after any growth in _slot)
        h["slot"][:] = P["S"]
        h["slot"][:n] = slots
        h["start"][:] = 0
        h["nvalid"][:] = 0
        h["ids"][:] = 0
        hb = P["h"]
        for b, (req, start, hidden, v) in enumerate(items):
            h["start"][b] = start
            h["nvalid"][b] = v
            h["ids"][b, :v] = req.all_token_ids[start + 1:start + v + 1]
            hb[b, :v].copy_(hidden[:v])  # device to device (asynchronous)
            self.last_pos[req.request_id] = start + v - 1
        st.send()
        self._run("observe", size)

    @torch.inference_mode()
    def propose_batch(self, reqs) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in reqs]
        ready = [i for i, req in enumerate(reqs) if self.last_pos.get(req.request_id, -2) == req.num_tokens - 2]
        for c in range(0, len(ready), self.sizes[-1]):
            part = ready[c:c + self.sizes[-1]]
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
        slots = [self._slot(req.request_id, start + T) for req, start, _d in items]
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
            dst[o:o + 1 + c] = range(b * T, b * T + 1 + c)
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
            out.append((res[b, :a + 1].tolist(), a, res[b, T + 1:].tolist()))
        return out

    def drafts_for(self, req, drafts: list[int]) -> list[int]:
        """The drafts `verify_and_draft` made for `req`, if they continue what it kept (else none)."""
        return drafts if self.last_pos.get(req.request_id, -2) == req.num_tokens - 2 else []
