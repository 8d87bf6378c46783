"""RequestIds: every request gets an id, from its X-Request-Id header or made here, echoed on its answer.

The outermost layer of the app (pure ASGI, wrapped around Starlette's own error middleware, so
that even an unexpected 500 carries it): it puts the request's RequestContext in the context
variable that the error body, the access log and the tracing read (app/request_context.py), and
adds `X-Request-Id` to the answer's head. A client's id is kept when it follows the protocol
core's rule (app/protocol/identity.py), else replaced by a fresh one: never an id that could
forge a log line, and never a request refused for an optional header.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.protocol.identity import REQUEST_ID_HEADER, request_id_from
from app.request_context import CURRENT, RequestContext

HEADER = REQUEST_ID_HEADER


class RequestIds:
    """Gives each HTTP request its RequestContext and answers with its X-Request-Id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header, _ = request_id_from([value for name, value in scope["headers"] if name == HEADER])
        request_id = header.decode("ascii")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (HEADER, header)]
            await send(message)

        token = CURRENT.set(RequestContext(request_id))
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            CURRENT.reset(token)
