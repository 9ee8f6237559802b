"""What the HTTP handlers share: the engine, served names, tokenizer facts and request plumbing.

`ServingContext` turns protocol-level inputs into engine submissions, mapping every rejection to a
`ProtocolError` (400 for bad input, 500 for an engine failure), and `run_until_disconnect()` /
`merge_streams()` make a client disconnect abort the engine requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse, Response
from starlette.responses import StreamingResponse

from k3serve.openai_api import protocol as P
from k3serve.openai_api.logprobs import TokenText
from k3serve.openai_api.text_guards import check_whitespace_runs, tokenize_guarded
from k3serve.openai_api.validate import check_params_token_ids, check_token_ids
from k3serve.sampling_params import SamplingParams, SamplingParamsError
from k3serve.workers.async_engine import AsyncEngine, EngineDeadError, RequestFailedError, RequestStream

log = logging.getLogger(__name__)
class ClientDisconnected(Exception):
    """The HTTP client went away; its engine requests were aborted."""


def engine_error(exc: BaseException) -> P.ProtocolError:
    msg = str(exc)
    if not msg.startswith("the engine failed while serving this request"):
        msg = f"the engine failed while serving this request: {msg}"
    return P.ProtocolError(msg[:1].upper() + msg[1:], status_code=500, code="engine_error")


@dataclass
class ServingContext:
    engine: AsyncEngine
    model_names: list[str]
    token_text: TokenText = field(init=False)

    def __post_init__(self) -> None:
        self.token_text = TokenText(self.engine.tokenizer)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token in bytes (so a text of C characters has at least C / this many tokens)."""
        tok = self.tokenizer
        n = getattr(tok, "num_base_tokens", None)
        if n is None or not hasattr(tok, "token_bytes"):
            return 1 << 30  # unknown tokenizer: no early bound
        return max(1, max(len(tok.token_bytes(i)) for i in range(n)))

    def check_text_fits(self, num_chars: int, param: str) -> None:
        """A text that cannot fit in the context whatever its tokenization is rejected before tokenizing."""
        at_least = -(-num_chars // self.max_token_chars)
        if at_least + 1 > self.max_model_len:
            raise P.ProtocolError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt has "
                f"at least {at_least} tokens ({num_chars} characters), which leaves no room for a completion. "
                "Please reduce the length of the prompt.", param=param, code="context_length_exceeded")

    def encode(self, text: str, param: str) -> list[int]:
        """Token ids of a prompt text: bounded by the context first, tokenizer failures as 400s."""
        self.check_text_fits(len(text), param)
        check_whitespace_runs(text, param)
        return tokenize_guarded(lambda: self.tokenizer.encode(text), param)

    def check_model(self, model: str) -> None:
        if model not in self.model_names:
            raise P.model_not_found(model, self.model_names)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        try:
            check_token_ids(ids, self.vocab_size, param)
        except ValueError as e:
            raise P.ProtocolError(str(e), param=param) from None

    def sampling_params(self, kwargs: dict) -> SamplingParams:
        try:
            params = SamplingParams(**kwargs)
            check_params_token_ids(params, self.vocab_size)
        except SamplingParamsError as e:
            raise P.ProtocolError(str(e), param=str(e).split(":", 1)[0]) from None
        except (TypeError, ValueError) as e:
            raise P.ProtocolError(str(e), param=str(e).split(":", 1)[0]) from None
        return params

    async def submit(self, rid: str, prompt_ids: list[int], params: SamplingParams,
                     cache_salt: str | None) -> RequestStream:
        try:
            return await self.engine.add_request(rid, prompt_ids, params, cache_salt)
        except EngineDeadError as e:
            raise engine_error(e) from None
        except ValueError as e:
            raise P.ProtocolError(str(e)) from None

    async def submit_all(self, items: list[tuple[str, list[int], SamplingParams]],
                         cache_salt: str | None) -> list[RequestStream]:
        """Submit a batch; if one is rejected the already accepted ones are aborted."""
        streams: list[RequestStream] = []
        try:
            for rid, ids, params in items:
                streams.append(await self.submit(rid, ids, params, cache_salt))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, object]]:
    """(stream index, RequestOutput) from several streams as they arrive; closing aborts unfinished ones.

    An engine failure in any stream raises ProtocolError(500) after aborting the others.
    """
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                queue.put_nowait((i, out))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # forwarded to the consumer
            queue.put_nowait((i, e))
            return
        queue.put_nowait((i, end))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            i, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, EngineDeadError | RequestFailedError):
                raise engine_error(item)
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t


async def run_until_disconnect(request, work: Awaitable):
    """Await `work`; if the HTTP client disconnects first, cancel it (which aborts its engine requests)
    and raise ClientDisconnected. `request` is a Starlette Request whose body was already read."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task.done():
        watcher.cancel()
        with contextlib.suppress(BaseException):
            await watcher
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise ClientDisconnected()


class SSEResponse(StreamingResponse):
    """`text/event-stream` response that always closes its body iterator (so its `finally` aborts the
    engine requests) even when Starlette cancels the send on a client disconnect."""

    media_type = "text/event-stream"

    def __init__(self, content, **kw):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}, **kw)

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def respond(request, req, streams, *, on_chunk, on_collect, response, usage_chunk, usage,
                  start_chunks=()):
    """The tail every generation endpoint shares: SSE (start chunks, per-output chunks with optional
    continuous usage, final usage chunk, error event, [DONE], abort on exit) or one JSON body, with a
    client disconnect aborting the request (499).

    on_chunk(i, out) -> list[dict]: stream chunks for output `out` of stream i;
    on_collect(i, out): accumulate for the non-streaming body; response(usage) -> dict;
    usage_chunk(usage) -> dict; usage() -> the current usage dict.
    """
    if req.stream:
        async def events():
            try:
                for chunk in start_chunks:
                    yield P.sse_data(chunk)
                async with contextlib.aclosing(merge_streams(streams)) as outs:
                    async for i, out in outs:
                        for chunk in on_chunk(i, out):
                            if req.continuous_usage:
                                chunk["usage"] = usage()
                            yield P.sse_data(chunk)
                if req.include_usage:
                    yield P.sse_data(usage_chunk(usage()))
            except P.ProtocolError as e:
                yield P.sse_data(e.body())
            finally:
                for s in streams:
                    s.abort()
            yield P.SSE_DONE

        return SSEResponse(events())

    async def collect() -> dict:
        async with contextlib.aclosing(merge_streams(streams)) as outs:
            async for i, out in outs:
                on_collect(i, out)
        return response(usage())

    try:
        return JSONResponse(await run_until_disconnect(request, collect()))
    except ClientDisconnected:
        return Response(status_code=499)
