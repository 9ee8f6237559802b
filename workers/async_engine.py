"""AsyncEngine: an LLMEngine driven by ONE background thread, consumed from asyncio.

    engine = AsyncEngine(LLMEngine.from_args(args), model_name="k3", metrics=EngineMetrics(...))
    engine.start()
    async for out in engine.generate(rid, prompt_ids, params):   # cumulative RequestOutputs
        ...
    engine.abort(rid)          # from any thread; the stream ends with finish_reason "abort"
    engine.shutdown()

Contract:

* `add_request()` waits until the engine thread has accepted the request, so a rejection
  (ValueError / SamplingParamsError from `LLMEngine.add_request`, e.g. a prompt that cannot fit)
  is raised to the caller before any output; it returns a `RequestStream`.
* `generate()` = `add_request()` + iterate; leaving the iteration early (break, cancellation,
  client disconnect) aborts the request in the engine.
* Request ids must be unique among in-flight requests (`new_request_id()` makes uuid-based ones);
  a duplicate raises DuplicateRequestError (a ValueError).
* Failure containment. An exception from `step()` is contained when it can be: the requests in
  flight (the failed step's batch) are aborted in the engine and their streams raise
  `RequestFailedError` (with the cause in its message); the engine keeps serving new requests. It
  cannot be contained when aborting them fails, when the engine still holds requests afterwards, or
  after `max_consecutive_step_failures` failed steps in a row: then the engine thread ends, every
  in-flight stream raises `EngineDeadError`, later calls raise it at once, `is_healthy()` turns False,
  and `on_fatal()` runs (the servers pass one that stops the process with a non-zero exit status, so
  its supervisor restarts it instead of keeping a live process that cannot serve). Nothing waits forever.
* Other code that must touch the engine runs on the engine thread between steps:
  `await run_on_engine_thread(fn)` returns `fn(engine)` (or raises what it raised);
  `call_soon_on_engine_thread(fn)` is the fire-and-forget form (dropped if the engine is not running).
  `add_engine_hook(after_work, on_stop)` runs `after_work()` on the engine thread after every engine
  step (before that step's outputs are delivered) and after every batch of commands, and
  `on_stop(exc)` once when the engine thread ends (with the EngineDeadError streams get).
* The engine object is only ever touched from the engine thread (after `start()`); `stats()`
  returns the latest `LLMEngine.stats()` snapshot, refreshed at most every `stats_interval_s` while
  busy and right after the engine goes idle (metrics gauges follow the same refreshes).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from k3serve.outputs import CompletionOutput, RequestOutput

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread is not running (it failed, or the engine was shut down)."""


class RequestFailedError(RuntimeError):
    """The engine failed while this request was in its batch; the request was aborted, the engine lives on."""


class DuplicateRequestError(ValueError):
    """A request with this id is already in flight."""


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class _Add:
    rid: str
    prompt: list[int]
    params: object
    cache_salt: str | None
    arrival: float
    ack: asyncio.Future
    loop: asyncio.AbstractEventLoop
    kv_transfer_params: dict | None = None


@dataclass
class _Abort:
    rid: str


@dataclass
class _Call:
    """Run `fn(engine)` on the engine thread; the result goes to `fut` on `loop` (both None: fire and forget)."""

    fn: Callable
    fut: asyncio.Future | None = None
    loop: asyncio.AbstractEventLoop | None = None


@dataclass
class _Live:
    """Engine-thread bookkeeping of an accepted request."""

    prompt: list[int]
    n: int
    last: RequestOutput | None = None


class _Wake:
    pass


def _deliver(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass


def _set_future(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


class RequestStream:
    """Async iterator over one request's cumulative RequestOutputs; ends after the finished one."""

    def __init__(self, engine: AsyncEngine, rid: str, loop: asyncio.AbstractEventLoop):
        self.request_id = rid
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.last: RequestOutput | None = None

    # called on the engine thread
    def _push(self, item: RequestOutput | BaseException) -> None:
        _deliver(self._loop, self._queue.put_nowait, item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.last = item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Abort in the engine unless already finished (idempotent)."""
        if not self.finished:
            self._engine.abort(self.request_id)


class AsyncEngine:
    """Runs `engine` (LLMEngine contract) on a background thread; see the module docstring."""

    def __init__(self, engine, *, model_name: str, metrics=None, idle_wait_s: float = 0.25,
                 stats_interval_s: float = 0.05, clock=time.monotonic, on_fatal: Callable[[], None] | None = None,
                 max_consecutive_step_failures: int = 3):
        self.engine = engine
        self._on_fatal = on_fatal
        self._max_step_failures = max_consecutive_step_failures
        self._step_failures = 0  # consecutive (engine thread only)
        self.num_contained_failures = 0
        self.model_name = model_name
        self.metrics = metrics
        self._idle_wait_s = idle_wait_s
        self._clock = clock
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}  # in flight (guarded by _lock)
        self._accepted: dict[str, _Live] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._error: BaseException | None = None
        self._stats: dict = {}
        self._stats_interval_s = stats_interval_s
        self._stats_at = float("-inf")
        self.started_at: float | None = None
        self._hooks: tuple[tuple[Callable[[], None], Callable | None], ...] = ()  # replaced, never mutated
        self._closed = False  # the engine thread has failed every queued command (guarded by _lock)

    # --- static facts of the wrapped engine -----------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def vocab_size(self) -> int:
        """Token ids the model accepts: the model config's vocab size, else the tokenizer's."""
        cfg = getattr(self.engine, "model_config", None)
        size = getattr(cfg, "vocab_size", None)
        return int(size if size is not None else self.engine.tokenizer.vocab_size)

    # --- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._refresh_stats()
        self._thread = threading.Thread(target=self._run, name="k3serve-engine", daemon=True)
        self.started_at = self._clock()
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._cmds.put(_Wake())
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def is_healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None \
            and not self._stopping.is_set()

    @property
    def error(self) -> BaseException | None:
        return self._error

    def _dead_error(self) -> EngineDeadError:
        if self._error is not None:
            return EngineDeadError(f"engine failed: {type(self._error).__name__}: {self._error}")
        return EngineDeadError("engine is not running")

    def stats(self) -> dict:
        """Latest `LLMEngine.stats()` snapshot (empty dict if the engine has none)."""
        return dict(self._stats)

    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    # --- requests -----------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt_token_ids: list[int], params,
                          cache_salt: str | None = None, kv_transfer_params: dict | None = None) -> RequestStream:
        """Hand a request to the engine thread; returns once accepted (raises what add_request raised)."""
        if not self.is_healthy():
            raise self._dead_error()
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id, loop)
        with self._lock:
            if request_id in self._streams:
                raise DuplicateRequestError(f"request id {request_id!r} is already in flight")
            self._streams[request_id] = stream
        ack = loop.create_future()
        self._submit(_Add(request_id, list(prompt_token_ids), params, cache_salt, self._clock(), ack, loop,
                          kv_transfer_params))
        try:
            await ack
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except BaseException:
            with self._lock:
                self._streams.pop(request_id, None)
            raise
        return stream

    async def generate(self, request_id: str, prompt_token_ids: list[int], params,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Cumulative RequestOutputs until the finished one; early exit aborts the request."""
        stream = await self.add_request(request_id, prompt_token_ids, params, cache_salt)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    # --- running code on the engine thread --------------------------------------------------------
    async def run_on_engine_thread(self, fn: Callable):
        """`fn(engine)` run on the engine thread between steps; returns its result or raises its exception
        (EngineDeadError if the engine is not running). Keep `fn` short: the engine waits for it."""
        if not self.is_healthy():
            raise self._dead_error()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._submit(_Call(fn, fut, loop))
        return await fut

    def call_soon_on_engine_thread(self, fn: Callable) -> None:
        """Queue `fn(engine)` for the engine thread without waiting (thread-safe); dropped if the engine
        is not running. Exceptions are logged."""
        if self.is_healthy():
            self._submit(_Call(fn))

    def add_engine_hook(self, after_work: Callable[[], None],
                        on_stop: Callable[[BaseException], None] | None = None) -> Callable[[], None]:
        """Run `after_work()` on the engine thread after every step (before its outputs are delivered) and
        after every batch of commands; `on_stop(exc)` once when the engine thread ends. Exceptions from
        hooks are logged, never fatal. Returns a function that removes the hook (thread-safe)."""
        entry = (after_work, on_stop)
        with self._lock:
            self._hooks = self._hooks + (entry,)

        def remove() -> None:
            with self._lock:
                self._hooks = tuple(h for h in self._hooks if h is not entry)

        return remove

    def _submit(self, cmd) -> None:
        """Queue a command; if the engine thread has already failed the queue, fail it here (no waiting forever)."""
        with self._lock:
            self._cmds.put(cmd)
            closed = self._closed
        if closed:
            self._fail_queued(self._dead_error())

    def abort(self, request_id: str) -> bool:
        """Abort an in-flight request (thread-safe); returns whether it was in flight."""
        with self._lock:
            known = request_id in self._streams
        if known:
            self._cmds.put(_Abort(request_id))
        return known

    # --- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain_commands(block=not self.engine.has_unfinished_requests())
                if self._stopping.is_set():
                    break
                self._run_hooks()
                if self.engine.has_unfinished_requests():
                    try:
                        self._step()
                        self._step_failures = 0
                    except Exception as e:  # noqa: BLE001 - contained below, or re-raised as fatal
                        self._contain(e)
                # Gauges need no per-step precision: refresh at most every stats_interval_s while busy,
                # and always once idle (so they settle at the final state).
                now = self._clock()
                if now - self._stats_at >= self._stats_interval_s or not self.engine.has_unfinished_requests():
                    self._refresh_stats()
                    self._stats_at = now
        except BaseException as e:  # noqa: BLE001 - the thread must report every failure
            log.exception("engine thread failed")
            self._error = e
        finally:
            exc = self._dead_error()
            for _after, on_stop in self._hooks:
                if on_stop is not None:
                    self._call_hook(on_stop, exc)
            if self._error is not None and self._on_fatal is not None:
                self._call_hook(self._on_fatal)
            self._fail_all(exc)

    def _contain(self, exc: Exception) -> None:
        """A failed step: fail the requests in flight alone and keep the engine, or re-raise (fatal)."""
        self._step_failures += 1
        if self._step_failures > self._max_step_failures:
            log.error("engine step failed %d times in a row; giving up", self._step_failures)
            raise exc
        rids = list(self._accepted)
        log.error("engine step failed; failing the %d request(s) in flight: %s", len(rids), rids[:8],
                  exc_info=exc)
        err = RequestFailedError(f"the engine failed while serving this request: {type(exc).__name__}: {exc}")
        try:
            self.engine.abort_request(rids)
        except Exception as abort_exc:  # noqa: BLE001 - the engine cannot be trusted any more
            log.error("aborting the failed step's requests failed too", exc_info=abort_exc)
            raise exc from abort_exc
        for rid in rids:
            self._accepted.pop(rid, None)
            if self.metrics is not None:
                self.metrics.on_abort(rid, self._clock())
            with self._lock:
                stream = self._streams.pop(rid, None)
            if stream is not None:
                stream._push(err)
        if self.engine.has_unfinished_requests():
            log.error("the engine still holds requests after the failed step's were aborted")
            raise exc
        self.num_contained_failures += 1

    def _run_hooks(self) -> None:
        for after_work, _on_stop in self._hooks:
            self._call_hook(after_work)

    @staticmethod
    def _call_hook(fn, *args) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - a hook must not take the engine down
            log.exception("engine hook failed")

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._cmds.get(timeout=self._idle_wait_s) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd) -> None:
        if isinstance(cmd, _Add):
            try:
                if cmd.kv_transfer_params is not None:  # P/D (workers/kv_transfer/)
                    self.engine.add_request(cmd.rid, cmd.prompt, cmd.params, cache_salt=cmd.cache_salt,
                                            kv_transfer_params=cmd.kv_transfer_params)
                elif cmd.cache_salt is not None:
                    self.engine.add_request(cmd.rid, cmd.prompt, cmd.params, cache_salt=cmd.cache_salt)
                else:
                    self.engine.add_request(cmd.rid, cmd.prompt, cmd.params)
            except Exception as e:  # rejected: report to the caller, the engine is fine
                _deliver(cmd.loop, _set_future, cmd.ack, e)
                return
            self._accepted[cmd.rid] = _Live(cmd.prompt, int(getattr(cmd.params, "n", 1) or 1))
            if self.metrics is not None:
                self.metrics.on_arrival(cmd.rid, len(cmd.prompt), cmd.arrival)
            _deliver(cmd.loop, _set_future, cmd.ack, None)
        elif isinstance(cmd, _Call):
            try:
                result, exc = cmd.fn(self.engine), None
            except Exception as e:  # reported to the caller; the engine is fine
                result, exc = None, e
            if cmd.fut is None:
                if exc is not None:
                    log.error("engine-thread call failed", exc_info=exc)
            elif exc is not None:
                _deliver(cmd.loop, _set_future, cmd.fut, exc)
            else:
                _deliver(cmd.loop, _set_result, cmd.fut, result)
        elif isinstance(cmd, _Abort):
            if cmd.rid not in self._accepted:
                with self._lock:
                    self._streams.pop(cmd.rid, None)
                return
            self.engine.abort_request([cmd.rid])
            live = self._accepted.pop(cmd.rid)
            if self.metrics is not None:
                self.metrics.on_abort(cmd.rid, self._clock())
            with self._lock:
                stream = self._streams.pop(cmd.rid, None)
            if stream is not None:
                stream._push(_aborted_output(cmd.rid, live))

    def _step(self) -> None:
        t0 = self._clock()
        outputs = self.engine.step()
        t1 = self._clock()
        if self.metrics is not None:
            self.metrics.on_step(outputs, t0, t1)
        self._run_hooks()
        for out in outputs:
            if out.request_id not in self._accepted:
                continue
            with self._lock:
                stream = self._streams.get(out.request_id)
                if out.finished:
                    self._streams.pop(out.request_id, None)
            if out.finished:
                self._accepted.pop(out.request_id, None)
            else:
                self._accepted[out.request_id].last = out
            if stream is not None:
                stream._push(out)

    def _refresh_stats(self) -> None:
        fn = getattr(self.engine, "stats", None)
        if fn is None:
            return
        stats = dict(fn())
        self._stats = stats
        if self.metrics is not None:
            self.metrics.on_stats(stats)

    def _fail_all(self, exc: EngineDeadError) -> None:
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for s in streams:
            s._push(exc)
        with self._lock:  # commands queued from now on are failed by _submit itself
            self._closed = True
        self._fail_queued(exc)

    def _fail_queued(self, exc: EngineDeadError) -> None:
        """Fail adds and calls that were queued but never handled (thread-safe)."""
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                _deliver(cmd.loop, _set_future, cmd.ack, exc)
            elif isinstance(cmd, _Call) and cmd.fut is not None:
                _deliver(cmd.loop, _set_future, cmd.fut, exc)


def _aborted_output(rid: str, live: _Live) -> RequestOutput:
    """The final output of an aborted request: what it had so far, unfinished sequences marked "abort"."""
    if live.last is None:
        outs = [CompletionOutput(index=i, text="", token_ids=[], finish_reason="abort") for i in range(live.n)]
        return RequestOutput(request_id=rid, prompt=None, prompt_token_ids=list(live.prompt), outputs=outs,
                             finished=True)
    outs = [c if c.finish_reason else replace(c, finish_reason="abort", token_ids=list(c.token_ids))
            for c in live.last.outputs]
    return replace(live.last, outputs=outs, finished=True)
