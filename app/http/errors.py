"""Error answers of the HTTP door: the protocol's one table (app/protocol/errors.py) as JSON bodies.

Every error answer over HTTP, whether from a route, the fast path, the guard, a health probe or
the transport's own refusals, is rendered here: `{"error": ..., "error_type": ...}` with the
table's status and headers, carrying the request's id (`request_id`, also its X-Request-Id
header) and, for a V2 request that sent one, its `id`.
"""

from __future__ import annotations

import logging

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from app.errors import ServiceError
from app.observe import identity
from app.protocol.errors import INTERNAL, ClientDisconnected, ErrorKind, InvalidInput, message_of
from app.protocol.errors import kind_of as protocol_kind_of

log = logging.getLogger("ffn_serve")

MAX_PATH_SHOWN = 100  # a path a 405 names: the client's own, bounded
# Errors that Starlette and FastAPI raise themselves, by status (unknown route, wrong method, ...).
FRAMEWORK_ERROR_TYPES = {
    400: "invalid_input",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
}


def kind_of(exc: Exception) -> ErrorKind:
    """The table's entry for `exc`; Starlette's own hang-up (a body read by the framework) is the client's 499."""
    if isinstance(exc, ClientDisconnect):
        return protocol_kind_of(ClientDisconnected("the client closed the connection"))
    return protocol_kind_of(exc)


def error_body(message: str, error_type: str, request_id: str | None = None) -> bytes:
    """The one JSON error shape: {"error": what was wrong, "error_type": its kind, "request_id": ...}.

    `request_id`: the current request's (app/observe/identity.py) unless given; a fresh one for an
    answer given outside any request (the transport's own refusals). A V2 request's `id` is added
    as "id" once its body has been read. Clients that read "error" and "error_type" read on.
    """
    body: dict[str, str] = {"error": message, "error_type": error_type}
    context = identity.current()
    if request_id is None:
        request_id = context.request_id if context is not None else identity.new_request_id()
    body["request_id"] = request_id
    if context is not None and context.v2_id is not None:
        body["id"] = context.v2_id
    return orjson.dumps(body)


def raw_error_response(status: int, error_type: str, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(message, error_type), status_code=status, media_type="application/json", headers=headers)


def error_response(exc: Exception) -> Response:
    """The answer to a service error, from the table."""
    kind = kind_of(exc)
    if kind is INTERNAL:
        return raw_error_response(500, "internal", "internal server error")
    return raw_error_response(kind.status, kind.error_type, message_of(exc, "http"), kind.headers(exc))


def install_error_handlers(app: FastAPI) -> None:
    """Route every error, the service's and the framework's, through the one JSON shape."""

    async def on_service_error(_: Request, exc: Exception) -> Response:
        return error_response(exc)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException), "handler registered for HTTPException; this is a bug."
        kind = FRAMEWORK_ERROR_TYPES.get(exc.status_code, "http_error")
        headers = dict(exc.headers or {})
        message = str(exc.detail)
        allowed = headers.get("Allow") or headers.get("allow")
        if exc.status_code == 405 and allowed:  # name the method the path takes, as the Allow header does
            message = f"{request.method} is not served on {request.url.path[:MAX_PATH_SHOWN]!r}: send {allowed}"
        return raw_error_response(exc.status_code, kind, message, headers)

    async def on_validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError), "handler registered for validation errors; this is a bug."
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg', 'invalid')}" for err in exc.errors()
        )
        return error_response(InvalidInput(problems or "invalid request"))

    async def on_unexpected(_: Request, exc: Exception) -> Response:
        # A bug: log the traceback here, tell the client nothing internal.
        if not isinstance(exc, ClientDisconnect):
            log.exception("unhandled error", exc_info=exc)
        return error_response(exc)

    app.add_exception_handler(ServiceError, on_service_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unexpected)
