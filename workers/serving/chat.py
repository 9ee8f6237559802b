"""POST /v1/chat/completions: messages → K3 renderer → engine (raw marker text) → parsers → OpenAI response."""

from __future__ import annotations

import contextlib

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from k3serve.common import openai_protocol as P
from k3serve.workers.chat.renderer import render_chat
from k3serve.workers.serving.chat_output import ChatOutputBuilder
from k3serve.workers.serving.context import (
    ClientDisconnected,
    ServingContext,
    SSEResponse,
    merge_streams,
    run_until_disconnect,
)
from k3serve.workers.serving.deltas import DeltaTracker


def render_request(tokenizer, req: P.ChatCompletionRequest):
    """The request's prompt (RenderedPrompt); renderer rejections become 400s."""
    try:
        return render_chat(tokenizer, req.plain_messages(), **req.render_kwargs())
    except ValueError as e:
        raise P.ProtocolError(str(e)) from None


async def create_chat_completion(ctx: ServingContext, request: Request) -> Response:
    req: P.ChatCompletionRequest = P.parse_request(P.ChatCompletionRequest, await request.body())
    ctx.check_model(req.model)
    rendered = render_request(ctx.tokenizer, req)
    ids = rendered.token_ids
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = P.resolve_max_tokens(len(ids), req.requested_max_tokens, ctx.max_model_len,
                                      prompt_param="messages", max_tokens_param=max_param)
    params = ctx.sampling_params(P.sampling_kwargs(req, max_tokens=max_tokens, chat=True))

    rid = P.new_id("chatcmpl")
    builder = ChatOutputBuilder(rid=rid, created=P.now(), model=req.model, n=req.n, thinking=rendered.thinking,
                                tools_enabled=req.tools_enabled, tool_choice=req.tool_choice_value(),
                                logprobs_k=(req.top_logprobs or 0) if req.logprobs else None,
                                token_text=ctx.token_text, include_usage=req.include_usage)
    streams = await ctx.submit_all([(rid, ids, params)], req.cache_salt)
    tracker = DeltaTracker()

    def usage() -> dict:
        return P.usage(len(ids), tracker.num_generated(), cached_tokens=tracker.cached_tokens)

    if req.stream:
        async def events():
            try:
                for chunk in builder.start_chunks():
                    yield P.sse_data(chunk)
                async with contextlib.aclosing(merge_streams(streams)) as outs:
                    async for _, out in outs:
                        for chunk in builder.chunks(tracker.update(out)):
                            if req.continuous_usage:
                                chunk["usage"] = usage()
                            yield P.sse_data(chunk)
                if req.include_usage:
                    yield P.sse_data(builder.usage_chunk(usage()))
            except P.ProtocolError as e:
                yield P.sse_data(e.body())
            finally:
                for s in streams:
                    s.abort()
            yield P.SSE_DONE

        return SSEResponse(events())

    async def collect() -> dict:
        async with contextlib.aclosing(merge_streams(streams)) as outs:
            async for _, out in outs:
                builder.add(tracker.update(out))
        return builder.response(usage())

    try:
        return JSONResponse(await run_until_disconnect(request, collect()))
    except ClientDisconnected:
        return Response(status_code=499)
