"""Endpoints declared once (method, path and handler feed both FastAPI and the fast path), and what every handler reads.

FastAPI's per-request machinery (matching through every route, dependency solving, its extra
middleware) costs more than the rest of a small request's work. So the tensor routes
(`fast=True`) are also dispatched by `FastPath`, a pure ASGI middleware that matches the same
path templates (compiled by Starlette's own `compile_path`) and calls the very same handler,
rendering its errors through the one error table. Every endpoint is registered with FastAPI
too, which gives the OpenAPI page and serves any request the fast path lets through.

`ServiceApp` puts the edge's middleware (CORS, the guard, the fast path) in front of FastAPI's
own stack rather than inside it: FastAPI wraps `add_middleware`'s middleware in Starlette's
dispatch, its ServerErrorMiddleware (a wrapper around every `send`), its telemetry and body
limit middleware, layers a tensor request crossed for nothing. Requests the edge passes on
still go through all of them.

The fast path is also where a tensor request's trace begins and ends (app/tracing/spans.py),
when tracing is on: the route's template names the span, the path its model.

Every handler reads its request through the plumbing at the end: its service state, its body
(bounded, held against the process's budget, compressed ones inflated within it), its answer
compressed when asked, and the client hanging up while it waits.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

from fastapi import Depends, FastAPI
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import compile_path
from starlette.types import ASGIApp, Receive, Scope, Send

from app.errors import drop_frames
from app.http.errors import error_response
from app.http.transport.protocol import ON_DISCONNECT
from app.observe import identity
from app.protocol.admission import Hold
from app.protocol.content_coding import STEP, Coding, Inflater, compress
from app.protocol.errors import INTERNAL, ClientDisconnected, PayloadTooLarge, kind_of
from app.protocol.fields import header_int
from app.protocol.state import ServiceState

if TYPE_CHECKING:  # the OpenTelemetry SDK is imported only when tracing is on
    from app.http.transport.lean import LeanDoor
    from app.tracing.spans import Tracing

log = logging.getLogger("ffn_serve")
T = TypeVar("T")

Handler = Callable[..., Awaitable[Any]]


@dataclass(frozen=True)
class Endpoint:
    """One route. `fast` handlers take `request` and the path parameters as keywords."""

    method: str
    path: str  # a Starlette path template: /v1/models/{name}/transform
    handler: Handler
    fast: bool = False
    openapi: dict[str, Any] = field(default_factory=dict)  # FastAPI route options: summary, responses, ...


class ServiceApp(FastAPI):
    """FastAPI with an edge: middleware run in front of FastAPI's whole stack (see the module's docstring).

    `add_edge_middleware` is `add_middleware` for the edge: the last added runs first. The edge
    sees every scope (lifespan included) and passes what it does not answer to FastAPI.
    """

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.edge_middleware: list[Middleware] = []
        self._edge: ASGIApp | None = None
        self.lean_door: LeanDoor | None = None  # the lean path, which our HTTP protocol serves (create_app sets it)

    def add_edge_middleware(self, cls: Any, **options: Any) -> None:
        if self._edge is not None:
            raise RuntimeError("edge middleware cannot be added once the app has started")
        self.edge_middleware.insert(0, Middleware(cls, **options))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._edge is None:
            edge: ASGIApp = super().__call__
            for cls, args, options in reversed(self.edge_middleware):
                edge = cls(edge, *args, **options)
            self._edge = edge
        scope["app"] = self  # as Starlette does: a fast handler reaches the service state through request.app
        await self._edge(scope, receive, send)


def register(
    app: ServiceApp, endpoints: Sequence[Endpoint], *, fast_path: bool = True, tracing: Tracing | None = None
) -> None:
    """Add every endpoint to FastAPI, and the fast ones to a FastPath at the app's edge (which traces them)."""
    for endpoint in endpoints:
        app.add_api_route(endpoint.path, endpoint.handler, methods=[endpoint.method], **endpoint.openapi)
    fast = [endpoint for endpoint in endpoints if endpoint.fast]
    if fast_path and fast:
        app.add_edge_middleware(FastPath, endpoints=fast, tracing=tracing)


class FastPath:
    """Calls the fast endpoints' handlers directly; every other request goes on to FastAPI."""

    def __init__(self, app: ASGIApp, *, endpoints: Sequence[Endpoint], tracing: Tracing | None = None) -> None:
        self.app = app
        self._tracing = tracing
        self._routes: list[tuple[str, re.Pattern[str], Handler, str]] = [
            (endpoint.method, compile_path(endpoint.path)[0], endpoint.handler, endpoint.path) for endpoint in endpoints
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            method, path = scope["method"], scope["path"]
            for route_method, pattern, handler, route in self._routes:
                if method == route_method and (match := pattern.match(path)) is not None:
                    await self._handle(handler, route, match.groupdict(), scope, receive, send)
                    return
        await self.app(scope, receive, send)

    async def _handle(
        self, handler: Handler, route: str, params: dict[str, str], scope: Scope, receive: Receive, send: Send
    ) -> None:
        trace = None
        if self._tracing is not None:
            method = scope["method"]
            attributes = {"http.request.method": method, "http.route": route, "url.path": scope["path"]}
            trace = self._tracing.begin(f"{method} {route}", scope["headers"], attributes, params.get("name"))
        request = Request(scope, receive, send)
        error_type: str | None = None
        try:
            response: Response = await handler(request=request, **params)
        except Exception as exc:
            if kind_of(exc) is INTERNAL:  # a bug: keep its traceback; the client learns nothing internal
                log.exception("unhandled error in %s %s", scope["method"], scope["path"])
            response, error_type = error_response(exc), kind_of(exc).error_type
            drop_frames(exc)  # answered: its frames (the request's body among them) go now, not at the next GC
        if trace is None:
            await response(scope, receive, send)
            return
        status = response.status_code
        carrier = trace.answered(
            {"http.response.status_code": status},
            failed=status >= 500,  # a client's mistake is not the server span's error (HTTP semantic conventions)
            error_type=error_type,
            output_bytes=len(getattr(response, "body", b"")),  # the tensor routes answer whole bodies
            content_type=response.headers.get("content-type", ""),
        )
        response.raw_headers.extend(
            (name.encode("latin-1"), value.encode("latin-1")) for name, value in carrier.items()
        )
        try:
            await response(scope, receive, send)
        finally:
            trace.end()


# ----- the service state, as the routes reach it: `request.app.state.service`, set by create_app ---------


def service_state(request: Request) -> ServiceState:
    """The app's ServiceState (a plain function: the tensor routes skip FastAPI's dependencies)."""
    state: ServiceState = request.app.state.service
    return state


async def _state_dependency(request: Request) -> ServiceState:
    # async on purpose: FastAPI runs a sync dependency in a worker thread, a thread hop per request.
    return service_state(request)


StateDep = Annotated[ServiceState, Depends(_state_dependency)]


# ----- a request's body, and its client hanging up ------------------------------------------------

TIMEOUT_HEADER = "x-timeout-ms"
COMPRESS_IN_THREAD = 1 << 20  # answers this large are compressed off the event loop (zlib releases the GIL)
AnswerBody = TypeVar("AnswerBody", bytes, bytes | memoryview)  # compressed, it is bytes: either way the same type


async def read_body(
    request: Request, limit: int, hold: Hold | None = None, coding: Coding | None = None
) -> bytes | bytearray:
    """The whole body, refused with 413 as soon as it passes `limit`; inflated first when `coding` says so.

    Content-Length is checked, and taken from the process's budget of held bytes (`hold`, 429
    when spent), before reading; a chunked body is counted and taken as it streams in. (The
    control routes' small bodies, bounded by their own limit, pass no `hold`.) A client that
    hangs up is a 499, not a failure of ours; one that stalls mid-body is answered 408 by the
    protocol (app/http/transport/protocol.py), which this read then sees as a hang-up. A body that came in
    one piece (every small one) is that piece itself, not a copy; a larger one is joined once at
    the end. Binary tensors are viewed in it without a copy, read-only.

    A compressed body (`coding`, from Content-Encoding) is inflated as it streams in, and its
    inflated bytes are what `limit` and `hold` count (app/protocol/content_coding.py: Inflater).
    """
    declared = header_int(request.headers.get("content-length"), "Content-Length")
    if declared is not None and declared > limit:
        raise PayloadTooLarge(f"body of {declared} bytes exceeds the limit of {limit} bytes")
    if coding is not None:
        return await _read_inflated(request, Inflater(coding, limit, hold))
    if declared is not None and hold is not None:
        hold.grow(declared)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"body exceeds the limit of {limit} bytes")
            if hold is not None and size > hold.size:
                hold.resize(size)
            if chunk:
                chunks.append(chunk)
    except ClientDisconnect:
        raise ClientDisconnected("the client closed the connection while sending its body") from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _read_inflated(request: Request, inflater: Inflater) -> bytearray:
    """A compressed body inflated as it arrives, each piece counted and held before it is kept."""
    body = bytearray()
    try:
        async for chunk in request.stream():
            for piece in inflater.feed(chunk):
                body += piece
                if len(piece) == STEP:  # a large body: let other requests run between its pieces
                    await asyncio.sleep(0)
    except ClientDisconnect:
        raise ClientDisconnected("the client closed the connection while sending its body") from None
    inflater.finish()
    return body


async def compressed(
    content: AnswerBody, headers: dict[str, str], coding: Coding | None
) -> tuple[AnswerBody, dict[str, str]]:
    """The answer in `coding` (from Accept-Encoding), with its Content-Encoding; as it is when `coding` is None."""
    if coding is None:
        return content, headers
    if len(content) < COMPRESS_IN_THREAD:
        body = compress(content, coding)
    else:
        body = await asyncio.to_thread(compress, content, coding)
    return body, {**headers, "content-encoding": coding, "vary": "Accept-Encoding"}


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, but cancel it if the client disconnects first (its queued rows are dropped).

    Call only after the body has been read: the next ASGI message is then http.disconnect. Under
    our protocol (app/http/transport/protocol.py), which calls the scope's ON_DISCONNECT callback when the
    connection is lost, that is one callback and no task; under any other server, a task watches
    for the disconnect message.
    """
    task = asyncio.current_task()
    assert task is not None, "unless_disconnected must run inside a task; this is a bug."
    scope = request.scope
    gone = False

    def hang_up() -> None:
        nonlocal gone
        gone = True
        task.cancel()

    async def watch() -> None:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            hang_up()

    watcher = None
    if ON_DISCONNECT in scope:
        scope[ON_DISCONNECT] = hang_up
    else:
        watcher = asyncio.ensure_future(watch())
    try:
        result = await work
        identity.resumed()  # a traced request's encode stage starts here
        return result
    except asyncio.CancelledError:
        if gone:
            task.uncancel()
            raise ClientDisconnected("the client closed the connection before the answer was ready") from None
        raise
    finally:
        if watcher is None:
            scope[ON_DISCONNECT] = None
        else:
            watcher.cancel()
