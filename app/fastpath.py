"""FastPath: the tensor routes dispatched straight to their handlers.

FastAPI's per-request machinery (route matching through every route, dependency solving, its
extra middleware) costs more than the rest of a small request's work. This middleware sends
POST /v1/models/{name}/transform and POST /v2/models/{name}[/versions/{v}]/infer directly to
the very handler functions that the FastAPI routes call, and renders their errors through the
same `app.errors.render`. The FastAPI routes stay registered: they define the OpenAPI page, and
behave the same for any request that reaches them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from app.errors import ServiceError, error_response, render

log = logging.getLogger("ffn_serve")

Handler = Callable[..., Awaitable[Response]]


class FastPath:
    def __init__(self, app: ASGIApp, *, routes: list[tuple[str, Handler]]) -> None:
        self.app = app
        self._routes = [(re.compile(pattern), handler) for pattern, handler in routes]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            for pattern, handler in self._routes:
                match = pattern.fullmatch(path)
                if match is not None:
                    await self._handle(handler, match.groupdict(), scope, receive, send)
                    return
        await self.app(scope, receive, send)

    @staticmethod
    async def _handle(handler: Handler, params: dict[str, str], scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        try:
            response = await handler(request=request, **params)
        except ServiceError as exc:
            response = render(exc)
        except Exception:
            log.exception("unhandled error in %s %s", scope["method"], scope["path"])
            response = error_response(500, "internal", "internal server error")
        await response(scope, receive, send)
