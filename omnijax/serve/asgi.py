"""The ASGI application `omnijax serve` runs: its routes (Realtime, chat completions, completions, models, the native
protocol) over one `ServeContext`, behind the API-key middleware (`Authorization: Bearer`, or the browser's
subprotocol form on a WebSocket). `omnijax.serve.app` runs it (uvicorn) and re-exports these names."""

from __future__ import annotations

import contextlib
import ipaddress
import json

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route, WebSocketRoute
from starlette.types import ASGIApp

from omnijax.serve import chat_completions as openai_http
from omnijax.serve import completions as openai_completions
from omnijax.serve.context import ServeContext, ServeOptions
from omnijax.serve.native import session as native
from omnijax.serve.openai_wire import error_body
from omnijax.serve.realtime import session as realtime
from omnijax.serve.refusal_log import refusals

# Browsers cannot set headers on a WebSocket handshake, so the Realtime API's browser clients send the key as a
# subprotocol, `Sec-WebSocket-Protocol: realtime, openai-insecure-api-key.<KEY>`; the server answers with `realtime`
# (a browser fails a handshake whose offered subprotocols get no answer) and never echoes the key.
BROWSER_KEY_PREFIX = "openai-insecure-api-key."
REALTIME_SUBPROTOCOL = "realtime"


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or "localhost") listens on the loopback interface only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ApiKeyMiddleware:
    """ASGI middleware: refuses HTTP requests (401, an OpenAI error body) and WebSocket handshakes (HTTP 401 where
    the server supports denial responses, else close 1008) without the key: `Authorization: Bearer <key>`, or on a
    WebSocket the browser form, the subprotocol `openai-insecure-api-key.<key>`. A WebSocket offering the `realtime`
    subprotocol is accepted with it."""

    def __init__(self, app: ASGIApp, options: ServeOptions):
        self.app, self.options = app, options

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket" and REALTIME_SUBPROTOCOL in (scope.get("subprotocols") or ()):
            send = _accepting_with(REALTIME_SUBPROTOCOL, send)
        if scope["type"] not in ("http", "websocket") or self.options.api_key is None:
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        offered = scope.get("subprotocols") or ()
        keys = [p[len(BROWSER_KEY_PREFIX):] for p in offered if p.startswith(BROWSER_KEY_PREFIX)]
        if self.options.authorized(header) or (scope["type"] == "websocket" and
                                               any(self.options.authorized(f"Bearer {k}") for k in keys)):
            return await self.app(scope, receive, send)

        body = json.dumps(error_body("missing or wrong API key: send 'Authorization: Bearer <key>'",
                                     code="invalid_api_key")).encode()
        head = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
        peer = (scope.get("client") or ("?",))[0]
        refusals.refuse("unauthorized", peer, "refuse peer=%s path=%s reason=unauthorized", peer, scope["path"])
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 401, "headers": head})
            await send({"type": "http.response.body", "body": body})
        elif "websocket.http.response" in scope.get("extensions", {}):
            await send({"type": "websocket.http.response.start", "status": 401, "headers": head})
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await send({"type": "websocket.close", "code": 1008})


def _accepting_with(subprotocol: str, send):
    """`send`, with a WebSocket accept that names no subprotocol answering `subprotocol`."""

    async def wrapped(message):
        if message["type"] == "websocket.accept" and not message.get("subprotocol"):
            message = {**message, "subprotocol": subprotocol}
        await send(message)
    return wrapped


def build_app(context: ServeContext) -> Starlette:
    """The Starlette application of a `ServeContext` (its worker starts and stops with the app)."""


    @contextlib.asynccontextmanager
    async def lifespan(app):
        await context.worker.start()
        try:
            yield
        finally:
            await context.worker.stop()

    async def realtime_route(ws):
        await realtime.realtime_endpoint(ws, context)

    async def native_route(ws):
        await native.native_endpoint(ws, context)

    async def chat_route(request):
        return await openai_http.chat_completions(request, context)

    async def completions_route(request):
        return await openai_completions.completions(request, context)

    async def models_route(request):
        return await openai_http.models(request, context)

    async def model_route(request):
        return await openai_http.model(request, context)

    routes = [WebSocketRoute("/v1/realtime", realtime_route),
              Route("/v1/chat/completions", chat_route, methods=["POST"]),
              Route("/v1/completions", completions_route, methods=["POST"]),
              Route("/v1/models", models_route, methods=["GET"]),
              Route("/v1/models/{model:path}", model_route, methods=["GET"]),
              WebSocketRoute("/session", native_route)]
    return Starlette(routes=routes, lifespan=lifespan,
                     middleware=[Middleware(ApiKeyMiddleware, options=context.options)])
