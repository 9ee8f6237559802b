"""FastAPI/Starlette glue for OpenAI-style errors and bearer-token auth (shared by serve, worker, router).

* `install_error_handlers(app)`: ProtocolError → its status + body; unknown routes/methods and
  FastAPI validation errors → OpenAI-style bodies; any other exception → 500 with its message.
* `ApiKeyMiddleware(app, api_key, prefixes=("/v1",))`: pure-ASGI bearer check (does not buffer
  streaming responses); the key is compared in constant time and never logged.
* `read_api_key_file(path)`: the key from a file (surrounding whitespace stripped).
"""

from __future__ import annotations

import hmac
import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3serve.openai_api.protocol import ProtocolError, error_body

log = logging.getLogger(__name__)


def error_response(exc: ProtocolError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status_code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ProtocolError)
    async def _protocol(_request, exc: ProtocolError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), status_code=exc.status_code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation(_request, exc: RequestValidationError):
        errs = exc.errors()
        msg = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in errs[:3])
        return JSONResponse(error_body(msg or "invalid request"), status_code=400)

    @app.exception_handler(Exception)
    async def _internal(_request, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", status_code=500),
                            status_code=500)


def read_api_key_file(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        key = f.read().strip()
    if not key:
        raise ValueError(f"API key file {path} is empty")
    return key


class ApiKeyMiddleware:
    """Reject requests under `prefixes` without `Authorization: Bearer <api_key>` (401)."""

    def __init__(self, app, api_key: str, prefixes: tuple[str, ...] = ("/v1",)):
        self.app = app
        self._key = api_key.encode("utf-8")
        self.prefixes = prefixes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(self.prefixes):
            auth = b""
            for name, value in scope.get("headers", ()):
                if name == b"authorization":
                    auth = value
                    break
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
                body = error_body("Invalid or missing API key (send 'Authorization: Bearer <key>').",
                                  status_code=401, code="invalid_api_key")
                await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)
