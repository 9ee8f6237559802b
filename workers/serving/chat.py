"""POST /v1/chat/completions: messages → K3 renderer → engine (raw marker text) → parsers → OpenAI response."""

from __future__ import annotations

from fastapi.responses import Response
from starlette.requests import Request

from k3serve.chat.renderer import render_chat
from k3serve.openai_api import protocol as P
from k3serve.openai_api.chat_output import ChatOutputBuilder
from k3serve.openai_api.deltas import DeltaTracker
from k3serve.openai_api.text_guards import check_whitespace_runs, tokenize_guarded
from k3serve.workers.serving.context import ServingContext, respond


def render_request(tokenizer, req: P.ChatCompletionRequest):
    """The request's prompt (RenderedPrompt); renderer and tokenizer rejections become 400s."""
    check_whitespace_runs([req.plain_messages(), req.render_kwargs()], "messages")
    return tokenize_guarded(lambda: render_chat(tokenizer, req.plain_messages(), **req.render_kwargs()), "messages")


async def create_chat_completion(ctx: ServingContext, request: Request) -> Response:
    req: P.ChatCompletionRequest = P.parse_request(P.ChatCompletionRequest, await request.body())
    ctx.check_model(req.model)
    ctx.check_text_fits(sum(len(m.text() or "") for m in req.messages), "messages")
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

    return await respond(
        request, req, streams,
        on_chunk=lambda _i, out: builder.chunks(tracker.update(out)),
        on_collect=lambda _i, out: builder.add(tracker.update(out)),
        response=builder.response, usage_chunk=builder.usage_chunk, usage=usage,
        start_chunks=builder.start_chunks() if req.stream else ())
