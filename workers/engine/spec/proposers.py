"""Draft proposers for the engine: prompt-lookup n-grams and the checkpoint's MTP layers.

Both are driven by the engine (workers/engine/llm_engine.py) after each step:

    proposer.observe(req, start, hidden, verified)   # MTP only: the step computed `verified` tokens of
                                                     # `req` from position `start`, `hidden` [verified, H]
                                                     # their pre-final-norm target states
    req.spec_token_ids = proposer.propose(req)       # up to k drafts after req.all_token_ids
    proposer.drop(request_id)                        # the request left the engine

MTP (design doc §1.7; reference form without caches: workers/model/mtp.py `mtp_propose`, which
`MTPProposer` reproduces draft for draft). The MTP layer is an MLA layer, so it has its own latent cache:
per request and MTP layer a dense, growable [positions, kv_lora_rank + rope dim] buffer on the model's
device, OUTSIDE the engine's page pool, its prefix cache and everything P/D or the store exchange (a
prefill pool without speculation and a decode pool with it keep one page layout). Entry t is the MTP
layer's latent for the pair (h_t, x_{t+1}) — the target's hidden state at t and the token after it — so
it is written once the target has verified position t and the token after it is known. Draft-time
entries (positions past the verified ones) live only inside `propose`. Positions the target never
computed in this engine (a prefix-cache hit, a P/D or store load: the decode side computes only the
last prompt token) have no entry: the drafter attends over what it has (fewer accepted drafts, never a
different output: acceptance is checked against the target). Recomputation restarts the cache from the
first recomputed position (preemption, a failed load).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from k3serve.kernels import ops
from k3serve.workers.engine.k3_forward import expert_act, route
from k3serve.workers.model.functional import LayerWeights, acc_dtype, linear, rope_interleaved
from k3serve.workers.model.mla import mla_output
from k3serve.workers.model.moe import moe_forward
from k3serve.workers.model.ngram_proposer import NgramProposer


class NgramDrafter:
    """Prompt lookup over the request's own tokens: exactly workers/model/ngram_proposer.py's rule (longest
    suffix first, its latest earlier occurrence), searched with numpy (one vectorized compare per suffix
    length instead of a Python loop over positions)."""

    needs_hidden = False

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.lookup = NgramProposer(num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)
        # per request: (tokens indexed, {n: {n-gram: its latest start}}), grown as the request's tokens grow
        self._index: dict[str, tuple[int, dict[int, dict[tuple, int]]]] = {}

    def observe(self, req, start: int, hidden, verified: int) -> None:
        pass

    def propose(self, req) -> list[int]:
        return self._propose_req(req)

    def propose_batch(self, reqs) -> list[list[int]]:
        return [self._propose_req(r) for r in reqs]

    def _propose_req(self, req) -> list[int]:
        """`propose_ids(req.all_token_ids)` from an index of the request's n-grams (n = lookup min..max: the
        latest start of each n-gram that ends before the last token) that each call extends by the tokens added
        since the last one: a few dict lookups a step instead of a scan of every position (rebuilt if the
        tokens got fewer, e.g. a stop string cut them)."""
        a = req.all_token_ids
        T = len(a)
        lk = self.lookup
        lo, hi = lk.prompt_lookup_min, lk.prompt_lookup_max
        done, maps = self._index.get(req.request_id, (0, None))
        if maps is None or T < done:
            done, maps = 0, {n: {} for n in range(lo, hi + 1)}
        for n, m in maps.items():  # windows a[i:i+n] with i + n <= T - 1, the ones before `done` already in
            for i in range(max(done - n, 0), T - n):
                m[tuple(a[i:i + n])] = i
        self._index[req.request_id] = (T, maps)
        for n in range(min(hi, T - 1), lo - 1, -1):
            i = maps[n].get(tuple(a[T - n:]))
            if i is not None:
                return list(a[i + n:i + n + lk.num_speculative_tokens])
        return []

    def propose_ids(self, token_ids) -> list[int]:
        lk = self.lookup
        a = np.asarray(token_ids, dtype=np.int64)
        T = a.shape[0]
        for n in range(min(lk.prompt_lookup_max, T - 1), lk.prompt_lookup_min - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(a[:T - 1], n)  # starts 0 .. T-n-1
            hits = np.flatnonzero((windows == a[T - n:]).all(axis=1))
            if hits.size:
                follow = int(hits[-1]) + n
                return a[follow:follow + lk.num_speculative_tokens].tolist()
        return []

    def drop(self, request_id: str) -> None:
        self._index.pop(request_id, None)


@dataclass
class _LayerCache:
    c_kv: torch.Tensor  # [cap, r]
    k_pe: torch.Tensor  # [cap, dr]
    pos: np.ndarray  # [cap] int64 (host), increasing over the first n entries
    n: int = 0


@dataclass
class _ReqCache:
    layers: list[_LayerCache]
    last: tuple[torch.Tensor, torch.Tensor] | None = None  # layer 0's (logits, h') at the last verified row
    last_pos: int = -1  # that row's position


class MTPProposer:
    """Greedy drafts from the checkpoint's MTP layers (cycled by draft step, as the reference)."""

    needs_hidden = True

    def __init__(self, cfg, weights: dict[str, torch.Tensor], dtype: torch.dtype, num_speculative_tokens: int):
        from k3serve.workers.model.reference import dequantize_experts

        n = int(cfg.num_nextn_predict_layers or 0)
        if n < 1:
            raise ValueError("speculative_config: method 'mtp' needs a checkpoint with an MTP layer")
        self.cfg, self.dtype, self.k, self.n = cfg, dtype, num_speculative_tokens, n
        L = cfg.num_hidden_layers
        prefixes = tuple(f"model.layers.{L + j}." for j in range(n))
        sub = {k: v for k, v in weights.items() if k.startswith(prefixes)}
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            sub[name] = weights[name]
        self.w = dequantize_experts(sub, dtype)  # one layer's experts, dense (exact)
        # the engine's expert op takes the experts as the engine holds them (MXFP4-packed on CUDA)
        self.experts = []
        for p in prefixes:
            m = p + "block_sparse_moe.experts."
            if m + "w13_packed" in sub:
                self.experts.append({n: sub[m + n] for n in ("w13_packed", "w13_scale", "w2_packed", "w2_scale")})
            else:
                self.experts.append({n: self.w[m + n] for n in ("w13", "w2")} if m + "w13" in self.w else None)
        self.layer_w = [LayerWeights(self.w, p) for p in prefixes]
        acc = acc_dtype(dtype)
        # made once (the engine's forward does the same, workers/engine/k3_forward.py): the router's weights in
        # the accumulation dtype, the gated MLPs' gate|up projections merged (one GEMM + one fused activation)
        self.router = [(self.w[p + "block_sparse_moe.gate.weight"].to(acc),
                        self.w[p + "block_sparse_moe.gate.e_score_correction_bias"].to(acc)
                        if p + "block_sparse_moe.gate.e_score_correction_bias" in self.w else None)
                       if p + "block_sparse_moe.gate.weight" in self.w else None for p in prefixes]
        self.gate_up = {}
        for p in prefixes:
            for m in ("mlp.", "block_sparse_moe.shared_experts."):
                if p + m + "gate_proj.weight" in self.w:
                    self.gate_up[p + m] = torch.cat([self.w[p + m + "gate_proj.weight"],
                                                     self.w[p + m + "up_proj.weight"]]).to(dtype)
        hq, dn, dv, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.wkv = [self.w[p + "self_attn.kv_b_proj.weight"].to(dtype).reshape(hq, dn + dv, r) for p in prefixes]
        self.embed = [self._own(L + j, "embed_tokens.weight", "model.embed_tokens.weight") for j in range(n)]
        self.head = [self._own(L + j, "shared_head.head.weight", "lm_head.weight").to(dtype) for j in range(n)]
        self.device = self.w["model.embed_tokens.weight"].device
        self.reqs: dict[str, _ReqCache] = {}
        self.state_elems = cfg.kv_lora_rank + cfg.qk_rope_head_dim

    def _own(self, i: int, name: str, fallback: str) -> torch.Tensor:
        own = f"model.layers.{i}.{name}"
        return self.w[own] if own in self.w else self.w[fallback]

    def cache_bytes(self) -> int:
        """Bytes the MTP latent caches hold now (all requests, all MTP layers, allocated capacity)."""
        return sum(c.c_kv.numel() * c.c_kv.element_size() + c.k_pe.numel() * c.k_pe.element_size()
                   for rc in self.reqs.values() for c in rc.layers)

    # -- the layer ---------------------------------------------------------------------------------
    def _project(self, j: int, h_prev: torch.Tensor, next_ids: torch.Tensor, pos: torch.Tensor):
        """The layer up to attention for N flat query pairs (h_prev [N, H], next_ids [N], positions [N]):
        (u, x, q_lat [N, h, r] (q_nope absorbed through kv_b), q_pe [N, h, dr], c_kv [N, r], k_pe [N, dr]).
        The norms are ops.rms_norm (one fused kernel on CUDA, as in the engine's forward); the projection is
        workers/model/mla.py `mla_project`'s."""
        cfg, dtype = self.cfg, self.dtype
        lw = self.layer_w[j]
        eps = cfg.rms_norm_eps
        e = self.embed[j][next_ids].to(dtype)
        e = e.masked_fill((pos == 0)[:, None], 0)
        h_in = h_prev.to(dtype)
        u = linear(torch.cat([ops.rms_norm(e, lw["enorm.weight"], eps), ops.rms_norm(h_in, lw["hnorm.weight"], eps)],
                             -1), lw["eh_proj.weight"])
        x = ops.rms_norm(u, lw["input_layernorm.weight"], eps)
        aw = lw.sub("self_attn.")
        N = x.shape[0]
        h, dn, dr, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank is not None:
            q = linear(ops.rms_norm(linear(x, aw["q_a_proj.weight"]), aw["q_a_layernorm.weight"], eps),
                       aw["q_b_proj.weight"])
        else:
            q = linear(x, aw["q_proj.weight"])
        q = q.view(N, h, dn + dr)
        q_nope, q_pe = q[..., :dn], q[..., dn:]
        kv_a = linear(x, aw["kv_a_proj_with_mqa.weight"])
        c_kv = ops.rms_norm(kv_a[:, :r], aw["kv_a_layernorm.weight"], eps)
        k_pe = kv_a[:, r:]
        if not cfg.mla_use_nope and dr > 0:
            q_pe = rope_interleaved(q_pe, pos, cfg.rope_theta)
            k_pe = rope_interleaved(k_pe, pos, cfg.rope_theta)
        q_lat = torch.einsum("qhd,hdr->qhr", q_nope, self.wkv[j][:, :dn, :])
        return u, x, q_lat, q_pe, c_kv, k_pe

    def _attend(self, q_lat: torch.Tensor, q_pe: torch.Tensor, keys_c: torch.Tensor, keys_pe: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """q_lat [R, s, h, r], q_pe [R, s, h, dr] over keys [R, K, r] / [R, K, dr]; mask [R, s, K] True = hidden
        (None: every key). Returns o_lat [R, s, h, r]."""
        cfg = self.cfg
        scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
        scores = (torch.einsum("bqhr,bkr->bhqk", q_lat, keys_c) + torch.einsum("bqhd,bkd->bhqk", q_pe, keys_pe))
        scores = (scores * scale).to(acc_dtype(self.dtype))
        if mask is not None:
            scores = scores.masked_fill(mask[:, None], float("-inf"))
        p = torch.softmax(scores, dim=-1).to(self.dtype)
        return torch.einsum("bhqk,bkr->bqhr", p, keys_c)

    def _finish(self, j: int, u: torch.Tensor, x: torch.Tensor, o_lat: torch.Tensor):
        """After attention, N flat queries (o_lat [N, h, r]): (logits [N, V] acc dtype, h_next [N, H])."""
        cfg = self.cfg
        lw = self.layer_w[j]
        eps = cfg.rms_norm_eps
        aw = lw.sub("self_attn.")
        o = torch.einsum("qhr,hvr->qhv", o_lat, self.wkv[j][:, cfg.qk_nope_head_dim:, :])
        v = u + mla_output(o, x, aw, cfg)
        y = ops.rms_norm(v, lw["post_attention_layernorm.weight"], eps)
        i = cfg.num_hidden_layers + j
        v = v + (self._moe(j, y, lw.sub("block_sparse_moe.")) if cfg.is_moe_layer(i)
                 else self._dense_mlp(y, lw.sub("mlp.")))
        logits = ops.rms_norm(v, lw["shared_head.norm.weight"], eps) @ self.head[j].T
        return logits.to(acc_dtype(self.dtype)), v

    def _layer(self, j: int, h_prev: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
               caches: list[_LayerCache]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """MTP layer j over R requests' query pairs (h_prev [R, s, H], next_ids [R, s]) at `positions`
        [R, s]; request b's queries attend to `caches[b]`'s entries and then to its own queries (causally).
        Returns (logits [R, s, V] acc dtype, h_next [R, s, H], the queries' latents c_kv [R * s, r] and
        k_pe [R * s, dr]). With R == 1 only the last query's logits and h_next are exact (the others attend
        unmasked); the callers read no other."""
        cfg, dtype = self.cfg, self.dtype
        R, s = next_ids.shape
        u, x, q_lat, q_pe, c_kv, k_pe = self._project(j, h_prev.reshape(R * s, -1), next_ids.reshape(-1),
                                                      positions.reshape(-1))
        h, r, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        dev = positions.device
        smax = max(c.n for c in caches)
        # a query sees its request's cached entries (all at earlier positions) and its queries up to itself
        if R == 1:  # no padding: the cache then the queries (the common batch-1 step: a few ops fewer), and
            # no mask: the callers read only the LAST query's outputs, which see every key
            c = caches[0]
            keys_c = torch.cat([c.c_kv[:c.n], c_kv])[None]
            keys_pe = torch.cat([c.k_pe[:c.n], k_pe])[None]
            mask = None
        else:
            keys_c = torch.zeros(R, smax + s, r, dtype=dtype, device=dev)
            keys_pe = torch.zeros(R, smax + s, dr, dtype=dtype, device=dev)
            for b, c in enumerate(caches):
                keys_c[b, :c.n] = c.c_kv[:c.n]
                keys_pe[b, :c.n] = c.k_pe[:c.n]
            keys_c[:, smax:] = c_kv.view(R, s, r)
            keys_pe[:, smax:] = k_pe.view(R, s, dr)
            lens = torch.tensor([c.n for c in caches], device=dev)
            mask = torch.zeros(R, s, smax + s, dtype=torch.bool, device=dev)
            mask[:, :, :smax] = torch.arange(smax, device=dev)[None, None, :] >= lens[:, None, None]
            mask[:, :, smax:] = torch.ones(s, s, dtype=torch.bool, device=dev).triu(1)
        o_lat = self._attend(q_lat.view(R, s, h, r), q_pe.reshape(R, s, h, dr), keys_c, keys_pe, mask)
        logits, v = self._finish(j, u, x, o_lat.reshape(R * s, h, r))
        return logits.view(R, s, -1), v.view(R, s, -1), c_kv, k_pe

    def _moe(self, j: int, x: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        """The MTP layer's (Latent)MoE with the engine's routing and expert ops (k3serve.kernels.ops: no
        per-expert loop, no host sync on CUDA); the reference `moe_forward` when the experts are neither."""
        cfg = self.cfg
        ex = self.experts[j]
        if ex is None:
            return moe_forward(x, w, cfg)
        acc = acc_dtype(self.dtype)
        gate_w, bias = self.router[j]
        weights, ids = route(cfg, linear(x.to(acc), gate_w), bias)
        z = linear(x, w["routed_expert_down_proj.weight"]) if cfg.routed_expert_hidden_size else x
        r = ops.moe_experts(z, weights, ids, **expert_act(cfg), **ex).to(x.dtype)
        if cfg.routed_expert_hidden_size:
            if cfg.latent_moe_use_norm:
                r = ops.rms_norm(r, w["routed_expert_norm.weight"], cfg.rms_norm_eps)
            r = linear(r, w["routed_expert_up_proj.weight"])
        if cfg.num_shared_experts:
            r = r + self._dense_mlp(x, w.sub("shared_experts."))
        return r

    def _dense_mlp(self, x: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        """workers/model/moe.py `dense_mlp` with the merged gate|up projection and the fused activation."""
        cfg = self.cfg
        gu = linear(x, self.gate_up[w.prefix])
        a = (ops.situ_and_mul(gu, cfg.situ_beta, cfg.situ_linear_beta) if cfg.hidden_act == "situ"
             else ops.silu_and_mul(gu))
        return linear(a.to(x.dtype), w["down_proj.weight"])

    # -- the engine's calls ------------------------------------------------------------------------
    def _cache(self, rid: str) -> _ReqCache:
        rc = self.reqs.get(rid)
        if rc is None:
            cfg, dev = self.cfg, self.device
            cap = 64
            rc = _ReqCache([_LayerCache(torch.zeros(cap, cfg.kv_lora_rank, dtype=self.dtype, device=dev),
                                        torch.zeros(cap, cfg.qk_rope_head_dim, dtype=self.dtype, device=dev),
                                        np.zeros(cap, dtype=np.int64))
                            for _ in range(self.n)])
            self.reqs[rid] = rc
        return rc

    def observe(self, req, start: int, hidden: torch.Tensor, verified: int) -> None:
        self.observe_batch([(req, start, hidden, verified)])

    @torch.inference_mode()
    def observe_batch(self, items) -> None:
        """items: (request, start, hidden [verified, H], verified) per chunk the step computed. Decode and
        verify chunks (at most 1 + k rows) go through each MTP layer together (rows padded per request);
        a prefill chunk alone."""
        small = []
        for req, start, hidden, verified in items:
            if verified <= 0 or len(req.all_token_ids) < start + verified + 1:
                continue  # nothing verified, or the token after the last one unknown (not for running requests)
            if verified <= self.k + 1:
                small.append((req, start, hidden, verified))
            else:
                self._observe_group([(req, start, hidden, verified)], verified)
        if small:
            self._observe_group(small, max(v for *_x, v in small))

    def _observe_group(self, items, s: int) -> None:
        dev = self.device
        R = len(items)
        H = items[0][2].shape[-1]
        h = torch.zeros(R, s, H, dtype=items[0][2].dtype, device=dev)
        ids = torch.zeros(R, s, dtype=torch.long)
        starts = torch.tensor([start for _r, start, _h, _v in items])
        for b, (req, start, hidden, v) in enumerate(items):
            h[b, :v] = hidden[:v]
            ids[b, :v] = torch.tensor(req.all_token_ids[start + 1:start + v + 1])
        ids = ids.to(dev)
        positions = (starts[:, None] + torch.arange(s)[None, :]).to(dev)
        rcs = [self._cache(req.request_id) for req, *_x in items]
        for j in range(self.n):
            caches = [rc.layers[j] for rc in rcs]
            for c, (_req, start, _h, _v) in zip(caches, items):
                if c.n and c.pos[c.n - 1] >= start:  # recomputation: drop entries from `start` on
                    c.n = int(np.searchsorted(c.pos[:c.n], start))
            logits, h_next, c_kv, k_pe = self._layer(j, h, ids, positions, caches)
            c_kv, k_pe = c_kv.view(R, s, -1), k_pe.view(R, s, -1)
            for b, (c, (_req, start, _h, v)) in enumerate(zip(caches, items)):
                self._append(c, c_kv[b, :v], k_pe[b, :v], start, v)
                if j == 0:
                    rcs[b].last = (logits[b, v - 1], h_next[b, v - 1])
                    rcs[b].last_pos = start + v - 1

    def _append(self, c: _LayerCache, c_kv: torch.Tensor, k_pe: torch.Tensor, start: int, v: int) -> None:
        need = c.n + v
        if need > c.c_kv.shape[0]:
            cap = max(need, 2 * c.c_kv.shape[0])
            for name in ("c_kv", "k_pe"):
                old = getattr(c, name)
                new = torch.zeros((cap, *old.shape[1:]), dtype=old.dtype, device=old.device)
                new[:c.n] = old[:c.n]
                setattr(c, name, new)
            c.pos = np.concatenate([c.pos[:c.n], np.zeros(cap - c.n, dtype=np.int64)])
        c.c_kv[c.n:need] = c_kv
        c.k_pe[c.n:need] = k_pe
        c.pos[c.n:need] = np.arange(start, start + v)
        c.n = need

    def propose(self, req) -> list[int]:
        return self.propose_batch([req])[0]

    @torch.inference_mode()
    def propose_batch(self, reqs) -> list[list[int]]:
        """Greedy drafts after each request's all_token_ids (whose last token is the one just sampled), all
        requests in one layer call per draft step; [] for a request whose step that verified position
        len - 2 was not observed. The drafts stay on the device until the last (one host sync a step)."""
        out: list[list[int]] = [[] for _ in reqs]
        ready = []
        for i, req in enumerate(reqs):
            rc = self.reqs.get(req.request_id)
            if rc is not None and rc.last is not None and rc.last_pos == req.num_tokens - 2:
                ready.append((i, rc))
        if not ready:
            return out
        dev = self.device
        rcs = [rc for _i, rc in ready]
        toks = [torch.stack([torch.argmax(rc.last[0]) for rc in rcs])]  # [R] each; ties -> the lowest id
        hs = [torch.stack([rc.last[1] for rc in rcs])]  # [R, H] each
        base = torch.tensor([rc.last_pos + 1 for rc in rcs], device=dev)
        for s in range(1, self.k):
            j = s % self.n
            positions = base[:, None] + torch.arange(s, device=dev)[None, :]
            lg, hn, _c, _p = self._layer(j, torch.stack(hs, 1), torch.stack(toks, 1), positions,
                                         [rc.layers[j] for rc in rcs])
            toks.append(torch.argmax(lg[:, -1], dim=-1))
            hs.append(hn[:, -1])
        for (i, _rc), d in zip(ready, torch.stack(toks, 1).tolist()):
            out[i] = d
        return out

    def drop(self, request_id: str) -> None:
        self.reqs.pop(request_id, None)


def proposer_form(method: str, device_type: str, enforce_eager: bool) -> str:
    """Which drafter the engine builds: "ngram" (NgramDrafter), "graph" (workers/engine/spec/mtp_graphs.py
    GraphMTPProposer: fixed-shape steps replayed as CUDA graphs) or "eager" (MTPProposer). The graph form only
    on CUDA and only without enforce_eager (EngineArgs.enforce_eager: no CUDA graphs anywhere, the target's
    steps nor the drafter's)."""
    if method == "ngram":
        return "ngram"
    return "graph" if device_type == "cuda" and not enforce_eager else "eager"


def build_proposer(spec, cfg, weights, dtype, enforce_eager: bool = False):
    form = proposer_form(spec.method, weights["model.embed_tokens.weight"].device.type, enforce_eager)
    if form == "ngram":
        return NgramDrafter(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    if form == "graph":
        from k3serve.workers.engine.spec.mtp_graphs import GraphMTPProposer

        return GraphMTPProposer(cfg, weights, dtype, spec.num_speculative_tokens)
    return MTPProposer(cfg, weights, dtype, spec.num_speculative_tokens)
