"""Scheduler: continuous batching with chunked prefill, FCFS admission, preemption by recompute.

Each `schedule()` returns a `SchedulerOutput` — plain data the model runner consumes: which
sequences run, which tokens (positions `start .. start+n-1`), their block tables, KDA state slots,
in-pass snapshot exports, and page copies to make first. Running sequences are served first
(decodes and unfinished prefills alike, in arrival order), then waiting ones, all under
`max_num_batched_tokens` and `max_num_seqs`. When pages run out, the most recently arrived running
sequence is preempted: its pages are released (its cached prefix pages stay in the prefix cache)
and it goes back to the front of the waiting queue to be recomputed.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from _engine_before.kv_cache_manager import HybridKVCacheManager, SlotPlan
from _engine_before.request import Request, RequestStatus


@dataclass
class ScheduledChunk:
    request_id: str
    token_ids: list[int]  # the tokens to compute (positions start .. start+len-1)
    start: int
    sample: bool  # the chunk reaches the last known token: sample a new one after it
    plan: SlotPlan


@dataclass
class SchedulerOutput:
    step: int
    chunks: list[ScheduledChunk] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


def token_budget(max_num_batched_tokens: int, running: list[Request], num_spec_tokens: int) -> int:
    """Tokens available to prefills after reserving speculative capacity.

    Only sequences that are actually running (in the decode phase) can verify drafts next step,
    so speculative slots are reserved for them alone — never for waiting or prefilling ones.
    """
    decoding = sum(1 for r in running if r.num_computed_tokens >= r.prefill_end - 1 and not r.is_finished)
    return max(0, max_num_batched_tokens - decoding * num_spec_tokens)


class Scheduler:
    def __init__(self, kv: HybridKVCacheManager, *, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, num_spec_tokens: int = 0):
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.num_spec_tokens = num_spec_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.step_id = 0
        self.num_preemptions = 0
        self.prefill_tokens_computed = 0
        self.prefill_tokens_skipped = 0

    # -- queue management ----------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Mark finished (stop/length/abort) and release its pages."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.kv.free(req)
        self.requests.pop(req.request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.step_id += 1
        self.kv.begin_step(self.step_id)
        out = SchedulerOutput(step=self.step_id)
        budget = token_budget(self.max_num_batched_tokens, self.running, self.num_spec_tokens)
        scheduled: set[str] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            plan = self.kv.extend(req, n)
            while plan is None:
                victim = self._pick_victim(scheduled)
                if victim is None or victim is req:
                    break
                self._preempt(victim, out)
                i = self.running.index(req)
                plan = self.kv.extend(req, n)
            if plan is None:
                self._preempt(req, out)
                continue  # `running` shrank: index i now points at the next one
            self._emit(out, req, n, plan)
            scheduled.add(req.request_id)
            budget -= n
            i += 1

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hit = self.kv.find_hit(req)
            if hit.defer:
                break  # the state it would reuse is being computed this step (same-step rule)
            n = min(req.num_tokens - hit.tokens, budget)
            if req.num_cached_tokens < 0:
                self.kv.set_retained_boundaries(req, hit)
            plan = self.kv.admit(req, hit, n)
            if plan is None:
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = hit.tokens
                self.kv.stats["queries"] += req.num_tokens
                self.kv.stats["hits"] += hit.tokens
                self.kv.stats["mla_hits"] += hit.mla_tokens
                self.kv.stats["kda_hits"] += hit.kda_tokens
            self.prefill_tokens_skipped += hit.tokens
            req.num_computed_tokens = hit.tokens
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            self._emit(out, req, n, plan)
            scheduled.add(req.request_id)
            budget -= n
        return out

    def _emit(self, out: SchedulerOutput, req: Request, n: int, plan: SlotPlan) -> None:
        start = req.num_computed_tokens
        toks = req.all_token_ids[start:start + n]
        if start < req.prefill_end:
            self.prefill_tokens_computed += min(n, req.prefill_end - start)
        out.chunks.append(ScheduledChunk(req.request_id, toks, start, start + n == req.num_tokens, plan))
        out.copies.extend(plan.copies)
        req.num_computed_tokens += n

    def _pick_victim(self, scheduled: set[str]) -> Request | None:
        for r in reversed(self.running):
            if r.request_id not in scheduled:
                return r
        return None

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.prefill_end = req.num_tokens
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req.request_id)

    def end_step(self) -> None:
        self.kv.end_step()
