"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time (contract in api.py)."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from k3serve.common.block_hash import model_fingerprint
from k3serve.detokenizer import IncrementalDetokenizer
from k3serve.kv_events.types import KVEvent
from k3serve.outputs import CompletionOutput, Logprob, RequestOutput
from k3serve.sampling_params import SamplingParams
from k3serve.workers.engine.api import EngineArgs
from k3serve.workers.engine.block_pool import Block, BlockKey, BlockPool
from k3serve.workers.engine.cache_layout import plan_cache_layout
from k3serve.workers.engine.kv_cache_manager import HybridKVCacheManager
from k3serve.workers.engine.model_runner import ModelRunner
from k3serve.workers.engine.request import Request, RequestStatus
from k3serve.workers.engine.scheduler import Scheduler
from k3serve.workers.sampler import Sampler, SamplingState
from k3serve.workers.structured.stage import StructuredStage

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}
DEFAULT_CPU_KV_BYTES = 256 << 20


@dataclass
class _Seq:
    req: Request
    sampling: SamplingState
    detok: IncrementalDetokenizer
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
    def __init__(self, args: EngineArgs):
        from k3serve.tokenizer import K3Tokenizer
        from k3serve.workers.model.loader import load_model_weights

        self.args = args
        self.device = args.device
        self.dtype = resolve_dtype(args.dtype, args.device)
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
        layout = plan_cache_layout(cfg, self.dtype, args.block_size)
        self.layout = layout
        caching = bool(args.enable_prefix_caching)
        min_blocks = layout.min_blocks_for(self.max_model_len, caching)
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
                              event_sink=self._on_cache_event if caching else None)
        fp = model_fingerprint(args.model) if caching else b"\0" * 32
        self.kv_manager = HybridKVCacheManager(
            layout, self.pool, enable_caching=caching, hash_unit=args.prefix_match_unit,
            retention=args.prefix_cache_retention_interval, selective=args.prefix_cache_selective_retention,
            model_fingerprint=fp)
        self.scheduler = Scheduler(self.kv_manager, max_num_batched_tokens=args.max_num_batched_tokens,
                                   max_num_seqs=args.max_num_seqs, max_model_len=self.max_model_len)
        self.runner = ModelRunner(cfg, weights, layout, num_blocks, self.dtype, args.device,
                                  args.max_num_batched_tokens, args.max_num_seqs, self.max_model_len,
                                  cuda_graphs=None if not args.enforce_eager else False,
                                  cuda_graph_max_batch=args.cuda_graph_max_batch)
        if args.static_decode is not None and not args.enforce_eager:
            self.runner.static_decode = bool(args.static_decode)
        self.sampler = Sampler(seed=args.seed)
        self.structured = StructuredStage(lambda: self.tokenizer, cfg.vocab_size)  # workers/structured/stage.py
        self.seqs: dict[str, _Seq] = {}
        self.parents: dict[str, _Parent] = {}
        self._ids = itertools.count()
        self.last_step_time = 0.0
        self.num_steps = 0

    @classmethod
    def from_args(cls, args: EngineArgs) -> LLMEngine:
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

    # -- cache events --------------------------------------------------------------------------
    def _on_cache_event(self, kind: str, key: BlockKey, block: Block, num_tokens: int) -> None:
        if not self.event_listeners:
            return
        ev = self._event(kind, key, block, num_tokens)
        for fn in list(self.event_listeners):
            fn(ev)

    def _event(self, kind: str, key: BlockKey, block: Block, num_tokens: int) -> KVEvent:
        h, gid = key
        return KVEvent(kind, h, block.key_parent.get(key), gid, self.layout.groups[gid].kind, num_tokens,
                       self.layout.block_size)

    def subscribe_kv_events(self, fn: Callable[[KVEvent], None]) -> Callable[[], None]:
        """Call `fn` for every prefix-cache change from now on; returns an unsubscribe function."""
        self.event_listeners.append(fn)
        return lambda: self.event_listeners.remove(fn) if fn in self.event_listeners else None

    def kv_cache_snapshot(self) -> list[KVEvent]:
        """The cache's current contents as "stored" events (what a new subscriber starts from)."""
        return [self._event("stored", key, b, b.key_tokens[key]) for key, b in self.pool.cached.items()]

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, prompt: str | None = None) -> None:
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
            req = Request(sid, request_id, i, ids, p, eos, cache_salt=cache_salt)
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

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.monotonic()
        outputs: list[RequestOutput] = []
        for req in self.structured.pop_ready(block=not self.scheduler.has_unfinished()):
            self.scheduler.add(req)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self.scheduler.end_step()
            return outputs
        try:
            logits = self.runner.execute(sched)
        finally:
            self.scheduler.end_step()
        sample_chunks = [c for c in sched.chunks if c.sample]
        changed: dict[str, _Parent] = {}
        if sample_chunks:
            seqs = [self.seqs[c.request_id] for c in sample_chunks]
            result = self.sampler(logits, [s.sampling for s in seqs])
            now = time.monotonic()
            for row, (s, tok) in enumerate(zip(seqs, result.token_ids)):
                lp = result.logprobs[row] if result.logprobs else None
                self._append_token(s, tok, lp, now)
                changed[s.req.parent_id] = self.parents[s.req.parent_id]
        for parent in changed.values():
            outputs.append(self._make_output(parent))
            if all(self.seqs[sid].req.is_finished for sid in parent.seq_ids):
                self._retire(parent)
        self.num_steps += 1
        self.last_step_time = time.monotonic() - t0
        return outputs

    def _append_token(self, s: _Seq, tok: int, lp, now: float) -> None:
        req = s.req
        req.append_output(tok)
        s.sampling.output_token_ids.append(tok)
        self.kv_manager.update_hashes(req)
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
        p = req.params
        nout = req.num_output_tokens
        status = None
        if nout >= p.min_tokens:
            if not p.ignore_eos and tok == req.eos_token_id:
                status = RequestStatus.FINISHED_STOPPED
            elif tok in p.stop_token_ids:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, tok
        s.detok.push([tok])
        if status is None and s.detok.stopped_by is not None:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, s.detok.stopped_by
        if status is None and ((p.max_tokens is not None and nout >= p.max_tokens)
                               or req.num_tokens >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            if status == RequestStatus.FINISHED_LENGTH or s.detok.stopped_by is None:
                s.detok.flush()
            self.scheduler.finish(req, status)

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
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outs, finished,
                             num_cached_tokens=max(first.num_cached_tokens, 0), metrics=metrics)

    def _retire(self, parent: _Parent) -> None:
        for sid in parent.seq_ids:
            self.seqs.pop(sid, None)
        self.parents.pop(parent.request_id, None)

    # -- introspection -------------------------------------------------------------------------
    def stats(self) -> dict:
        sch = self.scheduler
        kda_total = len(self.layout.kda_groups) and (self.num_blocks - 1)
        kv = self.kv_manager
        return dict(
            running=len(sch.running), waiting=len(sch.waiting), free_pages=self.pool.num_free,
            total_pages=self.pool.num_usable, kv_usage=self.pool.usage(),
            kda_slots_used=kv.num_kda_blocks_in_use() + sum(
                1 for b in self.pool.cached.values() if b.kind == "kda"),
            kda_slots_total=kda_total, num_preemptions=sch.num_preemptions,
            prefix_cache_queries=kv.stats["queries"], prefix_cache_hits=kv.stats["hits"],
            prefix_cache_mla_hits=kv.stats["mla_hits"], prefix_cache_kda_hits=kv.stats["kda_hits"],
            kda_snapshots_stored=kv.stats["snapshots_stored"], kda_snapshots_evicted=self.pool.num_evicted_kda,
            prefill_tokens_computed=sch.prefill_tokens_computed,
            prefill_tokens_skipped=sch.prefill_tokens_skipped,
            block_size=self.layout.block_size, page_bytes=self.layout.page_bytes,
            num_blocks=self.num_blocks, max_model_len=self.max_model_len,
        )

    def next_request_id(self) -> str:
        return f"req-{next(self._ids)}"


__all__ = ["LLMEngine", "EngineArgs", "KVEvent", "resolve_dtype"]
