"""Running one request on the workers: routing, streaming, retries and resumption.

    run = dispatcher.start(Job(rid, prompt_ids, sampling_kwargs, cache_salt, n, with_logprobs))
    await run.route()                      # picks the worker (run.worker, run.predicted) or raises ProtocolError
    async for deltas in run.deltas():      # list[SeqDelta] in the client's sequence numbering
        ...
    run.prompt_tokens, run.cached_tokens
    await run.aclose()                     # cancels the gRPC calls: the workers abort the request

No lost request: each of the n sequences is followed token by token. When a worker's stream breaks
before a sequence finished (the process died, the engine failed, the stream ended early), the worker is
ejected and each unfinished sequence continues on another worker as a request of its own (n = 1) whose
prompt is the original prompt plus the tokens already streamed, with `max_tokens`/`min_tokens` reduced
by them. The client sees one stream: nothing repeated, nothing dropped. Greedy output is unchanged;
sampled output continues from the same tokens (a `seed` is passed on as given). Only when no worker can
take a sequence (or it failed `max_attempts` times) does the request end with a clean error.
A failure before the first token is a plain retry on another worker. INVALID_ARGUMENT is the client's
fault: a 400 with the worker's message.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass

import grpc

from k3serve.common.block_hash import chain_hashes, root_hash
from k3serve.detokenizer import IncrementalDetokenizer
from k3serve.openai_api import protocol as P
from k3serve.openai_api.deltas import SeqDelta
from k3serve.proto import worker_pb2 as pb
from k3serve.proto.convert import (
    deltas_from_proto,
    kv_transfer_params_from_proto,
    kv_transfer_params_to_proto,
    sampling_to_proto,
)
from k3serve.router.prefix_index import Hit

log = logging.getLogger("k3serve.router.dispatch")

@dataclass
class Job:
    rid: str
    prompt_ids: list[int]
    sampling: dict  # SamplingParams keyword arguments (protocol.sampling_kwargs)
    cache_salt: str | None
    n: int
    with_logprobs: bool


class _StreamBroken(Exception):
    def __init__(self, reason: str, code: grpc.StatusCode | None = None, details: str = ""):
        super().__init__(reason)
        self.reason, self.code, self.details = reason, code, details


@dataclass
class _Sub:
    """One gRPC Generate call: its worker and which client sequences it carries (remote index -> client)."""
    sid: int
    worker: object
    index_map: dict[int, int]
    task: asyncio.Task | None = None
    kv_params: dict | None = None  # P/D: the prefill's transfer parameters (decode hop)


class Dispatcher:
    def __init__(self, registry, index, policy, *, fingerprint: bytes, unit: int | None, metrics,
                 model_name: str, tokenizer=None, max_attempts: int = 3, role: str = "decode",
                 pd_threshold: int = 64, prefill_timeout: float = 300.0, store_timeout: float = 0.02):
        self.registry, self.index, self.policy = registry, index, policy
        self.fingerprint, self.unit = fingerprint, unit
        self.metrics, self.model_name = metrics, model_name
        self.max_attempts = max_attempts
        self.tokenizer = tokenizer
        self.role = role
        self.pd_threshold = pd_threshold  # skip the prefill hop when at most this many tokens are uncached
        self.prefill_timeout = prefill_timeout
        self.store_timeout = store_timeout  # seconds for the one StoreLookup per request (0 disables it)
        self._ids = itertools.count()

    def hash_unit(self, candidates) -> int | None:
        if self.unit:
            return self.unit
        sizes = {self.index.block_size(w.slot) for w in candidates if self.index.ready(w.slot)}
        sizes.discard(0)
        return min(sizes) if len(sizes) == 1 else None

    def _hits(self, cands, prompt_ids: list[int], cache_salt: str | None, store: int = 0) -> dict[int, Hit]:
        """Per candidate slot: max(its own usable hit, the store's joint usable hit) — any worker with the
        store attached can load the store's part (docs/kvstore.md)."""
        unit = self.hash_unit(cands)
        hits = {}
        if unit:
            hashes = chain_hashes(root_hash(self.fingerprint, cache_salt), prompt_ids, unit)
            hits = self.index.predict(hashes, len(prompt_ids), unit, [w.slot for w in cands])
        if store:
            for w in cands:
                if w.has_store is False:
                    continue
                h = hits.get(w.slot, Hit(0, 0))
                if store > h.usable:
                    hits[w.slot] = Hit(store, max(h.mla, store), store - h.usable)
        return hits

    async def store_hit(self, prompt_ids: list[int], cache_salt: str | None) -> int:
        """The store's joint usable hit for a prompt: one StoreLookup on a healthy worker with a store attached
        (or not asked yet), bounded by `store_timeout`. Any failure is 0; NO_STORE marks the worker storeless."""
        if not self.store_timeout or not self.policy.uses_hits:
            return 0
        ws = [w for w in self.registry.workers.values() if w.healthy and w.has_store is not False]
        if not ws:
            return 0
        w = next((c for c in ws if c.has_store), ws[0])
        req = pb.StoreLookupRequest(prompt_token_ids=prompt_ids)
        if cache_salt is not None:
            req.cache_salt = cache_salt
        try:
            resp = await asyncio.wait_for(w.stub.StoreLookup(req, timeout=self.store_timeout),
                                          self.store_timeout + 0.005)
        except (TimeoutError, grpc.RpcError) as e:
            log.debug("store lookup on %s: %s", w.address, e)
            return 0
        if resp.status == pb.StoreLookupResponse.NO_STORE:
            w.has_store = False
            return 0
        w.has_store = True
        return int(resp.num_tokens) if resp.status == pb.StoreLookupResponse.OK else 0

    def choose(self, prompt_ids: list[int], cache_salt: str | None, exclude: set[str], role: str | None = None,
               store: int = 0):
        """(worker, Hit) for a prompt by the policy, or None when no worker can take it."""
        cands = self.registry.candidates(role or self.role, exclude)
        if not cands:
            return None
        t0 = time.perf_counter()
        hits = self._hits(cands, prompt_ids, cache_salt, store) if self.policy.uses_hits else {}
        choice = self.policy.choose(cands, hits, len(prompt_ids))
        self.metrics.decision(self.policy.name, choice.reason, time.perf_counter() - t0)
        return choice.worker, choice.hit

    def pd_enabled(self) -> bool:
        return any(w.role == "prefill" for w in self.registry.candidates("prefill"))

    def choose_decode(self, prompt_ids: list[int], cache_salt: str | None, exclude: set[str], store: int = 0):
        """P/D: the decode worker by load, then free pages; with its own predicted hit (it checks its cache
        before pulling)."""
        cands = [w for w in self.registry.candidates("decode", exclude) if w.role != "prefill"]
        if not cands:
            return None
        from k3serve.router.policy import load_of

        w = min(cands, key=lambda c: (load_of(c, self.policy.weights), -int(c.load.get("free_pages", 0)), c.address))
        hits = self._hits([w], prompt_ids, cache_salt, store)
        return w, hits.get(w.slot, Hit(0, 0))

    def start(self, job: Job) -> Run:
        return Run(self, job)


class Run:
    def __init__(self, d: Dispatcher, job: Job):
        self.d, self.job = d, job
        self.tokens: dict[int, list[int]] = {i: [] for i in range(job.n)}
        self.finished: set[int] = set()
        self.attempts: dict[int, int] = {i: 0 for i in range(job.n)}
        self.prompt_tokens = len(job.prompt_ids)
        self.cached_tokens = 0
        self.worker = None
        self.prefill_worker = None
        self.predicted: Hit | None = None
        self.resumptions = 0
        self._queue: asyncio.Queue = asyncio.Queue()
        self._subs: dict[int, _Sub] = {}
        self._sids = itertools.count()
        self._first: _Sub | None = None
        self._closed = False
        self._pending: list[SeqDelta] = []
        self._detoks: dict[int, IncrementalDetokenizer] = {}  # resumed sequences: the router detokenizes

    # -- routing -------------------------------------------------------------------------------
    async def route(self) -> None:
        """Choose the worker(s) first (so the names and the predicted hit can go into response headers).

        P/D (some worker has the prefill role): the decode worker by load and free pages; a prefill worker by
        the policy's score, unless the decode worker would compute at most `pd_threshold` uncached tokens."""
        d, job = self.d, self.job
        got = None
        store = await d.store_hit(job.prompt_ids, job.cache_salt)
        if d.pd_enabled():
            got = d.choose_decode(job.prompt_ids, job.cache_salt, set(), store)
            if got is not None:
                self.worker, self.predicted = got
                if len(job.prompt_ids) - self.predicted.usable > d.pd_threshold:
                    pre = d.choose(job.prompt_ids, job.cache_salt, {self.worker.address}, role="prefill", store=store)
                    if pre is not None:
                        self.prefill_worker, self.predicted = pre
                else:
                    d.metrics.decision(d.policy.name, "pd-skip", 0.0)
        else:
            got = d.choose(job.prompt_ids, job.cache_salt, set(), store=store)
            if got is not None:
                self.worker, self.predicted = got
        if got is None:
            raise P.ProtocolError("No worker is available to serve this request; retry later.", status_code=503,
                                  code="no_worker_available")
        d.metrics.hit(self.predicted.usable)

    async def _prefill(self) -> dict | None:
        """The prefill hop (docs/serving.md "P/D"): the transfer parameters for the decode worker, or None
        when no prefill worker managed it (the decode worker then computes the whole prompt)."""
        job, d = self.job, self.d
        w, tried = self.prefill_worker, set()
        while w is not None:
            req = pb.GenerateRequest(request_id=f"{job.rid}-p{len(tried)}", prompt_token_ids=job.prompt_ids,
                                     sampling_params=sampling_to_proto(job.sampling),
                                     kv_transfer_params=kv_transfer_params_to_proto({"do_remote_decode": True}))
            if job.cache_salt is not None:
                req.cache_salt = job.cache_salt
            w.inflight += 1
            w.inflight_tokens += len(job.prompt_ids) - self.predicted.usable
            call = w.stub.Generate(req, timeout=d.prefill_timeout)
            try:
                last = None
                async for resp in call:
                    last = resp
                if last is not None and last.HasField("kv_transfer_params"):
                    params = kv_transfer_params_from_proto(last.kv_transfer_params)
                    params.update(do_remote_decode=False, do_remote_prefill=True)
                    return params
                reason = "the prefill worker answered without transfer parameters"
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise P.ProtocolError(e.details() or "invalid request") from None
                reason = f"{e.code().name}: {e.details()}"
                if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    d.registry.eject(w, reason)
            except asyncio.CancelledError:
                call.cancel()
                raise
            finally:
                w.inflight -= 1
                w.inflight_tokens -= len(job.prompt_ids) - self.predicted.usable
            log.warning("request %s: prefill on %s failed (%s)", job.rid, w.address, reason)
            d.metrics.retry("prefill")
            tried.add(w.address)
            nxt = d.choose(job.prompt_ids, job.cache_salt, tried | {self.worker.address}, role="prefill")
            w = nxt[0] if nxt is not None and len(tried) < d.max_attempts else None
        return None

    def _launch(self, worker, prompt_ids: list[int], sampling: dict, index_map: dict[int, int],
                kv_params: dict | None = None, hit: int = 0) -> _Sub:
        sub = _Sub(next(self._sids), worker, index_map, kv_params=kv_params)
        self._subs[sub.sid] = sub
        req = pb.GenerateRequest(request_id=f"{self.job.rid}-{sub.sid}", prompt_token_ids=prompt_ids,
                                 sampling_params=sampling_to_proto(sampling))
        if self.job.cache_salt is not None:
            req.cache_salt = self.job.cache_salt
        if kv_params is not None:
            req.kv_transfer_params.CopyFrom(kv_transfer_params_to_proto(kv_params))
        # the prefill work this puts on the worker: what it will not find cached (its load until it answers)
        uncached = max(1, len(prompt_ids) - hit) if kv_params is None else 1
        worker.inflight += 1
        worker.inflight_tokens += uncached
        sub.task = asyncio.ensure_future(self._pump(sub, req, uncached))
        return sub

    async def _pump(self, sub: _Sub, req, uncached: int) -> None:
        w = sub.worker
        call = w.stub.Generate(req)
        first = True
        try:
            async for resp in call:
                if first:
                    first = False
                    w.inflight_tokens -= uncached
                    uncached = 0
                self._queue.put_nowait((sub.sid, resp))
                if resp.finished:
                    self._queue.put_nowait((sub.sid, None))
                    return
            self._queue.put_nowait((sub.sid, _StreamBroken("the worker ended the stream before the request finished")))
        except grpc.aio.AioRpcError as e:
            self._queue.put_nowait((sub.sid, _StreamBroken(f"{e.code().name}: {e.details()}", e.code(), e.details())))
        except asyncio.CancelledError:
            call.cancel()
            raise
        finally:
            w.inflight -= 1
            w.inflight_tokens -= uncached

    # -- streaming -----------------------------------------------------------------------------
    async def deltas(self):
        job = self.job
        if self.worker is None:
            await self.route()
        params = await self._prefill() if self.prefill_worker is not None else None
        hit = self.predicted.usable if self.prefill_worker is None and self.predicted else 0
        self._first = self._launch(self.worker, job.prompt_ids, job.sampling, {i: i for i in range(job.n)}, params,
                                   hit=hit)
        self.attempts = {i: 1 for i in range(job.n)}
        while len(self.finished) < job.n:
            sid, item = await self._queue.get()
            sub = self._subs.get(sid)
            if sub is None:
                continue
            if item is None:
                self._subs.pop(sid, None)
                missing = [c for c in sub.index_map.values() if c not in self.finished]
                if missing:  # finished=True yet some sequence had no finish reason: resume it
                    await self._recover(sub, _StreamBroken("sequence ended without a finish reason"))
            elif isinstance(item, _StreamBroken):
                self._subs.pop(sid, None)
                await self._recover(sub, item)
            if self._pending:
                out, self._pending = self._pending, []
                yield out
            if item is None or isinstance(item, _StreamBroken):
                continue
            if sub is self._first:
                self.prompt_tokens = item.prompt_tokens or self.prompt_tokens
                self.cached_tokens = item.cached_tokens
            out: list[SeqDelta] = []
            for d in deltas_from_proto(item.outputs, with_logprobs=job.with_logprobs):
                c = sub.index_map.get(d.index)
                if c is None or c in self.finished:
                    continue
                d.index = c
                self.tokens[c].extend(d.token_ids)
                det = self._detoks.get(c)
                if det is not None:
                    self._retext(det, d)
                if d.finish_reason is not None:
                    self.finished.add(c)
                out.append(d)
            if sub.sid in self._subs and all(c in self.finished for c in sub.index_map.values()):
                self._subs.pop(sub.sid)
                sub.task.cancel()
            if out:
                yield out

    @staticmethod
    def _retext(det: IncrementalDetokenizer, d: SeqDelta) -> None:
        """The text of a resumed sequence's delta, as the first worker's detokenizer would have made it
        (workers/engine/llm_engine.py `_append_token`): the new worker knows nothing of the bytes and stop
        string prefixes that were still pending when the old one died."""
        d.text = det.push(d.token_ids)
        if det.stopped_by is not None and d.finish_reason is None:
            d.finish_reason, d.stop_reason = "stop", det.stopped_by
        elif d.finish_reason is not None and det.stopped_by is None:
            d.text += det.flush()

    def _detokenizer_for(self, c: int) -> IncrementalDetokenizer | None:
        if self.d.tokenizer is None:
            return None
        s = self.job.sampling
        det = IncrementalDetokenizer(self.d.tokenizer, s.get("skip_special_tokens", True), s.get("stop") or (),
                                     bool(s.get("include_stop_str_in_output")))
        det.push(self.tokens[c])  # re-creates the pending state; the text was already delivered
        return det

    async def _recover(self, sub: _Sub, err: _StreamBroken) -> None:
        job = self.job
        unfinished = [c for c in sub.index_map.values() if c not in self.finished]
        if not unfinished:
            return
        if err.code == grpc.StatusCode.INVALID_ARGUMENT:
            raise P.ProtocolError(err.details or err.reason)
        if err.code == grpc.StatusCode.FAILED_PRECONDITION and sub.kv_params is not None:
            # the pair cannot exchange state (docs/serving.md "P/D" 4.): the decode worker computes it all
            log.warning("request %s: %s refused the transfer (%s); recomputing there", job.rid, sub.worker.address,
                        err.details)
            self.d.metrics.retry("transfer_refused")
            new = self._launch(sub.worker, job.prompt_ids, job.sampling, dict(sub.index_map))
            if sub is self._first:
                self._first = new
            return
        progressed = any(self.tokens[c] for c in unfinished)
        reason = "resume" if progressed else "retry"
        self.d.registry.eject(sub.worker, err.reason)
        log.warning("request %s: worker %s failed (%s); %s %d sequence(s)", job.rid, sub.worker.address,
                    err.reason, "resuming" if progressed else "retrying", len(unfinished))
        exclude = {sub.worker.address}
        if not progressed and len(unfinished) == len(sub.index_map):
            groups = [(unfinished, dict(sub.index_map))]  # nothing streamed yet: the same request again
        else:
            groups = [([c], {0: c}) for c in unfinished]  # each sequence continues on its own
        for cs, index_map in groups:
            if max(self.attempts[c] for c in cs) >= self.d.max_attempts:
                self.d.metrics.error("worker_failed")
                raise P.ProtocolError(f"The request failed on {self.attempts[cs[0]]} workers: {err.reason}",
                                      status_code=503, code="worker_failed")
            done = self.tokens[cs[0]] if len(index_map) == 1 else []
            prompt = job.prompt_ids + done
            sampling = dict(job.sampling)
            if len(index_map) == 1:
                sampling["n"] = 1
            if sampling.get("max_tokens") is not None:
                sampling["max_tokens"] = sampling["max_tokens"] - len(done)
                if sampling["max_tokens"] <= 0:  # every token arrived, only the finish message was lost
                    self.finished.add(cs[0])
                    self._pending.append(SeqDelta(cs[0], finish_reason="length"))
                    continue
            if sampling.get("min_tokens"):
                sampling["min_tokens"] = max(0, sampling["min_tokens"] - len(done))
            got = self.d.choose(prompt, job.cache_salt, exclude)
            if got is None:
                self.d.metrics.error("no_worker")
                raise P.ProtocolError("No worker is available to continue this request.", status_code=503,
                                      code="no_worker_available")
            worker, new_hit = got
            for c in cs:
                self.attempts[c] += 1
            self.d.metrics.retry(reason)
            if done:
                self.resumptions += 1
                if cs[0] not in self._detoks:
                    det = self._detokenizer_for(cs[0])
                    if det is not None:
                        self._detoks[cs[0]] = det
            new = self._launch(worker, prompt, sampling, index_map, hit=new_hit.usable)
            if sub is self._first and not done:
                self._first = new

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        subs = list(self._subs.values())
        self._subs.clear()
        for s in subs:
            if s.task is not None:
                s.task.cancel()
        for s in subs:
            if s.task is not None:
                with contextlib.suppress(BaseException):
                    await s.task
