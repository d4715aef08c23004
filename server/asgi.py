"""ASGI pieces under the routes: middleware and the responses that watch for clients leaving.

Middleware, outermost first (see `server/app.py`): `HttpMetricsMiddleware` counts responses by
route and status; `ErrorBoundary` turns an escaped exception (a bug) into a 500 (OpenAI's error shape,
Anthropic's on its Messages routes)
with a logged traceback; CORS; `BodyLimit` answers 413; `ApiKeyAuth` answers 401.
`EventStreamResponse` and `unless_disconnected` notice a client that leaves, so its engine
requests are cancelled.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import anyio
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import AUTHENTICATION, SERVER_ERROR, ApiError, error_response, invalid
from server.metrics import Metrics

log = logging.getLogger(__name__)

T = TypeVar("T")
OPEN_PATHS = frozenset({"/health", "/v1/health"})  # answered without an API key
METHODS = frozenset({"GET", "POST", "HEAD", "OPTIONS", "PUT", "PATCH", "DELETE"})  # metric labels; others: "other"


class _BodyTooLarge(Exception):
    pass


async def _send_error(scope: Scope, receive: Receive, send: Send, error: ApiError) -> None:
    await error_response(error, scope["path"])(scope, receive, send)


class HttpMetricsMiddleware:
    """Counts responses; unknown paths and methods share one label so clients cannot grow the series."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: tuple[BaseRoute, ...]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes
        self.paths = frozenset(getattr(r, "path", "") for r in routes)

    def _label(self, scope: Scope) -> str:
        """The route's path, a templated one's template (/v1/responses/{response_id}); else "other"."""
        if scope["path"] in self.paths:
            return scope["path"]
        return next((r.path for r in self.routes if r.matches(scope)[0] != Match.NONE), "other")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = self._label(scope)
            method = scope["method"] if scope["method"] in METHODS else "other"
            self.metrics.http_requests.labels(route=route, method=method, status=str(status)).inc()


class ErrorBoundary:
    """Any exception that escapes a route is a bug: log its traceback, answer a 500 (server.errors.error_response)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        is_started = False

        async def tracking_send(message: Message) -> None:
            nonlocal is_started
            if message["type"] == "http.response.start":
                is_started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            log.exception("unhandled error in %s %s", scope["method"], scope["path"])
            if not is_started:
                await _send_error(scope, receive, send, ApiError(500, "internal server error", type=SERVER_ERROR, code="internal_error"))


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request body is over {self.max_bytes} bytes", param=None, code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await _send_error(scope, receive, send, invalid("bad Content-Length header", None))
            if int(length) > self.max_bytes:
                return await _send_error(scope, receive, send, self._too_large())
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:  # raised while the route reads its body, before any response
            await _send_error(scope, receive, send, self._too_large())


class ApiKeyAuth:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"")
            # Anthropic's clients send the key as x-api-key
            anthropic = b"Bearer " + headers[b"x-api-key"] if b"x-api-key" in headers else b""
            if not (hmac.compare_digest(given, self.expected) or hmac.compare_digest(anthropic, self.expected)):
                return await _send_error(
                    scope,
                    receive,
                    send,
                    ApiError(
                        401,
                        "invalid or missing API key (send Authorization: Bearer <key>, or x-api-key: <key>)",
                        type=AUTHENTICATION,
                        code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"},
                    ),
                )
        await self.app(scope, receive, send)


class EventStreamResponse:
    """An SSE response that notices the client leaving whatever the server's ASGI version.

    A watcher task reads `receive` for `http.disconnect` (Starlette's StreamingResponse only
    does so below ASGI spec 2.4). When the client leaves, or the stream ends, `on_close` runs;
    it cancels the engine requests.
    """

    headers = [
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),  # nginx: don't buffer the stream
    ]

    def __init__(self, frames: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        self.frames = frames
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        is_complete = False  # after the last frame, servers report http.disconnect too
        try:
            async with anyio.create_task_group() as tg:

                async def watch_disconnect() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    if not is_complete:
                        log.info("client left during a stream")
                    tg.cancel_scope.cancel()

                tg.start_soon(watch_disconnect)
                try:
                    await send({"type": "http.response.start", "status": 200, "headers": self.headers})
                    async for frame in self.frames:
                        await send({"type": "http.response.body", "body": frame, "more_body": True})
                    is_complete = True
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except OSError:  # ASGI 2.4 servers raise this from send once the client left
                    log.info("client left during a stream")
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.frames.aclose()  # type: ignore[attr-defined]
            self.on_close()


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Runs `work` while watching for the client leaving; (False, None) if it left first."""
    outcome: list[Any] = []
    async with anyio.create_task_group() as tg:

        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(watch_disconnect)
        try:
            outcome.append(await work)
        except Exception as e:  # re-raised below, outside the task group (not as an ExceptionGroup)
            outcome.append(e)
        tg.cancel_scope.cancel()
    if not outcome:
        if asyncio.iscoroutine(work):
            work.close()
        return False, None
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return True, outcome[0]
