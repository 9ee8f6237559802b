"""The K3 forward pass over a flattened batch with the hybrid cache (the engine's model).

Every sequence in the batch contributes a chunk of tokens at known positions; MLA layers write
their latent pages then attend over the paged cache (absorbed form), KDA layers run the short conv
and the chunked delta rule from / into their state slots, with in-pass snapshot exports. The hot
ops come from `k3serve.kernels.ops` (reference PyTorch on the CPU, Triton on CUDA); the glue
(projections, RoPE) is shared with the reference model's functional helpers.
"""

from __future__ import annotations

import torch

from k3serve.kernels import ops, reference
from k3serve.kernels.reference._varlen import cast
from k3serve.workers.engine.cache_layout import CacheLayout, KVCacheTensors
from k3serve.workers.engine.forward_batch import ForwardBatch
from k3serve.workers.model.functional import LayerWeights, acc_dtype, rope_interleaved

# The MLA output gate sigmoid(g) of a 16-bit activation dtype as ONE kernel, torch.sigmoid on the 16-bit g: PyTorch
# computes 16-bit pointwise ops in fp32 and rounds once, so it equals sigmoid(g.float()).to(g.dtype), the reference
# form, bit for bit (every bf16/fp16 value: tests/test_mla_gate_sigmoid.py, tests/gpu/test_engine_gpu.py), without
# its two casts (-2 kernels per MLA layer). False: the two casts (decode_roofline's graphs-s6 mode).
GATE_SIGMOID_16BIT = True


def gate_sigmoid(g: torch.Tensor, dtype: torch.dtype, acc: torch.dtype) -> torch.Tensor:
    """sigmoid(g) computed in the accumulation dtype `acc`, in `dtype` (the 16-bit form when it is exact: see
    GATE_SIGMOID_16BIT). The MLA output gate of the target's layers and of the MTP drafter's (spec/mtp_graphs.py)."""
    if GATE_SIGMOID_16BIT and g.dtype == dtype and dtype in (torch.bfloat16, torch.float16) and acc == torch.float32:
        return torch.sigmoid(g)
    return torch.sigmoid(g.to(acc)).to(dtype)


def route(cfg, logits: torch.Tensor, bias: torch.Tensor | None, shared_experts: int = 0) -> tuple[torch.Tensor, ...]:
    """(top-k weights, expert ids) of MoE router logits [T, E] with the model's routing settings (`ops.moe_route`;
    `shared_experts` columns appended for SHARED_EXPERT_FUSION): the engine's models and the MTP drafters."""
    return ops.moe_route(
        logits, bias, cfg.num_experts_per_token, num_expert_group=cfg.num_expert_group or 1,
        topk_group=cfg.topk_group or 1, renormalize=cfg.moe_renormalize,
        routed_scaling_factor=cfg.routed_scaling_factor, scoring=cfg.router_activation, shared_experts=shared_experts)


def expert_act(cfg) -> dict:
    """The experts' activation arguments of `ops.moe_experts` for a model config."""
    return dict(activation=cfg.hidden_act, situ_beta=cfg.situ_beta, situ_linear_beta=cfg.situ_linear_beta)


# the projections: `functional.linear` on the CPU; on CUDA decode-sized ones (<= 16 rows) take the skinny GEMM
# (kernels/triton/gemv.py); the optional third argument is the compute dtype, the operands' cast folded in
linear = ops.linear

FUSED_ADD_NORM = True
"""Plain residual stacks (no Block AttnRes): each residual add and the norm after it as ONE op (`ops.add_rms_norm`:
one kernel on CUDA instead of an add and a norm; the same values, the sum rounded before the norm reads it).
False: the add and the norm apart (the earlier form, for benchmarks)."""

KDA_PREFILL_GLUE = True
"""The chunked KDA prefill's glue without copies and with fused kernels: qkv and the conv output's q, k, v read in
place as column slices, the log-decay gate as one op (`ops.kda_gate`), the gated output norm as one
(`ops.rms_norm_gated`). False: the earlier form (copies of the slices, the gate and the gated norm as PyTorch's
elementwise ops), for benchmarks' before/after (`--set k3serve.workers.engine.k3_forward.KDA_PREFILL_GLUE=0`);
the same values either way on the reference ops. Run 21 (H100, a 16384-token prefill step of the vs-transformers
model, benchmarks/mixed_step.py): kernels 180.3 -> 167.4 ms, wall 183.8 -> 172.3 ms, 872 -> 746 kernels."""

SHARED_EXPERT_FUSION = True
"""MoE layers whose shared experts have the routed experts' shape (no latent projection, unpacked routed experts: e.g.
Kimi-Linear checkpoints): the shared experts are stored after the routed ones ([E + n, ...], one tensor; the routed
view is its first E) and, in steps of at most SHARED_EXPERT_FUSION_MAX_TOKENS tokens (decode), routed to by every
token with weight 1 (`ops.moe_route(shared_experts=n)`), so one expert pass computes both: the shared gate|up GEMM,
its activation, its down GEMM and the add are gone (4 kernels a MoE layer on CUDA), the shared down projection
summed in the routed combine's fp32 accumulator. As SGLang's shared-experts fusion. False: the shared experts apart.
Run 21 (H100, the vs-transformers model's decode step, benchmarks/decode_roofline.py, off/on/off/on): B=32 2.38 / 2.15
ms apart, 2.04 / 2.11 ms fused; B=64 2.59 / 3.27 against 2.68 / 2.89 ms: the sign favours it, the size is within
that machine's run-to-run spread (docs/kernels-notes.md, session 13)."""

SHARED_EXPERT_FUSION_HEADROOM = 1 << 30
"""Bytes of device memory left free after a layer's routed + shared tensor is made: the loader's expert tensors stay
alive until the engine is built (the caller holds them), so each fused layer briefly needs a second copy of its
experts; a layer whose copy would not leave this much free memory (the KV cache is already allocated) is not fused
(its shared experts run apart, as with SHARED_EXPERT_FUSION off)."""

SHARED_EXPERT_FUSION_MAX_TOKENS = 256
"""Largest step (tokens) that takes the fused shared experts: above it (prefill chunks) the shared experts' GEMMs are
large enough for cuBLAS to beat the expert kernels' tiles, so they run apart."""

PIN_KERNELS = True
"""`forward` runs inside `ops.pinned_kernels()` (each op's implementation chosen once per pass, not per call);
False: every op call reads K3SERVE_KERNELS (the earlier form, for benchmarks)."""


class K3ForwardModel:
    def __init__(self, config, weights: dict[str, torch.Tensor], layout: CacheLayout,
                 kv: KVCacheTensors, dtype: torch.dtype):
        self.cfg = config
        self.w = weights
        self.layout = layout
        self.kv = kv
        self.dtype = dtype
        self.acc = acc_dtype(dtype)
        self.layer_map = layout.layer_map()
        self.keep_hidden = False  # speculative decoding (MTP): keep the pre-final-norm states of every row
        self.hidden: torch.Tensor | None = None  # [T, H] of the last forward when keep_hidden
        self.group_index = {}  # group_id -> index among groups of its kind
        for kind_groups in (layout.mla_groups, layout.kda_groups):
            for i, g in enumerate(kind_groups):
                self.group_index[g.group_id] = i
        self._prepare()

    def _prepare(self) -> None:
        """Precompute fused views (conv weights, absorbed MLA matrices) once.

        On the CPU the MXFP4 experts are dequantized once here (exact), since the reference MoE op
        would otherwise decode every active expert at every step; on CUDA they stay packed for the
        MXFP4 kernel.
        """
        cfg, w = self.cfg, self.w
        self.experts_packed = bool(cfg.experts_mxfp4) and self.w["model.embed_tokens.weight"].is_cuda
        if cfg.experts_mxfp4 and not self.experts_packed:
            from k3serve.workers.model.reference import dequantize_experts

            self.w = w = dequantize_experts(w, self.dtype)
        self.w = w = dict(w)  # the merged projections below replace their parts in this (private) dict
        self.conv_w: dict[int, torch.Tensor] = {}
        self.split: dict[str, list[int]] = {}  # merged weight name -> output sizes of its parts
        self.w_uk: dict[int, torch.Tensor] = {}
        self.w_uv: dict[int, torch.Tensor] = {}
        self.acc_w: dict[str, torch.Tensor] = {}  # weights the step uses in the accumulation dtype, cast once
        # layer -> {"experts.w13": [E + n, 2I, D], "experts.w2": [E + n, D, I]}: the routed experts followed by the
        # n shared ones (SHARED_EXPERT_FUSION)
        self.shared_fused: dict[int, dict[str, torch.Tensor]] = {}
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}.self_attn."
            if cfg.is_kda_layer(i):
                self.conv_w[i] = torch.cat([w[p + f"{n}_conv1d.weight"] for n in "qkv"], 0).to(self.acc)
                # every projection of x in a KDA layer as ONE matrix (one GEMM per step instead of six):
                # q, k, v, the gate's low-rank input, beta, the output gate (or its low-rank input)
                self._merge(p, ["q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj",
                                "g_proj" if p + "g_proj.weight" in w else "g_a_proj"])
                nq, nk, nv, *rest = self.split[p]
                self.split[p] = [nq + nk + nv, *rest]  # q, k, v stay one slice: the conv takes them together
                self._cast_acc(p + "o_norm.weight")
            else:
                h, dn, dv, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank)
                kvb = w[p + "kv_b_proj.weight"].view(h, dn + dv, r)
                self.w_uk[i] = kvb[:, :dn, :].contiguous().to(self.dtype)
                self.w_uv[i] = kvb[:, dn:, :].contiguous().to(self.dtype)
                # the MLA projections of x: q (or its low-rank input), the latent kv + rope key, the output gate
                self._merge(p, ["q_a_proj" if cfg.q_lora_rank else "q_proj", "kv_a_proj_with_mqa"]
                            + (["g_proj"] if cfg.mla_use_output_gate else []))
            if cfg.is_moe_layer(i):
                m = f"model.layers.{i}.block_sparse_moe."
                fused = self._fuse_shared_experts(m)
                for n in ("experts.w13", "experts.w2"):
                    if m + n in w and not w[m + n].is_cuda:  # CPU: [E, N, K] stored K-major, so every x @ W_eᵀ
                        w[m + n] = w[m + n].transpose(1, 2).contiguous().transpose(1, 2)  # is a plain NN GEMM
                    if fused:  # the routed experts: the first E of the routed + shared tensor
                        self.shared_fused.setdefault(i, {})[n] = w[m + n]
                        w[m + n] = w[m + n][:cfg.num_experts]
                self._cast_acc(m + "gate.weight")
                self._cast_acc(m + "gate.e_score_correction_bias")
                names = ["routed_expert_down_proj"] if cfg.routed_expert_hidden_size else []
                if cfg.num_shared_experts:
                    names += ["shared_experts.gate_proj", "shared_experts.up_proj"]
                if names:
                    self._merge(m, names)
                    if cfg.num_shared_experts:  # gate|up stay one slice, as the activation takes them
                        *head, ng, nu = self.split[m]
                        self.split[m] = [*head, ng + nu]
            else:
                self._merge(f"model.layers.{i}.mlp.", ["gate_proj", "up_proj"])
                self.split[f"model.layers.{i}.mlp."] = [sum(self.split[f"model.layers.{i}.mlp."])]

    fuses_shared_experts = True
    """Whether this model's `_moe` takes SHARED_EXPERT_FUSION (the parallel forms, whose experts and shared experts
    are sharded, do not)."""

    def _fuse_shared_experts(self, m: str) -> bool:
        """SHARED_EXPERT_FUSION for the MoE layer of prefix m: the n shared experts appended to the routed ones as n
        experts of the routed shape (the shared gate|up rows j*I..(j+1)*I, the down columns likewise), in place of
        the routed tensors in the weights; False (nothing changed) where the layer does not take it."""
        cfg, w = self.cfg, self.w
        if not (SHARED_EXPERT_FUSION and self.fuses_shared_experts and cfg.num_shared_experts
                and not cfg.routed_expert_hidden_size and not self.experts_packed and m + "experts.w13" in w):
            return False
        w13, w2 = w[m + "experts.w13"], w[m + "experts.w2"]
        s = m + "shared_experts."
        gate, up, down = w[s + "gate_proj.weight"], w[s + "up_proj.weight"], w[s + "down_proj.weight"]
        E, two_i, d = w13.shape
        n, i_ = cfg.num_shared_experts, two_i // 2
        if gate.shape != (n * i_, d) or down.shape != (d, n * i_) or gate.dtype != w13.dtype:
            return False
        if w13.is_cuda:
            need = (w13[0].numel() + w2[0].numel()) * (E + n) * w13.element_size()
            if torch.cuda.mem_get_info(w13.device)[0] < need + SHARED_EXPERT_FUSION_HEADROOM:
                return False
        sh13 = torch.cat([gate.view(n, i_, d), up.view(n, i_, d)], 1)  # [n, 2I, D]: expert j's gate rows, then up
        sh2 = down.view(d, n, i_).transpose(0, 1)  # [n, D, I]
        w[m + "experts.w13"] = torch.cat([w13, sh13], 0)
        w[m + "experts.w2"] = torch.cat([w2, sh2], 0)
        return True

    def _merge(self, prefix: str, names: list[str]) -> None:
        """Replace the projections `names` (all applied to the same input) by ONE matrix `in_proj_merged`."""
        parts = [self.w.pop(prefix + n + ".weight") for n in names]
        self.w[prefix + "in_proj_merged.weight"] = torch.cat(parts, 0)
        self.split[prefix] = [t.shape[0] for t in parts]

    def _cast_acc(self, name: str) -> None:
        if name in self.w:
            self.acc_w[name] = self.w[name].to(self.acc)

    def _in_proj(self, w: LayerWeights, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The merged input projections of a layer (see `_merge`), split back into their parts."""
        return linear(x, w["in_proj_merged.weight"]).split(self.split[w.prefix], dim=-1)

    # -- layers --------------------------------------------------------------------------------
    def _kda(self, i: int, x: torch.Tensor, b: ForwardBatch) -> torch.Tensor:
        cfg = self.cfg
        w = LayerWeights(self.w, f"model.layers.{i}.self_attn.")
        group, j = self.layer_map[i]
        gi = self.group_index[group.group_id]
        T = x.shape[0]
        h, d = cfg.kda_num_heads, cfg.kda_head_dim
        P = h * d
        qkv, f_a, b_logit, g_in = self._in_proj(w, x)
        raw_g = linear(f_a, w["f_b_proj.weight"]).view(T, h, d)
        gate = linear(g_in, w["g_b_proj.weight"]) if "g_b_proj.weight" in w else g_in
        if b.is_decode:
            # one token per sequence: conv update, gates, delta rule and gated norm in one fused op; it reads
            # qkv, the beta logits and the gate in place as column slices of the merged projection (no copies)
            y = ops.kda_decode(qkv, self.conv_w[i], self.kv.conv_view(j), raw_g, w["A_log"], w["dt_bias"],
                               b_logit, gate, w["o_norm.weight"], self.kv.ssm_view(j),
                               b.state_indices[gi], b.has_initial_state, lower_bound=cfg.gate_lower_bound,
                               scale=d ** -0.5, eps=cfg.rms_norm_eps)
            return linear(y.reshape(T, P), w["o_proj.weight"], x.dtype)
        if (b.spec is None or b.spec.kda_mix is None) and self._short_rows(b):
            # every sequence a few tokens (verify chunks, decodes): conv + gate + the delta rule token by token,
            # checkpoint exports from the per-token states, not the chunked form, and the gated output norm
            # (kernels/cpu/kda_verify.py; on CUDA one launch of kernels/triton/kda_verify.py, which reads every
            # index on the device and qkv / beta / gate in place: a capturable step)
            y = ops.kda_verify(qkv, self.conv_w[i], self.kv.conv_view(j), raw_g, w["A_log"], w["dt_bias"], b_logit,
                               self.kv.ssm_view(j), b.state_indices[gi], b.cu_seqlens, b.has_initial_state,
                               lower_bound=cfg.gate_lower_bound, scale=d ** -0.5, **self._ckpt(b, gi), gate=gate,
                               o_norm_weight=self.acc_w[w.prefix + "o_norm.weight"], eps=cfg.rms_norm_eps)
            return linear(y.reshape(T, P), w["o_proj.weight"])
        glue = KDA_PREFILL_GLUE
        if b.spec is not None and b.spec.kda_mix is not None:  # a rollback scheme's verify (spec/rollback.py)
            o = b.spec.kda_mix(self, i, j, gi, qkv.contiguous(), raw_g, b_logit, b)
        else:
            # qkv stays a column slice of the merged projection: the conv reads it at its row stride, and the
            # chunked KDA reads q, k, v as column slices of the conv's output (no copies on CUDA)
            ck = self._ckpt(b, gi)
            qkv = ops.causal_conv1d_varlen(qkv if glue else qkv.contiguous(), self.conv_w[i], self.kv.conv_view(j),
                                           b.state_indices[gi], b.cu_seqlens, b.has_initial_state, activation="silu",
                                           **ck)
            q, k, v = (t.reshape(T, h, d) if glue else t.reshape(T, h, d).contiguous() for t in qkv.split(P, dim=-1))
            g = (ops.kda_gate if glue else reference.kda_gate)(raw_g, w["A_log"], w["dt_bias"], cfg.gate_lower_bound)
            beta = torch.sigmoid(cast(b_logit, self.acc))
            o = ops.kda_chunked(q, k, v, g, beta, self.kv.ssm_view(j), b.state_indices[gi], b.cu_seqlens,
                                b.has_initial_state, scale=d ** -0.5, use_qk_l2norm=True, **ck,
                                host=b.kda_host[gi] if b.kda_host else None)
        # the gated output norm in the accumulation dtype, rounded once to x's (one kernel on CUDA)
        norm_w = self.acc_w[w.prefix + "o_norm.weight"]
        if glue:
            o = ops.rms_norm_gated(o, gate.reshape(T, h, d), norm_w, cfg.rms_norm_eps, x.dtype)
        else:
            o = ops.rms_norm(cast(o, self.acc), norm_w, cfg.rms_norm_eps)
            o = cast(o * torch.sigmoid(cast(gate.reshape(T, h, d), self.acc)), x.dtype)
        return linear(o.reshape(T, P), w["o_proj.weight"])

    @staticmethod
    def _short_rows(b: ForwardBatch) -> bool:
        """Every sequence of the batch at most ops' KDA_VERIFY_MAX_TOKENS tokens (kernels/cpu/kda_verify.py).

        From the batch's host field `max_query_len` (no device read: a CUDA step stays free of host syncs);
        a batch built without it falls back to reading cu_seqlens."""
        cu = b.cu_seqlens
        if cu.numel() <= 1:
            return False
        n = b.max_query_len
        if n is None:
            n = int((cu[1:] - cu[:-1]).max())
        return 1 <= n <= ops.KDA_VERIFY_MAX_TOKENS

    @staticmethod
    def _ckpt(b: ForwardBatch, gi: int) -> dict:
        if b.checkpoint_seq is None:
            return {}
        return dict(checkpoint_seq=b.checkpoint_seq, checkpoint_offsets=b.checkpoint_offsets,
                    checkpoint_slots=b.checkpoint_slots[gi])

    def _mla(self, i: int, x: torch.Tensor, b: ForwardBatch) -> torch.Tensor:
        cfg = self.cfg
        w = LayerWeights(self.w, f"model.layers.{i}.self_attn.")
        group, j = self.layer_map[i]
        gi = self.group_index[group.group_id]
        T = x.shape[0]
        h, dn, dr, dv, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                            cfg.v_head_dim, cfg.kv_lora_rank)
        eps = cfg.rms_norm_eps
        q_in, kv_a, *g_in = self._in_proj(w, x)
        if cfg.q_lora_rank:
            q = linear(ops.rms_norm(q_in, w["q_a_layernorm.weight"], eps), w["q_b_proj.weight"])
        else:
            q = q_in
        q = q.view(T, h, dn + dr)
        q_nope, q_pe = q[..., :dn], q[..., dn:]
        c_kv = ops.rms_norm(kv_a[:, :r], w["kv_a_layernorm.weight"], eps)
        k_pe = kv_a[:, r:]
        if not cfg.mla_use_nope:
            q_pe = rope_interleaved(q_pe, b.positions, cfg.rope_theta)
            k_pe = rope_interleaved(k_pe, b.positions, cfg.rope_theta)
        cache = self.kv.mla_view(j)
        ops.mla_write_cache(c_kv, k_pe, cache, b.slot_mapping[gi])
        q_lat = torch.einsum("thn,hnl->thl", q_nope, self.w_uk[i])
        o_lat = ops.mla_paged_attention(q_lat, q_pe.contiguous(), cache, b.block_tables[gi], b.seq_lens,
                                        b.cu_seqlens, (dn + dr) ** -0.5, kv_lora_rank=r)
        o = torch.einsum("thl,hvl->thv", cast(o_lat, x.dtype), self.w_uv[i])
        if cfg.mla_use_output_gate:
            o = o * self._gate_sigmoid(g_in[0].reshape(T, h, dv), x.dtype)
        return linear(o.reshape(T, h * dv), w["o_proj.weight"])

    def _gate_sigmoid(self, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return gate_sigmoid(g, dtype, self.acc)

    def _act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.cfg.hidden_act == "situ":
            return ops.situ_and_mul(gate_up, self.cfg.situ_beta, self.cfg.situ_linear_beta)
        return ops.silu_and_mul(gate_up)

    def _dense_mlp(self, w: LayerWeights, gate_up: torch.Tensor) -> torch.Tensor:
        """The gated MLP from its (merged) gate|up projection."""
        return linear(self._act_mul(gate_up), w["down_proj.weight"])

    def _route(self, w: LayerWeights, logits: torch.Tensor, shared_experts: int = 0) -> tuple[torch.Tensor, ...]:
        """`route` for the MoE layer of w's prefix (its correction bias in the accumulation dtype)."""
        return route(self.cfg, logits, self.acc_w.get(w.prefix + "gate.e_score_correction_bias"), shared_experts)

    def _expert_input(self, w: LayerWeights, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(z, parts): the routed experts' input (the LatentMoE down-projection of x, or x itself) and the rest of
        the layer's merged projection of x ([the shared experts' gate|up], or [] without shared experts)."""
        parts = list(self._in_proj(w, x)) if w.prefix in self.split else []  # [latent z], [shared gate|up]
        return (parts.pop(0) if self.cfg.routed_expert_hidden_size else x), parts

    def _latent_up(self, w: LayerWeights, r: torch.Tensor) -> torch.Tensor:
        """The LatentMoE tail: the routed experts' weighted sum (latent width) normed and projected back to the
        hidden size; r unchanged in a layer without a latent."""
        cfg = self.cfg
        if not cfg.routed_expert_hidden_size:
            return r
        if cfg.latent_moe_use_norm:
            r = ops.rms_norm(r, w["routed_expert_norm.weight"], cfg.rms_norm_eps)
        return linear(r, w["routed_expert_up_proj.weight"])

    @property
    def _act(self) -> dict:
        return expert_act(self.cfg)

    def _moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        w = LayerWeights(self.w, f"model.layers.{i}.block_sparse_moe.")
        fused = self.shared_fused.get(i) if x.shape[0] <= SHARED_EXPERT_FUSION_MAX_TOKENS else None
        weights, ids = self._route(w, linear(x, self.acc_w[w.prefix + "gate.weight"], self.acc),
                                   cfg.num_shared_experts if fused else 0)
        if fused:  # the shared experts are experts E.. of this pass (SHARED_EXPERT_FUSION): nothing else to add
            return ops.moe_experts(x, weights, ids, w13=fused["experts.w13"], w2=fused["experts.w2"], **self._act)
        # one GEMM for every projection of x: the latent down-projection, the shared experts' gate|up
        z, parts = self._expert_input(w, x)
        if self.experts_packed:
            ex = dict(w13_packed=w["experts.w13_packed"], w13_scale=w["experts.w13_scale"],
                      w2_packed=w["experts.w2_packed"], w2_scale=w["experts.w2_scale"])
        else:
            ex = dict(w13=w["experts.w13"], w2=w["experts.w2"])
        r = self._latent_up(w, ops.moe_experts(z, weights, ids, **ex, **self._act))
        if cfg.num_shared_experts:
            r = r + self._dense_mlp(w.sub("shared_experts."), parts[0])
        return r

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.is_moe_layer(i):
            return self._moe(i, x)
        w = LayerWeights(self.w, f"model.layers.{i}.mlp.")
        return self._dense_mlp(w, self._in_proj(w, x)[0])

    def _attn(self, i: int, x: torch.Tensor, b: ForwardBatch) -> torch.Tensor:
        return self._kda(i, x, b) if self.cfg.is_kda_layer(i) else self._mla(i, x, b)

    # -- the stack -----------------------------------------------------------------------------
    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, H] (a TP rank overrides it: workers/engine/parallel/layers.py)."""
        return cast(self.w["model.embed_tokens.weight"][ids], self.dtype)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """LM head over the final-normed rows (a TP rank overrides it: workers/engine/parallel/layers.py)."""
        return cast(linear(h, self.w["lm_head.weight"]), self.acc)

    @torch.inference_mode()
    def forward(self, b: ForwardBatch) -> torch.Tensor:
        """Returns logits [S, V] (float32, or float64 for float64 models) for `b.logits_indices`."""
        if PIN_KERNELS:
            with ops.pinned_kernels():  # K3SERVE_KERNELS read once for the whole pass (kernels/ops.py)
                return self._forward(b)
        return self._forward(b)

    def _forward(self, b: ForwardBatch) -> torch.Tensor:
        """`forward`'s pass."""
        cfg, W = self.cfg, self.w
        emb = self._embed(b.input_ids)
        eps = cfg.rms_norm_eps
        L = cfg.num_hidden_layers
        round_dtype = None if self.dtype in (torch.float32, torch.float64) else self.dtype
        if cfg.attn_res_block_size is None and FUSED_ADD_NORM:
            hsum = emb
            x = ops.rms_norm(hsum, W["model.layers.0.input_layernorm.weight"], eps)
            for i in range(L):
                lw = LayerWeights(W, f"model.layers.{i}.")
                x, hsum = ops.add_rms_norm(self._attn(i, x, b), hsum, lw["post_attention_layernorm.weight"], eps)
                m = self._mlp(i, x)
                if i + 1 < L:  # the next layer's input norm with this add
                    x, hsum = ops.add_rms_norm(m, hsum, W[f"model.layers.{i + 1}.input_layernorm.weight"], eps)
                else:
                    hsum = m + hsum  # (the final norm reads only the logits rows, below)
            h = hsum
        elif cfg.attn_res_block_size is None:
            hsum = emb
            for i in range(L):
                lw = LayerWeights(W, f"model.layers.{i}.")
                hsum = hsum + self._attn(i, ops.rms_norm(hsum, lw["input_layernorm.weight"], eps), b)
                hsum = hsum + self._mlp(i, ops.rms_norm(hsum, lw["post_attention_layernorm.weight"], eps))
            h = hsum
        else:
            B = cfg.attn_res_block_size
            nb = cfg.num_attn_res_blocks
            T = emb.shape[0]
            blocks = torch.zeros(T, nb, emb.shape[1], dtype=self.dtype, device=emb.device)
            partial = emb.clone()
            delta = None
            for i in range(L):
                lw = LayerWeights(W, f"model.layers.{i}.")
                write = i % B == 0
                prev = -(-i // B)
                x = ops.attn_res(partial, delta, blocks, lw["self_attention_res_norm.weight"],
                                 lw["self_attention_res_proj.weight"], lw["input_layernorm.weight"], prev,
                                 i // B if write else -1, eps, round_dtype=round_dtype)
                a = self._attn(i, x, b)
                if write:
                    partial.copy_(a)
                    delta = None
                else:
                    delta = a
                y = ops.attn_res(partial, delta, blocks, lw["mlp_res_norm.weight"], lw["mlp_res_proj.weight"],
                                 lw["post_attention_layernorm.weight"], prev + int(write), -1, eps,
                                 round_dtype=round_dtype)
                delta = self._mlp(i, y)
            h = ops.attn_res(partial, delta, blocks, W["model.output_attn_res_norm.weight"],
                             W["model.output_attn_res_proj.weight"], None, nb, -1, eps, round_dtype=round_dtype)
        if self.keep_hidden:
            self.hidden = h
        h = h[b.logits_indices]
        h = ops.rms_norm(h, W["model.norm.weight"], eps)
        return self._logits(h)
