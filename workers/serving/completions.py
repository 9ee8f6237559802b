"""POST /v1/completions: prompt (text, token ids, or a batch of either) → engine → OpenAI response."""

from __future__ import annotations

from fastapi.responses import Response
from starlette.requests import Request

from k3serve.openai_api import protocol as P
from k3serve.openai_api.completion_output import CompletionOutputBuilder
from k3serve.openai_api.deltas import DeltaTracker
from k3serve.workers.serving.context import ServingContext, respond


async def create_completion(ctx: ServingContext, request: Request) -> Response:
    req: P.CompletionRequest = P.parse_request(P.CompletionRequest, await request.body())
    ctx.check_model(req.model)
    if req.echo and req.logprobs is not None:
        raise P.ProtocolError("echo with logprobs is not supported", param="echo")

    items, echo_texts, prompt_lens = [], [], []
    rid = P.new_id("cmpl")
    for i, prompt in enumerate(req.prompts()):
        param = "prompt" if len(req.prompts()) == 1 else f"prompt.{i}"
        ids = ctx.encode(prompt, param) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise P.ProtocolError(f"{param}: the prompt is empty", param=param)
        ctx.check_token_ids(ids, param)
        max_tokens = P.resolve_max_tokens(len(ids), req.max_tokens, ctx.max_model_len, prompt_param=param)
        params = ctx.sampling_params(P.sampling_kwargs(req, max_tokens=max_tokens, chat=False))
        items.append((f"{rid}-{i}", ids, params))
        prompt_lens.append(len(ids))
        if req.echo:
            echo_texts.append(prompt if isinstance(prompt, str)
                              else ctx.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens))

    builder = CompletionOutputBuilder(rid=rid, created=P.now(), model=req.model, n=req.n, num_prompts=len(items),
                                      echo_texts=echo_texts if req.echo else None, logprobs_k=req.logprobs,
                                      token_text=ctx.token_text)
    streams = await ctx.submit_all(items, req.cache_salt)
    trackers = [DeltaTracker() for _ in streams]

    def usage() -> dict:
        return P.usage(sum(prompt_lens), sum(t.num_generated() for t in trackers),
                       cached_tokens=sum(t.cached_tokens for t in trackers))

    return await respond(
        request, req, streams,
        on_chunk=lambda i, out: builder.chunks(i, trackers[i].update(out)),
        on_collect=lambda i, out: builder.add(i, trackers[i].update(out)),
        response=builder.response, usage_chunk=builder.usage_chunk, usage=usage)
