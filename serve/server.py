"""The OpenAI-compatible HTTP server (FastAPI) over an `AsyncEngine`: `build_app` assembles the
routes (serve/routes.py), the request schemas (serve/protocol.py), the response shaping
(serve/responses.py), the Prometheus metrics (serve/prometheus.py), the size limit and the API
key (middleware, here) and the error handlers (here).

The routes and what each serves are listed in serve/routes.py.
"""

from __future__ import annotations

import hmac
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from serve.async_engine import AsyncEngine
from serve.prometheus import metrics_registry
from serve.protocol import APIError
from serve.routes import Served, router

log = logging.getLogger("serve")

# 100,000 stop strings of 40 characters are 4.4 MB of JSON
DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20


def validation_error(exc: RequestValidationError) -> APIError:
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
                        .rstrip(": "), code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Union members add their type to the location (prompt.str, prompt.list[int], ...).
    field = ".".join(p for p in loc if not (p[:1].isalpha() and ("[" in p or p in {"str", "int"})))
    message = str(first.get("msg")).removeprefix("Value error, ")
    if not field:
        return APIError(400, f"the request body is invalid: {message}")
    return APIError(400, f"{field}: {message}", param=field.split(".")[0])



class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is answered 413 before the app sees it
    (by its Content-Length, or by counting a chunked body).

    The refused body is read and dropped first, up to `drain_bytes` more: a client sends its
    whole body before it reads the reply, and a socket closed with bytes still unread makes the
    kernel answer with a reset that can destroy the 413 before the client reads it. A body
    declared larger than that (or one sent after `Expect: 100-continue`, which waits for the
    server's word) is refused at once, without reading it."""

    def __init__(self, app: Any, max_bytes: int, drain_bytes: int | None = None) -> None:
        self.app, self.max_bytes = app, max_bytes
        self.drain_bytes = max(4 * max_bytes, 64 * 2**20) if drain_bytes is None else drain_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", ()))
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            if (int(declared) <= self.max_bytes + self.drain_bytes
                    and headers.get(b"expect", b"").lower() != b"100-continue"):
                await self._drain(receive)
            return await self._refuse(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                if message.get("more_body"):
                    await self._drain(receive)
                return await self._refuse(send)
            if not message.get("more_body"):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()  # later messages: the disconnect
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _drain(self, receive: Any) -> None:
        """Read and drop the rest of a refused body, at most `drain_bytes` of it."""
        drained = 0
        while drained <= self.drain_bytes:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body"):
                return
            drained += len(message.get("body", b""))

    async def _refuse(self, send: Any) -> None:
        body = APIError(413, f"the request body exceeds the server's limit of {self.max_bytes} "
                        "bytes (--max-request-bytes)", code="request_too_large").body()
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class APIKey:
    """ASGI middleware: a request to /v1 without `Authorization: Bearer <key>` is answered 401
    (as vLLM's --api-key; /health, /metrics and the tokenizer routes stay open)."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path", "").startswith("/v1"):
            given = dict(scope.get("headers", ())).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                return await APIError(401, "a valid API key is required (Authorization: "
                                      "Bearer <key>)", type="authentication_error",
                                      code="invalid_api_key").response()(scope, receive, send)
        await self.app(scope, receive, send)



def _install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI-shaped body with its status; nothing as a traceback."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Response:
        return validation_error(exc).response()

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> Response:  # 404 and 405 from routing
        codes = {404: "not_found", 405: "method_not_allowed"}
        return APIError(exc.status_code, str(exc.detail), code=codes.get(exc.status_code)).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unexpected error in a request handler")
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                        type="server_error").response()



def build_app(engine: AsyncEngine, served_model_name: str,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              api_key: str | None = None) -> FastAPI:
    """The HTTP API over a started `AsyncEngine`; metrics go to a registry of this app's own.
    Request bodies over `max_request_bytes` are answered 413; with `api_key`, requests to /v1
    without it 401."""
    app = FastAPI(title="egmla serve", description=__doc__)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    if api_key is not None:
        app.add_middleware(APIKey, key=api_key)
    _install_error_handlers(app)
    app.state.served = Served(engine, served_model_name,
                              metrics_registry(engine, served_model_name), time.time())
    app.include_router(router)
    return app
