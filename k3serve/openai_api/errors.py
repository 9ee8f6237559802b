"""FastAPI/Starlette glue for OpenAI-style errors and bearer-token auth (shared by serve, worker, router).

* `install_error_handlers(app)`: ProtocolError → its status + body; unknown routes (404) and wrong
  methods (405) and FastAPI validation errors → OpenAI-style `invalid_request_error` bodies; any other
  exception (including a Rust panic from a native library) → a 500 JSON body with its message, logged
  once, on a connection that stays usable (keep-alive), and a client that disconnects before its body
  was read → one log line, no traceback.
* `ApiKeyMiddleware(app, api_key, prefixes=("/v1",))`: pure-ASGI bearer check (does not buffer
  streaming responses); the key is compared in constant time and never logged.
* `read_api_key_file(path)`: the key from a file (surrounding whitespace stripped).
"""

from __future__ import annotations

import asyncio
import hmac
import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

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

    app.add_middleware(CatchAllMiddleware)


_NOT_CAUGHT = (asyncio.CancelledError, KeyboardInterrupt, SystemExit, GeneratorExit)


class CatchAllMiddleware:
    """Pure-ASGI last line of defence (inside Starlette's ServerErrorMiddleware, which would re-raise to
    the server and make it drop the keep-alive connection): an exception that escaped every handler
    becomes a 500 JSON body if the response has not started; a client that went away while its body was
    read is logged in one line."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except ClientDisconnect:
            log.info("client disconnected before its request body was read: %s %s", scope.get("method"),
                     scope.get("path"))
        except _NOT_CAUGHT:
            raise
        except BaseException as exc:  # noqa: BLE001 - includes pyo3 PanicException (a BaseException)
            if started:  # too late for an error body: the server closes the connection
                raise
            log.error("unhandled error in %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
            body = error_body(f"internal error: {type(exc).__name__}: {exc}", status_code=500)
            await JSONResponse(body, status_code=500)(scope, receive, send)


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
