"""Endpoints declared once: method, path and handler feed both FastAPI and the fast path.

FastAPI's per-request machinery (matching through every route, dependency solving, its extra
middleware) costs more than the rest of a small request's work. So the tensor routes
(`fast=True`) are also dispatched by `FastPath`, a pure ASGI middleware that matches the same
path templates (compiled by Starlette's own `compile_path`) and calls the very same handler,
rendering its errors through the one error table. Every endpoint is registered with FastAPI
too, which gives the OpenAPI page and serves any request the fast path lets through.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import compile_path
from starlette.types import ASGIApp, Receive, Scope, Send

from app.web.errors import INTERNAL, error_response, kind_of

log = logging.getLogger("ffn_serve")

Handler = Callable[..., Awaitable[Any]]


@dataclass(frozen=True)
class Endpoint:
    """One route. `fast` handlers take `request` and the path parameters as keywords."""

    method: str
    path: str  # a Starlette path template: /v1/models/{name}/transform
    handler: Handler
    fast: bool = False
    openapi: dict[str, Any] = field(default_factory=dict)  # FastAPI route options: summary, responses, ...


def register(app: FastAPI, endpoints: Sequence[Endpoint], *, fast_path: bool = True) -> None:
    """Add every endpoint to FastAPI, and the fast ones to a FastPath in front of it."""
    for endpoint in endpoints:
        app.add_api_route(endpoint.path, endpoint.handler, methods=[endpoint.method], **endpoint.openapi)
    fast = [endpoint for endpoint in endpoints if endpoint.fast]
    if fast_path and fast:
        app.add_middleware(FastPath, endpoints=fast)


class FastPath:
    """Calls the fast endpoints' handlers directly; every other request goes on to FastAPI."""

    def __init__(self, app: ASGIApp, *, endpoints: Sequence[Endpoint]) -> None:
        self.app = app
        self._routes: list[tuple[str, re.Pattern[str], Handler]] = [
            (endpoint.method, compile_path(endpoint.path)[0], endpoint.handler) for endpoint in endpoints
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            method, path = scope["method"], scope["path"]
            for route_method, pattern, handler in self._routes:
                if method == route_method and (match := pattern.match(path)) is not None:
                    await self._handle(handler, match.groupdict(), scope, receive, send)
                    return
        await self.app(scope, receive, send)

    @staticmethod
    async def _handle(handler: Handler, params: dict[str, str], scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        try:
            response: Response = await handler(request=request, **params)
        except Exception as exc:
            if kind_of(exc) is INTERNAL:  # a bug: keep its traceback; the client learns nothing internal
                log.exception("unhandled error in %s %s", scope["method"], scope["path"])
            response = error_response(exc)
        await response(scope, receive, send)
