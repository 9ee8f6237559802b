"""Scheduler: continuous batching with chunked prefill, FCFS admission, preemption by recompute.

Each `schedule()` returns a `SchedulerOutput` (workers/engine/scheduler_output.py) — deltas the
model runner applies to the block tables it keeps: new requests' tables once, then the blocks each
step appends, the tokens to compute, in-pass snapshot exports, page copies, and the step's KV
connector metadata. Running sequences are served first (decodes and unfinished prefills alike, in
arrival order), then waiting ones, all under `max_num_batched_tokens` and `max_num_seqs`. When
pages run out, the most recently arrived running sequence is preempted: its pages are released
(its cached prefix pages stay in the prefix cache) and it goes back to the front of the waiting
queue to be recomputed.

After the forward pass, `update_from_output` appends the sampled tokens, applies the token-level
stops (EOS, stop token ids, max_tokens, max_model_len) and the connector's report (finished
loads, confirmed sends, failed loads). Stop *strings* belong to the output processor
(llm_engine.py), which calls `stop_by_string`.

KV connectors (admission with a connector, delayed frees, WAITING_FOR_REMOTE_KV): see
docs/architecture.md, "KV connector API".
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from k3serve.workers.engine.kv_cache.coordinator import KVCacheCoordinator, StepPlan
from k3serve.workers.engine.kv_connector.base import KVConnectorOutput, KVConnectorScheduler, LoadSpec
from k3serve.workers.engine.request import Request, RequestStatus
from k3serve.workers.engine.scheduler_output import NewRequestData, ScheduledChunk, SchedulerOutput

log = logging.getLogger(__name__)

__all__ = ["Scheduler", "SchedulerOutput", "ScheduledChunk", "NewRequestData", "SchedulerStats", "token_budget"]


@dataclass
class SchedulerStats:
    """Counted by the scheduler."""

    num_preemptions: int = 0
    prefill_tokens_computed: int = 0  # prompt (and recomputed) tokens run through the model
    prefill_tokens_skipped: int = 0  # served by the prefix cache or loaded by a connector
    prefill_tokens_loaded: int = 0  # the part of skipped a connector loaded
    load_failures: int = 0  # connector loads that failed (the request recomputed)


def token_budget(max_num_batched_tokens: int, running: list[Request], num_spec_tokens: int) -> int:
    """Tokens available to prefills after reserving speculative capacity.

    Only sequences that are actually running (in the decode phase) can verify drafts next step,
    so speculative slots are reserved for them alone — never for waiting or prefilling ones.
    """
    if not num_spec_tokens:
        return max_num_batched_tokens
    decoding = sum(1 for r in running if r.num_computed_tokens >= r.prefill_end - 1 and not r.is_finished)
    return max(0, max_num_batched_tokens - decoding * num_spec_tokens)


class Scheduler:
    def __init__(self, kv: KVCacheCoordinator, *, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, num_spec_tokens: int = 0, connector: KVConnectorScheduler | None = None,
                 clock: Callable[[], float] = time.monotonic, spec_extra_slots: int | None = None):
        """`spec_extra_slots`: speculative decoding is on (drafts come in `Request.spec_token_ids`, set by
        the engine's proposer; up to `num_spec_tokens` of them verified a step) and each speculating
        request holds that many extra KDA blocks per KDA group (workers/engine/spec/rollback.py)."""
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.num_spec_tokens = num_spec_tokens
        self.connector = connector
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV: async loads in flight
        self.requests: dict[str, Request] = {}
        self.step_id = 0
        self.stats = SchedulerStats()
        # finished requests whose pages are still held: id -> (request, deadline, waiting on "send"|"recv")
        self.delayed_free: dict[str, tuple[Request, float, str]] = {}
        self.held_blocks: dict[int, int] = {}  # block id -> holds a connector asked for
        self._in_runner: set[str] = set()
        self._left_runner: set[str] = set()
        self._sync_loads: list[Request] = []  # admitted this step with a synchronous load
        self.spec_extra_slots = spec_extra_slots
        self.spec_commits: list[tuple[str, int, list]] = []  # (request id, accepted_len, snapshots) of the step
        self.num_appended: dict[str, int] = {}  # tokens update_from_output appended per request this step

    # compatible names (the engine's stats and older tests read these)
    @property
    def num_preemptions(self) -> int:
        return self.stats.num_preemptions

    @property
    def prefill_tokens_computed(self) -> int:
        return self.stats.prefill_tokens_computed

    @property
    def prefill_tokens_skipped(self) -> int:
        return self.stats.prefill_tokens_skipped

    # -- queue management ----------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Mark finished (stop/length/abort) and release its pages (or hold them for a connector)."""
        was_loading = req.status == RequestStatus.WAITING_FOR_REMOTE_KV
        req.status = status
        rid = req.request_id
        if was_loading:
            self.loading.pop(rid, None)
        elif req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.requests.pop(rid, None)
        self._leave_runner(rid)
        if rid not in self.kv.reqs:
            return
        conn = self.connector
        if conn is None:
            self.kv.free(req)
            return
        res = conn.request_finished(req, self.kv.block_ids(req))
        req.kv_transfer_params_out = res.transfer_params
        if was_loading:
            # a transfer may still be writing these pages: hold them until it reports
            self.delayed_free[rid] = (req, self.clock() + max(res.expiry_s, 1.0), "recv")
        elif res.delay_free:
            self.delayed_free[rid] = (req, self.clock() + res.expiry_s, "send")
        else:
            self.kv.free(req)

    def _release(self, rid: str) -> None:
        entry = self.delayed_free.pop(rid, None)
        if entry is not None:
            self.kv.free(entry[0])
            forget = getattr(self.connector, "forget", None)
            if forget is not None:
                forget(rid)

    def _expire_delayed(self) -> None:
        if not self.delayed_free:
            return
        now = self.clock()
        for rid in [r for r, (_q, dl, _w) in self.delayed_free.items() if dl <= now]:
            log.warning("KV connector: request %s's pages held past their expiry; freeing them", rid)
            self._release(rid)

    def _leave_runner(self, rid: str) -> None:
        if rid in self._in_runner:
            self._in_runner.discard(rid)
            self._left_runner.add(rid)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def has_pending_connector_work(self) -> bool:
        return bool(self.loading or self.delayed_free or self.held_blocks)

    # -- the step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.step_id += 1
        self.kv.begin_step(self.step_id)
        self._expire_delayed()
        out = SchedulerOutput(step=self.step_id, finished_req_ids=self._left_runner)
        self._left_runner = set()
        spec = self.spec_extra_slots is not None
        budget = (self.max_num_batched_tokens if spec  # verify chunks count their drafts themselves
                  else token_budget(self.max_num_batched_tokens, self.running, self.num_spec_tokens))
        scheduled: set[str] = set()
        kv = self.kv

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            drafts = self._drafts(req, budget) if spec and n == 1 and req.spec_token_ids else None
            if drafts:
                n = 1 + len(drafts)
                plan = kv.extend(req, n)
                if plan is None:  # no room for the lookahead pages: this step without drafts
                    drafts, n = None, 1
                    plan = kv.extend(req, n)
            else:
                plan = kv.extend(req, n)
            while plan is None:
                victim = self._pick_victim(scheduled)
                if victim is None or victim is req:
                    break
                self._preempt(victim, out)
                i = self.running.index(req)
                plan = kv.extend(req, n)
            if plan is None:
                self._preempt(req, out)
                continue  # `running` shrank: index i now points at the next one
            self._emit(out, req, n, plan, drafts)
            scheduled.add(req.request_id)
            budget -= n
            i += 1

        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.max_num_seqs:
            req = self.waiting[0]
            hit = kv.find_hit(req)
            if hit.defer:
                break  # the state it would reuse is being computed this step (same-step rule)
            ext, is_async = 0, False
            if self.connector is not None and not req.kv_load_failed:
                ext, is_async, hit = self._connector_match(req, hit)
                if ext is None:
                    skipped.append(self.waiting.popleft())  # "ask again later"
                    continue
            start = hit.tokens + ext
            n = 0 if is_async else min(req.num_tokens - start, budget)
            first = req.num_cached_tokens < 0
            if first:
                kv.set_retained_boundaries(req, hit)
            plan = kv.admit(req, hit, n, num_external=ext, first=first)
            if plan is None:
                break
            self.waiting.popleft()
            if self.connector is not None:
                self.connector.update_state_after_alloc(
                    req, LoadSpec(req.request_id, kv.block_ids(req), hit.tokens, ext, is_async))
            if first:
                req.num_cached_tokens = start
            self.stats.prefill_tokens_skipped += start
            self.stats.prefill_tokens_loaded += ext
            req.num_external_tokens = ext
            req.num_computed_tokens = start
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            if is_async:
                req.status = RequestStatus.WAITING_FOR_REMOTE_KV
                self.loading[req.request_id] = req
                out.copies.extend(plan.copies)
                continue
            if ext:
                self._sync_loads.append(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._emit(out, req, n, plan)
            scheduled.add(req.request_id)
            budget -= n
        if skipped:
            self.waiting.extendleft(reversed(skipped))
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(self.step_id)
            for bid in self.connector.take_hold_requests():
                self.kv.pool.touch([self.kv.pool.blocks[bid]])
                self.held_blocks[bid] = self.held_blocks.get(bid, 0) + 1
        return out

    def _connector_match(self, req: Request, hit):
        """Ask the connector past the block-aligned local hit and reconcile (design doc §4.2).
        Returns (external tokens or None for "ask again later", async, the possibly truncated hit)."""
        B = self.kv.B
        local = hit.tokens
        aligned = local - local % B
        m = self.connector.get_num_new_matched_tokens(req, aligned)
        if m.num_tokens is None:
            return None, False, hit
        e = m.num_tokens
        if e <= 0 or aligned + e > req.num_tokens - 1 or aligned + e <= local:
            return 0, False, hit  # nothing longer than the local hit (or no token left to compute)
        # the connector's longer hit wins: keep only the aligned local part (a local tail page is not
        # adopted, no local KDA snapshot is copied: the load writes the state at its end)
        return e, m.is_async, self.kv.truncate_hit(hit, aligned)

    def _drafts(self, req: Request, budget: int) -> list[int] | None:
        """The drafts a decode-phase request verifies this step: within the token budget, the context
        (max_model_len) and max_tokens (the step adds at most drafts + 1 tokens), with its extra KDA
        blocks held (None when the pool has no room for them)."""
        p = req.params
        cap = min(self.num_spec_tokens, budget - 1, self.max_model_len - req.num_tokens)
        if p.max_tokens is not None:
            cap = min(cap, p.max_tokens - req.num_output_tokens - 1)
        if cap <= 0:
            return None
        if self.kv.spec_slots(req, self.spec_extra_slots) is None:
            return None
        return list(req.spec_token_ids[:cap])

    def _emit(self, out: SchedulerOutput, req: Request, n: int, plan: StepPlan,
              drafts: list[int] | None = None) -> None:
        start = req.num_computed_tokens
        rid = req.request_id
        if start < req.prefill_end:
            self.stats.prefill_tokens_computed += min(n, req.prefill_end - start)
        if rid in self._in_runner:
            new_ids = plan.new_block_ids
        else:
            self._in_runner.add(rid)
            st = self.kv.reqs[rid]
            out.new_requests.append(NewRequestData(rid, [[b.block_id for b in blks] for blks in st.mla],
                                                   [b.block_id for b in st.kda]))
            new_ids = []
        if drafts:  # a verify chunk: the last sampled token, then the drafts; logits at every row
            out.chunks.append(ScheduledChunk(rid, [req.all_token_ids[start], *drafts], start, True, new_ids,
                                             plan.checkpoints))
            out.spec_token_ids[rid] = drafts
            out.spec_slots[rid] = self.kv.spec_slots(req, self.spec_extra_slots)
        else:
            toks = req.all_token_ids[start:start + n] if n > 1 else [req.all_token_ids[start]]
            out.chunks.append(ScheduledChunk(rid, toks, start, start + n == req.num_tokens, new_ids,
                                             plan.checkpoints))
        if plan.copies:
            out.copies.extend(plan.copies)
        req.num_computed_tokens = start + n

    def _pick_victim(self, scheduled: set[str]) -> Request | None:
        for r in reversed(self.running):
            if r.request_id not in scheduled:
                return r
        return None

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.spec_token_ids = []  # drafts are dropped: the request recomputes
        self._in_runner.discard(req.request_id)  # the runner drops it through `out.preempted`
        out.preempted.append(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.prefill_end = req.num_tokens
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)

    def end_step(self) -> None:
        self.kv.end_step()

    # -- after the forward pass ----------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int | list[int]],
                           kv_out: KVConnectorOutput | None = None) -> list[Request]:
        """Apply the connector's report, then append each sampled token and apply token-level stops.
        Returns the requests that got a token, in chunk order (finished ones have a final status).

        A verify chunk's entry is a list: the accepted drafts then the correction/bonus token. They are
        appended one by one and the stops apply inside the run (nothing past a stop is kept); a request
        still running then has `num_computed_tokens` = start + tokens appended, and its rollback commit
        (request id, accepted_len, boundary snapshots) is queued in `spec_commits` for the runner."""
        self.spec_commits = []
        self.num_appended = {}
        failed: set[str] = set()
        if kv_out is not None:
            failed = self._apply_connector_output(kv_out)
        for req in self._sync_loads:
            if req.request_id not in failed and req.request_id in self.kv.reqs:
                self.kv.confirm_load(req)
        self._sync_loads = []
        got: list[Request] = []
        kv = self.kv
        for c in out.chunks:
            tok = sampled.get(c.request_id)
            if tok is None:
                continue
            req = self.requests.get(c.request_id)
            if req is None or req.is_finished or c.request_id in failed:
                continue
            got.append(req)
            toks = tok if isinstance(tok, list) else (tok,)
            p = req.params
            n = 0
            for tok in toks:
                n += 1
                req.output_token_ids.append(tok)
                req.all_token_ids.append(tok)
                kv.update_hashes(req)
                nout = len(req.output_token_ids)
                status = None
                if nout >= p.min_tokens:
                    if not p.ignore_eos and tok == req.eos_token_id:
                        status = RequestStatus.FINISHED_STOPPED
                    elif tok in p.stop_token_ids:
                        status, req.stop_reason = RequestStatus.FINISHED_STOPPED, tok
                if status is None and ((p.max_tokens is not None and nout >= p.max_tokens)
                                       or len(req.all_token_ids) >= self.max_model_len):
                    status = RequestStatus.FINISHED_LENGTH
                if status is not None:
                    self.finish(req, status)
                    break
            self.num_appended[c.request_id] = n
            if c.request_id in out.spec_token_ids and not req.is_finished:
                req.num_computed_tokens = c.start + n  # the rejected drafts' positions are recomputed
                self.spec_commits.append((c.request_id, n, kv.commit_spec(req, c.start, n)))
        return got

    def stop_by_string(self, req: Request, stop: str) -> None:
        """The output processor found stop string `stop` in `req`'s text: finish it (stop)."""
        if req.is_finished:
            if req.status == RequestStatus.FINISHED_LENGTH:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = stop
            return
        req.stop_reason = stop
        self.finish(req, RequestStatus.FINISHED_STOPPED)

    def _apply_connector_output(self, kv_out: KVConnectorOutput) -> set[str]:
        if self.connector is not None:
            self.connector.update_connector_output(kv_out)
        for rid in kv_out.finished_recving:
            req = self.loading.pop(rid, None)
            if req is not None:
                req.status = RequestStatus.RUNNING
                self.kv.confirm_load(req)
                self.running.append(req)
            elif rid in self.delayed_free and self.delayed_free[rid][2] == "recv":
                self._release(rid)
        for rid in kv_out.finished_sending:
            if rid in self.delayed_free and self.delayed_free[rid][2] == "send":
                self._release(rid)
        failed = set(kv_out.failed_recving)
        for rid in failed:
            self.stats.load_failures += 1
            if rid in self.delayed_free:
                self._release(rid)
                continue
            req = self.loading.pop(rid, None)
            if req is None:
                req = self.requests.get(rid)
                if req is None or req not in self.running:
                    continue
                self.running.remove(req)
            log.warning("KV connector: load for request %s failed; recomputing it", rid)
            self.kv.discard(req)
            self._leave_runner(rid)
            self.stats.prefill_tokens_skipped -= req.num_external_tokens
            self.stats.prefill_tokens_loaded -= req.num_external_tokens
            req.status = RequestStatus.WAITING
            req.num_computed_tokens = 0
            req.num_external_tokens = 0
            req.prefill_end = req.num_tokens
            req.kv_load_failed = True
            self.waiting.appendleft(req)
        for bid in kv_out.released_blocks:
            n = self.held_blocks.get(bid, 0)
            if n <= 0:
                continue
            if n == 1:
                del self.held_blocks[bid]
            else:
                self.held_blocks[bid] = n - 1
            self.kv.pool.free_blocks([self.kv.pool.blocks[bid]])
        return failed
