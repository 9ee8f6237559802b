"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time (contract in api.py)."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from k3serve.common.block_hash import model_fingerprint
from k3serve.detokenizer import DeferredDetokenizer, IncrementalDetokenizer
from k3serve.kv_events.types import KVEvent
from k3serve.outputs import CompletionOutput, Logprob, RequestOutput
from k3serve.sampling_params import SamplingParams
from k3serve.workers.engine.api import EngineArgs
from k3serve.workers.engine.cache_layout import plan_cache_layout
from k3serve.workers.engine.kv_cache.block_pool import BlockKey, BlockPool, CacheEvent
from k3serve.workers.engine.kv_cache.coordinator import KVCacheCoordinator
from k3serve.workers.engine.kv_connector.base import ConnectorContext, KVConnector, KVConnectorOutput
from k3serve.workers.engine.model_runner import ModelRunner
from k3serve.workers.engine.request import Request, RequestStatus
from k3serve.workers.engine.scheduler import Scheduler
from k3serve.workers.sampler import Sampler, SamplingState, plain_greedy
from k3serve.workers.structured.stage import StructuredStage

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}
DEFAULT_CPU_KV_BYTES = 256 << 20


@dataclass
class SpecDecodeStats:
    """Speculative decoding counters (vLLM's vllm:spec_decode_* metrics, workers/metrics.py)."""

    k: int
    num_drafts: int = 0  # verify chunks with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: drafts accepted at each position

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.k

    def count(self, drafts: list[list[int]], accepted: list[int]) -> None:
        for d, a in zip(drafts, accepted):
            if not d:
                continue
            self.num_drafts += 1
            self.num_draft_tokens += len(d)
            self.num_accepted_tokens += a
            for i in range(a):
                self.accepted_per_pos[i] += 1

    def as_dict(self) -> dict:
        return dict(spec_decode_num_drafts=self.num_drafts, spec_decode_num_draft_tokens=self.num_draft_tokens,
                    spec_decode_num_accepted_tokens=self.num_accepted_tokens,
                    spec_decode_num_accepted_tokens_per_pos=list(self.accepted_per_pos))


@dataclass
class _Seq:
    req: Request
    sampling: SamplingState
    detok: IncrementalDetokenizer | DeferredDetokenizer
    logprobs: list | None = None
    cumulative_logprob: float = 0.0


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seq_ids: list[str]
    arrival: float = field(default_factory=time.monotonic)


class _NullDetokenizer:
    """Stands in for the detokenizer when the engine serves token ids only."""

    text = ""
    stopped_by = None

    def push(self, ids) -> str:
        return ""

    def flush(self) -> str:
        return ""


def resolve_dtype(name: str | torch.dtype, device: str) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "auto"):
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    try:
        dt = _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype: unknown dtype {name!r} (use auto, float32, float64 or bfloat16)") from None
    if dt == torch.float64 and str(device).startswith("cuda"):
        raise ValueError("dtype: float64 is only supported on the CPU")
    return dt


class LLMEngine:
    def __init__(self, args: EngineArgs, kv_connectors: list[KVConnector] | None = None, *, dp=None):
        """`kv_connectors`: pre-built connectors appended after those named by `args` (tests; the
        composition rules are in docs/architecture.md, "KV connector API"). `dp`: this engine's place in a
        DEP group (workers/engine/parallel/dp_engine.py DPContext); `from_args` builds the group's front."""
        from k3serve.tokenizer import K3Tokenizer
        from k3serve.workers.model.loader import load_model_weights

        self.args = args
        self.device = args.device
        self.dtype = resolve_dtype(args.dtype, args.device)
        if dp is None and int(getattr(args, "tensor_parallel_size", 1) or 1) > 1:  # each rank reads its own shard
            from k3serve.workers.model.config import K3Config  # (workers/engine/parallel/shard.py load_shard)

            self.model_config, weights = K3Config.from_pretrained(args.model), None
        else:
            self.model_config, weights = load_model_weights(args.model, dtype=self.dtype, device=args.device)
        if args.skip_tokenizer_init:
            self.tokenizer = None
        else:
            try:
                self.tokenizer = K3Tokenizer.from_dir(args.model)
            except FileNotFoundError as e:
                raise ValueError(f"model: no tokenizer in {args.model} ({e}); pass skip_tokenizer_init=True "
                                 "to serve token ids only") from None
        cfg = self.model_config
        self.max_model_len = int(args.max_model_len or min(cfg.max_position_embeddings, 8192))
        if self.max_model_len < 2:
            raise ValueError("max_model_len: must be at least 2")
        if args.max_num_batched_tokens < 1 or args.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        self.served_model_name = args.served_model_name or args.model.rstrip("/").split("/")[-1]
        tp = int(getattr(args, "tensor_parallel_size", 1) or 1)
        self.spec = self._speculation(args, cfg, tp)  # workers/engine/spec/config.py (None: no speculation)
        self.dp = dp
        if int(getattr(args, "data_parallel_size", 1) or 1) != 1:  # one rank of a DEP group
            if dp is None:
                raise ValueError("data_parallel_size > 1: build the engine with LLMEngine.from_args (the DEP "
                                 "group's front, workers/engine/parallel/dp_front.py)")
            from k3serve.workers.engine.parallel.dp_engine import check_dp_layout

            check_dp_layout(cfg, args)
        elif tp != 1 or int(getattr(args, "nnodes", 1) or 1) != 1 or int(getattr(args, "node_rank", 0) or 0):
            from k3serve.workers.engine.parallel.shard import check_layout  # workers/engine/parallel/

            check_layout(cfg, args)  # a layout that cannot shard the model: one clear error, no rank started
        layout = plan_cache_layout(cfg, self.dtype, args.block_size, tp_size=tp)
        self.layout = layout
        caching = bool(args.enable_prefix_caching)
        min_blocks = layout.min_blocks_for(self.max_model_len, caching)
        if self.spec is not None:  # a speculating request's extra KDA blocks (workers/engine/spec/rollback.py)
            min_blocks += len(layout.kda_groups) * self.spec_scheme.extra_slots(self.spec.num_speculative_tokens)
        kv_bytes = self._kv_budget(args.kv_cache_memory, min_blocks * layout.bytes_per_block)
        num_blocks = kv_bytes // layout.bytes_per_block
        if num_blocks < min_blocks:
            raise ValueError(
                f"kv_cache_memory: {kv_bytes} bytes is too small for one request of max_model_len="
                f"{self.max_model_len}; the minimum is {min_blocks * layout.bytes_per_block} bytes "
                f"({min_blocks} pages of {layout.page_bytes} bytes x {layout.group_size} layers)")
        self.num_blocks = num_blocks
        self.kv_events: list[KVEvent] = []
        self.event_listeners: list[Callable[[KVEvent], None]] = []
        self.pool = BlockPool(num_blocks, eviction=args.prefix_cache_eviction, block_size=layout.block_size,
                              record_events=caching)
        want_connectors = bool(getattr(args, "kv_offload_memory", None) or getattr(args, "kv_connectors", ())
                               or getattr(args, "kv_store", None) or kv_connectors)
        fp = model_fingerprint(args.model) if caching or want_connectors else b"\0" * 32
        self.kv_manager = KVCacheCoordinator(
            layout, self.pool, enable_caching=caching, hash_unit=args.prefix_match_unit,
            retention=args.prefix_cache_retention_interval, selective=args.prefix_cache_selective_retention,
            model_fingerprint=fp)
        self.connector = self._build_connectors(args, fp, list(kv_connectors or ())) if want_connectors else None
        spec = self.spec
        self.scheduler = Scheduler(self.kv_manager, max_num_batched_tokens=args.max_num_batched_tokens,
                                   max_num_seqs=args.max_num_seqs, max_model_len=self.max_model_len,
                                   connector=self.connector.scheduler if self.connector else None,
                                   num_spec_tokens=spec.num_speculative_tokens if spec else 0,
                                   spec_extra_slots=(self.spec_scheme.extra_slots(spec.num_speculative_tokens)
                                                     if spec else None))
        if dp is not None:  # a DEP rank: attention TP=1, routed experts expert-parallel over the group
            from k3serve.workers.engine.parallel.dp_engine import start_dp_runner

            self.runner = start_dp_runner(dp, args, cfg, weights, layout, num_blocks, self.dtype, self.max_model_len)
        elif tp > 1:  # rank 0 of a tensor-parallel group (workers/engine/parallel/launcher.py)
            from k3serve.workers.engine.parallel.launcher import start_parallel_runner

            self.runner = start_parallel_runner(args, cfg, weights, layout, num_blocks, self.dtype,
                                                self.max_model_len)
        else:
            self.runner = ModelRunner(cfg, weights, layout, num_blocks, self.dtype, args.device,
                                      args.max_num_batched_tokens, args.max_num_seqs, self.max_model_len,
                                      cuda_graphs=None if not args.enforce_eager else False,
                                      cuda_graph_max_batch=args.cuda_graph_max_batch)
        if args.static_decode is not None and not args.enforce_eager:
            self.runner.static_decode = bool(args.static_decode)
        if self.connector is not None:
            self.connector.worker.register_kv_caches(self.runner.kv)
        self.sampler = Sampler(seed=args.seed)
        self.spec_stats = SpecDecodeStats(spec.num_speculative_tokens if spec else 0)
        if spec is not None:
            from k3serve.workers.engine.spec.proposers import build_proposer
            from k3serve.workers.engine.spec.rejection_sampler import RejectionSampler

            self.runner.enable_speculation(self.spec_scheme, spec.num_speculative_tokens, args.max_num_seqs,
                                           keep_hidden=spec.method == "mtp")
            self.proposer = build_proposer(spec, cfg, self.runner.model.w, self.dtype, args.enforce_eager)
            self.rejection_sampler = RejectionSampler(self.sampler)
        self.structured = StructuredStage(lambda: self.tokenizer, cfg.vocab_size)  # workers/structured/stage.py
        self.seqs: dict[str, _Seq] = {}
        self.parents: dict[str, _Parent] = {}
        self._ids = itertools.count()
        self.last_step_time = 0.0
        self.num_steps = 0

    def _speculation(self, args: EngineArgs, cfg, tp: int):
        """The checked speculative config (None: off) and its rollback scheme class (`spec_scheme`)."""
        from k3serve.workers.engine.spec.config import speculative_config_from

        spec = speculative_config_from(getattr(args, "speculative_config", None))
        self.spec_scheme = None
        if spec is None:
            return None
        spec.check_model(cfg)
        if tp != 1:
            raise ValueError("speculative_config: not implemented with tensor_parallel_size > 1")
        from k3serve.workers.engine.spec.rollback import scheme_class

        self.spec_scheme = scheme_class(spec.rollback)
        return spec

    @staticmethod
    def freeze_gc() -> None:
        """For a process that serves one engine for its lifetime: move every object alive now (the
        pool's blocks, the weights) out of the cyclic GC's scans; a full collection over a large pool
        otherwise costs milliseconds per step (benchmarks/engine_overhead.py --gc default). Objects
        frozen are never collected as cycles, so do not call it where engines come and go (tests)."""
        import gc

        gc.collect()
        gc.freeze()

    @classmethod
    def from_args(cls, args: EngineArgs) -> LLMEngine:
        if int(getattr(args, "data_parallel_size", 1) or 1) > 1:  # one engine over M data-parallel ranks
            from k3serve.workers.engine.parallel.dp_front import DPEngine

            return DPEngine(args)
        return cls(args)

    def _kv_budget(self, spec, minimum: int) -> int:
        if spec is None:
            if str(self.device).startswith("cuda"):
                spec = 0.5
            else:
                return max(DEFAULT_CPU_KV_BYTES, 4 * minimum)
        if isinstance(spec, float) and 0 < spec <= 1 and str(self.device).startswith("cuda"):
            free, _total = torch.cuda.mem_get_info()
            return int(free * spec)
        spec = int(spec)
        if spec <= 0:
            raise ValueError(f"kv_cache_memory: must be a positive number of bytes (got {spec})")
        return spec

    def _build_connectors(self, args: EngineArgs, fp: bytes, extra: list[KVConnector]) -> KVConnector:
        import os
        import uuid

        from k3serve.workers.engine.kv_connector.composite import compose
        from k3serve.workers.engine.kv_connector.factory import build_connector

        ctx = ConnectorContext(layout=self.layout, hash_unit=args.prefix_match_unit or self.layout.block_size,
                               model_fingerprint=fp, device=str(args.device),
                               engine_id=f"{os.getpid()}-{uuid.uuid4().hex[:12]}",
                               enable_prefix_caching=bool(args.enable_prefix_caching), args=args)
        names = (["host-offload"] if getattr(args, "kv_offload_memory", None) else []) + list(
            getattr(args, "kv_connectors", ()) or ())
        if getattr(args, "kv_store", None) and "mooncake-store" not in names:
            names.append("mooncake-store")  # the store tier after the host tier (docs/kvstore.md)
        conns = [build_connector(n, ctx) for n in names] + extra
        conn = compose(ctx, conns)
        self.kv_manager.attach_connector(conn.scheduler)
        return conn

    # -- cache events --------------------------------------------------------------------------
    def _publish_events(self) -> None:
        """Deliver the pool's queued key changes (once per step)."""
        evs = self.pool.drain_events()
        if not evs or not self.event_listeners:
            return
        for e in evs:
            ev = self._to_kv_event(e)
            for fn in list(self.event_listeners):
                fn(ev)

    def _to_kv_event(self, e: CacheEvent) -> KVEvent:
        h, gid = e.key
        return KVEvent(e.kind, h, e.parent, gid, self.layout.groups[gid].kind, e.num_tokens, self.layout.block_size)

    def _event(self, kind: str, key: BlockKey, block, num_tokens: int) -> KVEvent:
        return self._to_kv_event(CacheEvent(kind, key, block.block_id, num_tokens, block.key_parent.get(key)))

    def subscribe_kv_events(self, fn: Callable[[KVEvent], None]) -> Callable[[], None]:
        """Call `fn` for every prefix-cache change from now on; returns an unsubscribe function."""
        self.event_listeners.append(fn)
        return lambda: self.event_listeners.remove(fn) if fn in self.event_listeners else None

    def kv_cache_snapshot(self) -> list[KVEvent]:
        """The cache's current contents as "stored" events (what a new subscriber starts from)."""
        return [self._event("stored", key, b, b.key_tokens[key]) for key, b in self.pool.cached.items()]

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, prompt: str | None = None,
                    kv_transfer_params: dict | None = None) -> None:
        if request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError("prompt: must contain at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(ids) + 1 > self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room to generate within max_model_len="
                             f"{self.max_model_len}")
        params.validate()
        self.structured.check(params)
        n = params.n
        seq_ids = [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]
        self.parents[request_id] = _Parent(request_id, prompt, ids, seq_ids)
        eos = self.tokenizer.eos_token_id if self.tokenizer else next(iter(self.model_config.eos_token_ids), None)
        for i, sid in enumerate(seq_ids):
            p = params if n == 1 else params.clone()
            if n > 1:
                p.n = 1
                if params.seed is not None:
                    p.seed = params.seed + i
            req = Request(sid, request_id, i, ids, p, eos, cache_salt=cache_salt,
                          kv_transfer_params=kv_transfer_params)
            self.seqs[sid] = _Seq(req, SamplingState.new(p, ids, eos),
                                  self._detokenizer(p),
                                  [] if p.logprobs is not None else None)
            if not self.structured.hold(req, self.seqs[sid].sampling):
                self.scheduler.add(req)

    def _detokenizer(self, p: SamplingParams):
        if self.tokenizer is None:
            if p.stop:
                raise ValueError("stop: stop strings need a tokenizer (the engine runs with skip_tokenizer_init)")
            return _NullDetokenizer()
        if not p.stop and self.defer_detokenization:  # no stop string to watch for: decoded when an output is built
            return DeferredDetokenizer(self.tokenizer, p.skip_special_tokens)
        return IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens, p.stop, p.include_stop_str_in_output)

    def abort_request(self, request_ids) -> list[RequestOutput]:
        """Abort requests now (pages freed at once); returns their final outputs (finish_reason "abort").

        The outputs are returned here rather than from a later `step()`, so a request id may be
        reused right away without a stale abort reaching the new request.
        """
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        finals = []
        for rid in request_ids:
            parent = self.parents.get(rid)
            if parent is None:
                continue
            for sid in parent.seq_ids:
                s = self.seqs.get(sid)
                if s and not s.req.is_finished:
                    self.scheduler.finish(s.req, RequestStatus.FINISHED_ABORTED)
            finals.append(self._make_output(parent))
            self._retire(parent)
        return finals

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.structured)

    def has_pending_connector_work(self) -> bool:
        """Finished requests' pages still pinned for a connector (delayed frees), async loads or block
        holds in flight: a driver that stops stepping when no request is unfinished should still call
        `step()` now and then (say every few ms) while this is true, so confirmations and expiries are
        processed."""
        return self.scheduler.has_pending_connector_work()

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    # -- the step ------------------------------------------------------------------------------
    # True: step() returns the outputs of requests that finished in it only (vLLM's FINAL_ONLY output kind; the
    # offline LLM.generate loop sets it while it runs: it keeps only those), not one per request per step
    final_outputs_only = False
    # requests without stop strings get a DeferredDetokenizer (k3serve/detokenizer.py: the text decoded when an
    # output is built, not token by token); False: the incremental one for every request, as in session 6
    defer_detokenization = True

    def step(self) -> list[RequestOutput]:
        t0 = time.monotonic()
        outputs: list[RequestOutput] = []
        for req in self.structured.pop_ready(block=not self.scheduler.has_unfinished()):
            self.scheduler.add(req)
        sched = self.scheduler.schedule()
        conn = self.connector
        if sched.is_empty and conn is None:
            if self.dp is not None:  # a DEP rank with nothing to run still serves its experts to the others
                self.runner.idle_step()
            self.scheduler.end_step()
            self._publish_events()
            return outputs
        kv_out: KVConnectorOutput | None = None
        logits = None
        try:
            if conn is not None:
                conn.worker.start_load_kv(sched.kv_connector_metadata)
                conn.worker.wait_for_load()
            logits = self.runner.execute(sched)
            if conn is not None:
                conn.worker.save_kv(sched.kv_connector_metadata)
                kv_out = conn.worker.get_finished()
        finally:
            self.scheduler.end_step()
        failed = kv_out.failed_recving if kv_out is not None else ()
        sample_chunks = [c for c in sched.chunks if c.sample]
        drafts = sched.spec_token_ids
        if failed:  # a failed load: that request's step output is discarded (it recomputes)
            keep = [i for i, c in enumerate(sample_chunks) if c.request_id not in failed]
            if logits is not None and len(keep) != len(sample_chunks):
                first = 0
                rows = []
                for c in sample_chunks:  # a verify chunk has 1 + drafts logits rows
                    n = 1 + len(drafts.get(c.request_id, ()))
                    if c.request_id not in failed:
                        rows.extend(range(first, first + n))
                    first += n
                logits = logits[rows]
            sample_chunks = [sample_chunks[i] for i in keep]
        changed: dict[str, _Parent] = {}
        sampled: dict[str, int | list[int]] = {}
        lps: dict[str, object] = {}
        fused = self._fused_spec(sched, sample_chunks, failed, logits) if self.spec is not None else None
        if fused is not None:  # greedy acceptance and the next drafts came back together (one host wait)
            seqs = [self.seqs[c.request_id] for c in sample_chunks]
            req_drafts = [drafts[c.request_id] for c in sample_chunks]
            for s, (toks, _a, _d) in zip(seqs, fused.values()):
                sampled[s.req.request_id] = toks
                lps[s.req.request_id] = None
            self.spec_stats.count(req_drafts, [a for _t, a, _d in fused.values()])
        elif sample_chunks and self.spec is not None:
            seqs = [self.seqs[c.request_id] for c in sample_chunks]
            req_drafts = [drafts.get(c.request_id, []) for c in sample_chunks]
            # a step without drafts (every row a plain decode) and every row plain greedy: the decode step's
            # own argmax (as without speculation), not the rejection sampler's argmax + copy
            toks = None if failed or any(req_drafts) else self._greedy_ids([s.sampling for s in seqs])
            if toks is not None:
                for s, tok in zip(seqs, toks):
                    sampled[s.req.request_id] = [tok]
                    lps[s.req.request_id] = None
                self.spec_stats.count(req_drafts, [0] * len(seqs))
            else:
                result = self.rejection_sampler(logits, [s.sampling for s in seqs], req_drafts)
                for row, (s, run) in enumerate(zip(seqs, result.token_ids)):
                    sampled[s.req.request_id] = [int(t) for t in run]
                    lps[s.req.request_id] = result.logprobs[row] if result.logprobs else None
                self.spec_stats.count(req_drafts, result.num_accepted)
        elif sample_chunks:
            seqs = [self.seqs[c.request_id] for c in sample_chunks]
            states = [s.sampling for s in seqs]
            toks = None if failed else self._greedy_ids(states)
            if toks is not None:  # every row plain greedy: the step's own argmax, no sampler
                for s, tok in zip(seqs, toks):
                    sampled[s.req.request_id] = tok
                    lps[s.req.request_id] = None
            else:
                result = self.sampler(logits, states)
                for row, (s, tok) in enumerate(zip(seqs, result.token_ids)):
                    sampled[s.req.request_id] = int(tok)
                    lps[s.req.request_id] = result.logprobs[row] if result.logprobs else None
        got = self.scheduler.update_from_output(sched, sampled, kv_out)
        if self.spec is not None:
            self.runner.commit_speculation(self.scheduler.spec_commits)
        now = time.monotonic()
        for req in got:
            s = self.seqs[req.request_id]
            tok = sampled[req.request_id]
            if isinstance(tok, list):
                self._process_run(s, tok[:self.scheduler.num_appended.get(req.request_id, 1)],
                                  lps[req.request_id], now)
            else:
                self._process_token(s, tok, lps[req.request_id], now)
            changed[req.parent_id] = self.parents[req.parent_id]
        if self.spec is not None:
            self._propose(sched, failed, fused)
        self._publish_events()
        for parent in changed.values():
            done = all(self.seqs[sid].req.is_finished for sid in parent.seq_ids)
            if done or not self.final_outputs_only:
                outputs.append(self._make_output(parent))
            if done:
                self._retire(parent)
        self.num_steps += 1
        self.last_step_time = time.monotonic() - t0
        return outputs

    def _greedy_ids(self, states: list[SamplingState]) -> list[int] | None:
        """The step's tokens from the runner's in-step argmax (ModelRunner.take_greedy_ids: fixed-shape decode
        steps, inside the CUDA graph on CUDA) when every row is plain greedy (workers/sample/sampler.py
        `plain_greedy`: the sampler would return that argmax and nothing else), else None (the sampler runs)."""
        take = getattr(self.runner, "take_greedy_ids", None)
        if take is None or not all(plain_greedy(st) for st in states):
            return None
        return take(len(states))

    def _process_run(self, s: _Seq, toks: list[int], lps, now: float) -> None:
        """The output processor over a verify step's tokens (the scheduler appended them, stopping at a
        token-level stop): one `_process_token` each; a stop string found before the last one finishes
        the request there and the tokens after it are removed."""
        req = s.req
        base = len(req.output_token_ids) - len(toks)
        for i, tok in enumerate(toks):
            self._process_token(s, tok, lps[i] if lps is not None else None, now, last=i == len(toks) - 1)
            if s.detok.stopped_by is not None and i < len(toks) - 1:
                del req.output_token_ids[base + i + 1:]
                del req.all_token_ids[req.num_prompt_tokens + base + i + 1:]
                break

    fused_spec_step = True  # greedy MTP verify steps: acceptance + drafting on the device, one host wait

    def _fused_spec(self, sched, sample_chunks, failed, logits) -> dict | None:
        """A step whose every chunk is a verify chunk of a plain-greedy request, with a drafter that can keep
        acceptance, observe and drafting on the device (workers/engine/spec/mtp_graphs.py `verify_and_draft`):
        {request id: (tokens, accepted, next drafts)} in chunk order, else None (the step takes the
        rejection sampler and `_propose`). The same tokens as `_greedy_fast` and the same drafts as the
        drafter's observe + propose (tests/test_spec_fused.py)."""
        prop = self.proposer
        fn = getattr(prop, "verify_and_draft", None)
        spec = sched.spec_token_ids
        if (fn is None or not self.fused_spec_step or failed or logits is None or not sample_chunks
                or len(sample_chunks) != len(sched.chunks) or not prop.can_fuse(len(sample_chunks))
                or not all(spec.get(c.request_id) for c in sample_chunks)
                or not all(plain_greedy(self.seqs[c.request_id].sampling) for c in sample_chunks)):
            return None
        hidden = self.runner.model.hidden
        if hidden is None or hidden.shape[0] != logits.shape[0]:
            return None
        items = [(self.seqs[c.request_id].req, c.start, spec[c.request_id]) for c in sample_chunks]
        return dict(zip((c.request_id for c in sample_chunks), fn(items, logits, hidden)))

    def _propose(self, sched, failed, fused: dict | None = None) -> None:
        """After the step: feed the drafter what the target verified, then draft for the requests that
        decode next (workers/engine/spec/proposers.py). `fused`: the requests `_fused_spec` already observed
        and drafted for."""
        prop = self.proposer
        if fused is not None:
            for c in sched.chunks:
                s = self.seqs.get(c.request_id)
                req = s.req if s is not None else None
                if (req is not None and not req.is_finished and req.status == RequestStatus.RUNNING
                        and req.num_tokens - req.num_computed_tokens == 1):
                    req.spec_token_ids = prop.drafts_for(req, fused[c.request_id][2])
            return
        hidden = self.runner.model.hidden if prop.needs_hidden else None
        first = 0
        decoding, seen = [], []
        for c in sched.chunks:
            n = len(c.token_ids)
            s = self.seqs.get(c.request_id)
            req = s.req if s is not None else None
            if req is None or req.is_finished or c.request_id in failed or req.status != RequestStatus.RUNNING:
                first += n
                continue
            if hidden is not None:
                verified = req.num_computed_tokens - c.start  # a verify chunk keeps 1 + accepted drafts
                seen.append((req, c.start, hidden[first:first + verified], verified))
            first += n
            if req.num_tokens - req.num_computed_tokens == 1:
                decoding.append(req)
        if seen:
            prop.observe_batch(seen)
        if not decoding:
            return
        batch = getattr(prop, "propose_batch", None)  # all requests at once (a test drafter may lack it)
        for req, d in zip(decoding, batch(decoding) if batch else [prop.propose(r) for r in decoding]):
            req.spec_token_ids = d

    def _process_token(self, s: _Seq, tok: int, lp, now: float, last: bool = True) -> None:
        """The output processor: the scheduler appended `tok` and applied the token-level stops;
        here logprobs, detokenization and stop strings (which finish the request through the
        scheduler)."""
        req = s.req
        s.sampling.output_token_ids.append(tok)
        if req.first_token_time is None:
            req.first_token_time = now
        req.last_token_time = now
        if lp is not None and s.logprobs is not None:
            entry = {}
            for tid, val, rank in lp:
                if tid not in entry:
                    entry[tid] = Logprob(val, rank, self.tokenizer.decode([tid]) if self.tokenizer else None)
            s.logprobs.append(entry)
            s.cumulative_logprob += lp[0][1]
        # EOS / stop id / length, set by the scheduler (at the last token of a verify step's run)
        by_token = req.status if req.is_finished and last else None
        s.detok.push([tok])
        stop = s.detok.stopped_by
        if stop is not None and by_token in (None, RequestStatus.FINISHED_LENGTH):
            self.scheduler.stop_by_string(req, stop)
        elif by_token is not None and stop is None:
            s.detok.flush()

    def _make_output(self, parent: _Parent) -> RequestOutput:
        outs = []
        for sid in parent.seq_ids:
            s = self.seqs[sid]
            r = s.req
            fr = r.status.value if r.is_finished else None
            outs.append(CompletionOutput(
                index=r.index, text=s.detok.text, token_ids=list(r.output_token_ids),
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=fr, stop_reason=r.stop_reason))
        first = self.seqs[parent.seq_ids[0]].req
        finished = all(o.finish_reason is not None for o in outs)
        metrics = dict(arrival_time=parent.arrival, first_scheduled_time=first.first_scheduled_time,
                       first_token_time=first.first_token_time, last_token_time=first.last_token_time,
                       num_preemptions=sum(self.seqs[s].req.num_preemptions for s in parent.seq_ids))
        out = RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outs, finished,
                            num_cached_tokens=max(first.num_cached_tokens, 0), metrics=metrics)
        if finished and first.kv_transfer_params_out is not None:
            out.kv_transfer_params = first.kv_transfer_params_out
        return out

    def _retire(self, parent: _Parent) -> None:
        for sid in parent.seq_ids:
            self.seqs.pop(sid, None)
            if self.spec is not None:
                self.proposer.drop(sid)
        self.parents.pop(parent.request_id, None)

    # -- introspection -------------------------------------------------------------------------
    def stats(self) -> dict:
        sch = self.scheduler
        kda_total = len(self.layout.kda_groups) and (self.num_blocks - 1)
        kv = self.kv_manager
        pc, ss = kv.stats, sch.stats
        out = dict(
            running=len(sch.running), waiting=len(sch.waiting) + len(sch.loading), free_pages=self.pool.num_free,
            total_pages=self.pool.num_usable, kv_usage=self.pool.usage(),
            kda_slots_used=kv.num_kda_blocks_in_use() + kv.num_cached_kda_blocks(),
            kda_slots_total=kda_total, num_preemptions=ss.num_preemptions,
            prefix_cache_queries=pc.queries, prefix_cache_hits=pc.hits,
            prefix_cache_mla_hits=pc.mla_hits, prefix_cache_kda_hits=pc.kda_hits,
            kda_snapshots_stored=kv.kda.stats.stored, kda_snapshots_evicted=kv.num_evicted_kda(),
            prefill_tokens_computed=ss.prefill_tokens_computed,
            prefill_tokens_skipped=ss.prefill_tokens_skipped,
            block_size=self.layout.block_size, page_bytes=self.layout.page_bytes,
            num_blocks=self.num_blocks, max_model_len=self.max_model_len,
        )
        if self.spec is not None:
            out.update(self.spec_stats.as_dict())
        if self.connector is not None:
            out.update(prefill_tokens_loaded=ss.prefill_tokens_loaded, kv_load_failures=ss.load_failures,
                       kv_pages_held=sum(len(b) for q, _d, _w in sch.delayed_free.values()
                                         for b in kv.block_ids(q)))
            out.update(self.connector.scheduler.stats())
        return out

    def next_request_id(self) -> str:
        return f"req-{next(self._ids)}"


__all__ = ["LLMEngine", "EngineArgs", "KVEvent", "resolve_dtype"]
