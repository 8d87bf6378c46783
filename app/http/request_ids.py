"""RequestIds: every request gets an id, from its X-Request-Id header or made here, echoed on its answer.

The outermost layer of the app (pure ASGI, wrapped around Starlette's own error middleware, so
that even an unexpected 500 carries it): it puts the request's RequestContext in the context
variable that the error body, the access log and the tracing read (app/request_context.py), and
adds `X-Request-Id` to the answer's head. A client's id is bounded, since it lands in log lines
and spans: 1 to 200 characters among letters, digits and `-_.:+/=@` (a UUID, nginx's
$request_id, Heroku's ids all fit). Anything else, or the header twice, is a 400 that carries a
fresh id: never an id that could forge a log line.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.http.errors import error_response
from app.protocol.errors import InvalidInput
from app.protocol.identity import REQUEST_ID_HEADER, request_id_problem
from app.request_context import CURRENT, RequestContext, new_request_id

HEADER = REQUEST_ID_HEADER


class RequestIds:
    """Gives each HTTP request its RequestContext and answers with its X-Request-Id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = [value for name, value in scope["headers"] if name == HEADER]
        problem = request_id_problem(given) if given else None
        if given and problem is None:
            request_id, header = given[0].decode("ascii"), given[0]
        else:
            request_id = new_request_id()
            header = request_id.encode("ascii")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (HEADER, header)]
            await send(message)

        token = CURRENT.set(RequestContext(request_id))
        try:
            if problem is not None:
                await error_response(InvalidInput(problem))(scope, receive, send_with_id)
                return
            await self.app(scope, receive, send_with_id)
        finally:
            CURRENT.reset(token)
