"""The FastAPI app of `k3serve serve`: OpenAI routes plus /health and /metrics.

    app = build_app(async_engine, served_model_names=["k3"], registry=registry, api_key=None)

Routes: GET /v1/models, GET /v1/models/{id} (404 model_not_found for an unknown id), POST /v1/completions, POST /v1/chat/completions, GET /health (200 while the
engine thread runs, else 503 with the reason), GET /metrics (Prometheus text from `registry`).
With `api_key`, /v1/* requires `Authorization: Bearer <api_key>`.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request

from k3serve.openai_api import protocol as P
from k3serve.openai_api.errors import ApiKeyMiddleware, install_error_handlers
from k3serve.workers.async_engine import AsyncEngine
from k3serve.workers.serving.chat import create_chat_completion
from k3serve.workers.serving.completions import create_completion
from k3serve.workers.serving.context import ServingContext


def health_response(engine: AsyncEngine) -> Response:
    if engine.is_healthy():
        return JSONResponse({"status": "ok"})
    reason = str(engine.error) if engine.error is not None else "engine is not running"
    return JSONResponse(P.error_body(f"unhealthy: {reason}", status_code=503), status_code=503)


def metrics_response(registry) -> Response:
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def build_app(engine: AsyncEngine, *, served_model_names: list[str], registry, api_key: str | None = None) -> FastAPI:
    ctx = ServingContext(engine, list(served_model_names))
    app = FastAPI(title="k3serve", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.state.ctx = ctx

    @app.get("/health")
    async def health():
        return health_response(engine)

    @app.get("/metrics")
    async def metrics():
        return metrics_response(registry)

    @app.get("/v1/models")
    async def models():
        return JSONResponse(P.model_list(ctx.model_names, max_model_len=ctx.max_model_len))

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        ctx.check_model(model_id)
        return JSONResponse(P.model_list([model_id], max_model_len=ctx.max_model_len)["data"][0])

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await create_completion(ctx, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await create_chat_completion(ctx, request)

    return app
