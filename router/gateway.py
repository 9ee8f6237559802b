"""The OpenAI-compatible gateway (FastAPI): what clients talk to; requests go to workers over gRPC.

    app = build_app(Gateway(...))

Routes: GET /v1/models, GET /v1/models/{id}, POST /v1/completions, POST /v1/chat/completions (stream and
non-stream, tools, reasoning, usage, n, logprobs), GET /health, GET /metrics, GET /router/workers (the
registry and prefix index as JSON, for operators and tests).

The request is validated, rendered (chat: the K3 renderer, `k3serve/chat/renderer.py`) and tokenized here
with the same code as `k3serve serve`, so the router hashes exactly the token ids the worker will cache.
Responses are built from the workers' deltas by the shared builders (`k3serve/openai_api/chat_output.py`,
`completion_output.py`). `x-request-id` is taken from the request (or made) and returned on every
response; `x-k3serve-worker` / `x-k3serve-prefill-worker` (P/D) / `x-k3serve-predicted-cached-tokens` / `x-k3serve-predicted-store-tokens` (the part only the store has) tell where a
request went and the reusable prefix the router predicted there. A client that disconnects has its worker calls cancelled
(the workers abort the requests). `request_timeout` bounds a whole request (504 `timeout`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.requests import Request
from starlette.responses import StreamingResponse

from k3serve.chat.renderer import render_chat
from k3serve.openai_api import protocol as P
from k3serve.openai_api.chat_output import ChatOutputBuilder
from k3serve.openai_api.completion_output import CompletionOutputBuilder
from k3serve.openai_api.errors import ApiKeyMiddleware, install_error_handlers
from k3serve.openai_api.logprobs import TokenText
from k3serve.openai_api.text_guards import tokenize_guarded
from k3serve.openai_api.validate import check_params_token_ids, check_token_ids
from k3serve.proto.convert import sampling_to_proto
from k3serve.router.dispatch import Dispatcher, Job, Run
from k3serve.sampling_params import SamplingParams, SamplingParamsError

log = logging.getLogger("k3serve.router.gateway")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


@dataclass
class Gateway:
    tokenizer: object
    model_names: list[str]
    vocab_size: int
    dispatcher: Dispatcher
    metrics: object
    max_model_len: int = 0  # 0: the smallest the workers report
    request_timeout: float = 600.0
    draining: bool = False
    inflight: int = 0
    token_text: TokenText = field(init=False)

    def __post_init__(self) -> None:
        self.token_text = TokenText(self.tokenizer)

    @property
    def registry(self):
        return self.dispatcher.registry

    def context_len(self) -> int:
        n = self.registry.max_model_len()
        if self.max_model_len:
            n = min(n, self.max_model_len) if n else self.max_model_len
        if not n:
            raise P.ProtocolError("No worker is available to serve this request; retry later.", status_code=503,
                                  code="no_worker_available")
        return n

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token in bytes: a text of C characters has at least C / this many tokens."""
        n = getattr(self.tokenizer, "num_base_tokens", None)
        if n is None:
            return 1 << 30
        return max(1, max(len(self.tokenizer.token_bytes(i)) for i in range(n)))

    def check_text_fits(self, num_chars: int, param: str) -> None:
        """Reject a text that cannot fit whatever its tokenization, before tokenizing it (as `k3serve serve`)."""
        n = self.context_len()
        at_least = -(-num_chars // self.max_token_chars)
        if at_least + 1 > n:
            raise P.ProtocolError(
                f"This model's maximum context length is {n} tokens. However, your prompt has at least {at_least} "
                f"tokens ({num_chars} characters), which leaves no room for a completion. Please reduce the length "
                "of the prompt.", param=param, code="context_length_exceeded")

    def check_model(self, model: str) -> None:
        if model not in self.model_names:
            raise P.model_not_found(model, self.model_names)

    def sampling(self, kwargs: dict) -> dict:
        """Validated SamplingParams keyword arguments that also fit the worker.proto message."""
        try:
            check_params_token_ids(SamplingParams(**kwargs), self.vocab_size)
        except (SamplingParamsError, TypeError, ValueError) as e:
            raise P.ProtocolError(str(e), param=str(e).split(":", 1)[0]) from None
        if kwargs.get("top_k") is not None and kwargs["top_k"] > self.vocab_size:
            kwargs = dict(kwargs, top_k=self.vocab_size)  # the same distribution (the engine clamps too)
        try:
            sampling_to_proto(kwargs)
        except (ValueError, TypeError, OverflowError) as e:
            raise P.ProtocolError(f"a sampling parameter is out of range: {e}") from None
        return kwargs


class RequestIdMiddleware:
    """`x-request-id`: the client's (when well-formed) or a new one, on every response; kept in scope state."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = ""
        for name, value in scope.get("headers", ()):
            if name == b"x-request-id":
                rid = value.decode("latin-1")
                break
        if not _REQUEST_ID.match(rid):
            rid = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)


class _CountMiddleware:
    """Counts generation requests by endpoint and status; answers 503 to /v1/* while draining."""

    def __init__(self, app, gw: Gateway):
        self.app, self.gw = app, gw

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        path = scope["path"]
        if self.gw.draining:
            body = P.error_body("The gateway is shutting down; retry on another replica.", status_code=503,
                                code="draining")
            return await JSONResponse(body, status_code=503)(scope, receive, send)
        status = {"code": 500}

        async def send_counted(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            if path in ("/v1/chat/completions", "/v1/completions"):
                self.gw.metrics.request(path.removeprefix("/v1/"), status["code"])


class _SSE(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content, headers):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def _merge(runs: list[Run], deadline: float):
    """(run index, deltas) from every run as they come, until all are done or `deadline` passes."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, run: Run) -> None:
        try:
            async for deltas in run.deltas():
                queue.put_nowait((i, deltas))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            queue.put_nowait((i, e))
            return
        queue.put_nowait((i, end))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(runs)]
    remaining = len(runs)
    try:
        while remaining:
            left = deadline - time.monotonic()
            try:
                i, item = await asyncio.wait_for(queue.get(), timeout=max(left, 0.0))
            except TimeoutError:
                raise P.ProtocolError("The request did not finish within the gateway's timeout.", status_code=504,
                                      err_type="timeout_error", code="timeout") from None
            if item is end:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for r in runs:
            await r.aclose()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t


async def _until_disconnect(request: Request, work):
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            if (await request.receive())["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        for t in (task, watcher):
            with contextlib.suppress(BaseException):
                await t
    if task.cancelled():
        return None
    return task.result()


async def _respond(gw: Gateway, request: Request, req, runs: list[Run], *, on_deltas, collect, response,
                   usage_chunk, usage, start_chunks=()):
    """SSE or one JSON body from the runs' deltas; TTFT/ITL/E2E measured here."""
    t0 = time.monotonic()
    deadline = t0 + gw.request_timeout
    headers = {}
    if len(runs) == 1 and runs[0].worker is not None:
        headers = {"x-k3serve-worker": runs[0].worker.address,
                   "x-k3serve-predicted-cached-tokens": str(runs[0].predicted.usable),
                   "x-k3serve-predicted-store-tokens": str(runs[0].predicted.store)}
        if runs[0].prefill_worker is not None:
            headers["x-k3serve-prefill-worker"] = runs[0].prefill_worker.address
    timing = {"first": None, "last": None}

    def tick(deltas) -> None:
        if not any(d.token_ids for d in deltas):
            return
        now = time.monotonic()
        if timing["first"] is None:
            timing["first"] = now
            gw.metrics.ttft(now - t0)
        else:
            gw.metrics.itl(now - timing["last"])
        timing["last"] = now

    def finish(ok: bool) -> None:
        gw.metrics.e2e(time.monotonic() - t0)
        if ok:
            for r in runs:  # by source: the store's share is what the worker's own cache could not have had
                own = (r.predicted.usable - r.predicted.store) if r.predicted else r.cached_tokens
                from_store = max(0, r.cached_tokens - own) if r.predicted and r.predicted.store else 0
                gw.metrics.cached(r.cached_tokens - from_store)
                gw.metrics.cached(from_store, source="store")

    if req.stream:
        async def events():
            ok = False
            gw.inflight += 1
            try:
                for chunk in start_chunks:
                    yield P.sse_data(chunk)
                async with contextlib.aclosing(_merge(runs, deadline)) as outs:
                    async for i, deltas in outs:
                        tick(deltas)
                        for chunk in on_deltas(i, deltas):
                            if req.continuous_usage:
                                chunk["usage"] = usage()
                            yield P.sse_data(chunk)
                if req.include_usage:
                    yield P.sse_data(usage_chunk(usage()))
                ok = True
            except P.ProtocolError as e:
                gw.metrics.error(e.code or str(e.status_code))
                yield P.sse_data(e.body())
            finally:
                gw.inflight -= 1
                for r in runs:
                    await r.aclose()
                finish(ok)
            yield P.SSE_DONE

        return _SSE(events(), headers)

    async def work() -> dict:
        async with contextlib.aclosing(_merge(runs, deadline)) as outs:
            async for i, deltas in outs:
                tick(deltas)
                collect(i, deltas)
        return response(usage())

    gw.inflight += 1
    try:
        body = await _until_disconnect(request, work())
    except P.ProtocolError as e:
        gw.metrics.error(e.code or str(e.status_code))
        finish(False)
        raise
    finally:
        gw.inflight -= 1
        for r in runs:
            await r.aclose()
    if body is None:  # the client went away: the workers' requests were cancelled
        finish(False)
        gw.metrics.error("client_disconnected")
        return Response(status_code=499)
    finish(True)
    return JSONResponse(body, headers=headers)


def _job_id(request: Request, i: int = 0) -> str:
    return f"{request.scope['state']['request_id']}.{uuid.uuid4().hex[:8]}.{i}"


async def chat_completions(gw: Gateway, request: Request) -> Response:
    req: P.ChatCompletionRequest = P.parse_request(P.ChatCompletionRequest, await request.body())
    gw.check_model(req.model)
    gw.check_text_fits(sum(len(m.text() or "") for m in req.messages), "messages")
    rendered = tokenize_guarded(lambda: render_chat(gw.tokenizer, req.plain_messages(), **req.render_kwargs()),
                                "messages")
    ids = rendered.token_ids
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = P.resolve_max_tokens(len(ids), req.requested_max_tokens, gw.context_len(),
                                      prompt_param="messages", max_tokens_param=max_param)
    kwargs = gw.sampling(P.sampling_kwargs(req, max_tokens=max_tokens, chat=True))
    run = gw.dispatcher.start(Job(_job_id(request), ids, kwargs, req.cache_salt, req.n,
                                  with_logprobs=kwargs.get("logprobs") is not None))
    await run.route()
    rid = P.new_id("chatcmpl")
    builder = ChatOutputBuilder(rid=rid, created=P.now(), model=req.model, n=req.n, thinking=rendered.thinking,
                                tools_enabled=req.tools_enabled, tool_choice=req.tool_choice_value(),
                                logprobs_k=(req.top_logprobs or 0) if req.logprobs else None,
                                token_text=gw.token_text, include_usage=req.include_usage)

    def usage() -> dict:
        return P.usage(len(ids), sum(len(t) for t in run.tokens.values()), cached_tokens=run.cached_tokens)

    return await _respond(gw, request, req, [run], on_deltas=lambda _i, d: builder.chunks(d),
                          collect=lambda _i, d: builder.add(d), response=builder.response,
                          usage_chunk=builder.usage_chunk, usage=usage,
                          start_chunks=builder.start_chunks() if req.stream else ())


async def completions(gw: Gateway, request: Request) -> Response:
    req: P.CompletionRequest = P.parse_request(P.CompletionRequest, await request.body())
    gw.check_model(req.model)
    if req.echo and req.logprobs is not None:
        raise P.ProtocolError("echo with logprobs is not supported", param="echo")
    prompts = req.prompts()
    ctx_len = gw.context_len()
    jobs, echo_texts = [], []
    for i, prompt in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
        if isinstance(prompt, str):
            gw.check_text_fits(len(prompt), param)
            ids = tokenize_guarded(lambda p=prompt: gw.tokenizer.encode(p), param)
        else:
            ids = list(prompt)
        if not ids:
            raise P.ProtocolError(f"{param}: the prompt is empty", param=param)
        try:
            check_token_ids(ids, gw.vocab_size, param)
        except ValueError as e:
            raise P.ProtocolError(str(e), param=param) from None
        max_tokens = P.resolve_max_tokens(len(ids), req.max_tokens, ctx_len, prompt_param=param)
        kwargs = gw.sampling(P.sampling_kwargs(req, max_tokens=max_tokens, chat=False))
        jobs.append(Job(_job_id(request, i), ids, kwargs, req.cache_salt, req.n,
                        with_logprobs=kwargs.get("logprobs") is not None))
        if req.echo:
            echo_texts.append(prompt if isinstance(prompt, str)
                              else gw.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens))
    runs = [gw.dispatcher.start(j) for j in jobs]
    for r in runs:
        await r.route()
    builder = CompletionOutputBuilder(rid=P.new_id("cmpl"), created=P.now(), model=req.model, n=req.n,
                                      num_prompts=len(runs), echo_texts=echo_texts if req.echo else None,
                                      logprobs_k=req.logprobs, token_text=gw.token_text)

    def usage() -> dict:
        return P.usage(sum(len(j.prompt_ids) for j in jobs),
                       sum(len(t) for r in runs for t in r.tokens.values()),
                       cached_tokens=sum(r.cached_tokens for r in runs))

    return await _respond(gw, request, req, runs, on_deltas=builder.chunks, collect=builder.add,
                          response=builder.response, usage_chunk=builder.usage_chunk, usage=usage)


def workers_json(gw: Gateway) -> dict:
    idx = gw.dispatcher.index
    out = []
    for w in gw.registry.workers.values():
        out.append({"address": w.address, "role": w.role, "healthy": w.healthy, "reason": w.ejected_reason,
                    "inflight": w.inflight, "load": w.load, "index_ready": idx.ready(w.slot),
                    "index_sequence": idx.last_sequence(w.slot), "index_keys": idx.num_keys(w.slot),
                    "resubscribes": w.resubscribes})
    return {"policy": gw.dispatcher.policy.name, "draining": gw.draining, "workers": out}


def build_app(gw: Gateway, *, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="k3serve router", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.state.gateway = gw

    app.add_middleware(_CountMiddleware, gw=gw)
    app.add_middleware(RequestIdMiddleware)

    @app.get("/health")
    async def health():
        if gw.draining:
            return JSONResponse(P.error_body("draining", status_code=503), status_code=503)
        return JSONResponse({"status": "ok", "workers": gw.registry.counts()})

    @app.get("/metrics")
    async def metrics():
        gw.metrics.workers(gw.registry.counts())
        return Response(gw.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/router/workers")
    async def workers():
        return JSONResponse(workers_json(gw))

    def _max_len() -> int | None:
        try:
            return gw.context_len()
        except P.ProtocolError:
            return None

    @app.get("/v1/models")
    async def models():
        return JSONResponse(P.model_list(gw.model_names, max_model_len=_max_len()))

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        gw.check_model(model_id)
        return JSONResponse(P.model_list([model_id], max_model_len=_max_len())["data"][0])

    @app.post("/v1/completions")
    async def _completions(request: Request):
        return await completions(gw, request)

    @app.post("/v1/chat/completions")
    async def _chat(request: Request):
        return await chat_completions(gw, request)

    return app


def build_metrics_app(gw: Gateway) -> FastAPI:
    """The metrics port: /metrics and /health only (the pod contract's probes and scrapes go here)."""
    app = FastAPI(title="k3serve router metrics", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)

    @app.get("/health")
    async def health():
        if gw.draining:
            return JSONResponse(P.error_body("draining", status_code=503), status_code=503)
        return JSONResponse({"status": "ok", "workers": gw.registry.counts()})

    @app.get("/metrics")
    async def metrics():
        gw.metrics.workers(gw.registry.counts())
        return Response(gw.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
