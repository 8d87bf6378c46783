"""The edge's errors, and the one table that maps every error to an HTTP status and error_type.

Engine errors (app.engine.errors) are kinds without statuses; the edge adds its own (bad input,
auth, negotiation, limits). `ERRORS` maps both to `{"error": ..., "error_type": ...}` answers,
the way TEI's router maps ErrorType to StatusCode. Every error answer of the service, whether
from a route, the fast path, the guard or a health probe, is rendered by `error_response`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from app.engine import errors as engine
from app.errors import ServiceError

log = logging.getLogger("ffn_serve")


class EdgeError(ServiceError):
    """An error found at the edge, before the engine sees the request."""


class InvalidInput(EdgeError):
    """Malformed or mismatched input: shape, dtype, size, JSON, headers."""


class UnsupportedExtension(EdgeError):
    """A V2 protocol extension this server does not implement: shared memory, trace, logging, ..."""

    def __init__(self, extension: str, detail: str) -> None:
        super().__init__(f"the {extension} extension is not supported by this server: {detail}")
        self.extension = extension


class Unauthorized(EdgeError):
    """Missing or wrong API key."""


class NotFound(EdgeError):
    """No such route here (the metrics port serves /metrics only)."""


class NotAcceptable(EdgeError):
    """The answer cannot be given in any encoding the Accept header allows."""


class PayloadTooLarge(EdgeError):
    """The body is over the size limit."""


class UnsupportedMediaType(EdgeError):
    """A Content-Type or Content-Encoding the service does not read."""


class HeaderTooLarge(EdgeError):
    """The request's header block is over the limit."""


class ClientDisconnected(EdgeError):
    """The client hung up before its answer was ready (nginx's 499); nobody reads this answer."""


class RequestTimeout(EdgeError):
    """The client stopped sending its request (head or body) for longer than the read timeout."""


class NonFiniteOutput(EdgeError):
    """A finite input whose output overflowed the answer's dtype (inf or NaN): nothing to answer with."""


class UnsupportedTransferEncoding(EdgeError):
    """A Transfer-Encoding other than chunked (RFC 9112: 501); the connection is closed after the answer."""


class TooManyBytesHeld(EdgeError):
    """The requests this process is answering hold its budget of bytes (max_held_bytes); retry shortly."""


class TooManyConnections(EdgeError):
    """The server holds its maximum of open connections; this one is answered and closed."""


def _close_connection(exc: Exception) -> dict[str, str]:
    """Answers after which the connection cannot be trusted (framing, a half-read head): close it."""
    return {"Connection": "close"}


def _retry_after(seconds: Callable[[Exception], int]) -> Callable[[Exception], dict[str, str]]:
    return lambda exc: {"Retry-After": str(seconds(exc))}


@dataclass(frozen=True)
class ErrorKind:
    """How one kind of error is answered."""

    status: int
    error_type: str
    headers: Callable[[Exception], dict[str, str]] = field(default=lambda exc: {})


ERRORS: dict[type[Exception], ErrorKind] = {
    InvalidInput: ErrorKind(400, "invalid_input"),
    UnsupportedExtension: ErrorKind(400, "unsupported_extension"),
    Unauthorized: ErrorKind(401, "unauthorized", lambda exc: {"WWW-Authenticate": "Bearer"}),
    engine.ModelNotFound: ErrorKind(404, "model_not_found"),
    NotFound: ErrorKind(404, "not_found"),
    NotAcceptable: ErrorKind(406, "not_acceptable"),
    RequestTimeout: ErrorKind(408, "request_timeout", _close_connection),
    PayloadTooLarge: ErrorKind(413, "payload_too_large"),
    engine.RequestTooLarge: ErrorKind(413, "payload_too_large"),
    UnsupportedMediaType: ErrorKind(415, "unsupported_media_type"),
    engine.Overloaded: ErrorKind(
        429, "overloaded", _retry_after(lambda exc: exc.retry_after_s if isinstance(exc, engine.Overloaded) else 1)
    ),
    NonFiniteOutput: ErrorKind(422, "non_finite_output"),
    TooManyBytesHeld: ErrorKind(429, "too_many_bytes_held", _retry_after(lambda exc: 1)),
    HeaderTooLarge: ErrorKind(431, "header_too_large", _close_connection),
    ClientDisconnected: ErrorKind(499, "client_closed_request"),
    # Starlette's own: the client left while its body was being read.
    ClientDisconnect: ErrorKind(499, "client_closed_request"),
    engine.ModelError: ErrorKind(500, "model_error"),
    UnsupportedTransferEncoding: ErrorKind(501, "unsupported_transfer_encoding", _close_connection),
    engine.Unavailable: ErrorKind(503, "unavailable", _retry_after(lambda exc: 1)),
    TooManyConnections: ErrorKind(
        503, "too_many_connections", lambda exc: {"Retry-After": "1", **_close_connection(exc)}
    ),
    engine.DeadlineExceeded: ErrorKind(504, "deadline_exceeded"),
    engine.InsufficientMemory: ErrorKind(507, "insufficient_memory"),
}
# Anything else is a bug: answered 500 with nothing internal in the message.
INTERNAL = ErrorKind(500, "internal")
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
    """The table's entry for `exc`'s class or its nearest listed base; INTERNAL if none."""
    for cls in type(exc).__mro__:
        kind = ERRORS.get(cls)
        if kind is not None:
            return kind
    return INTERNAL


def error_body(message: str, error_type: str) -> bytes:
    """The one JSON error shape: {"error": what was wrong, "error_type": its kind}."""
    return orjson.dumps({"error": message, "error_type": error_type})


def raw_error_response(status: int, error_type: str, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(message, error_type), status_code=status, media_type="application/json", headers=headers)


def error_response(exc: Exception) -> Response:
    """The answer to a service error, from the table."""
    kind = kind_of(exc)
    if kind is INTERNAL:
        return raw_error_response(500, "internal", "internal server error")
    message = exc.message if isinstance(exc, ServiceError) else str(exc)
    return raw_error_response(kind.status, kind.error_type, message, kind.headers(exc))


def error_type_of(exc: BaseException) -> str:
    """The error_type a request that failed with `exc` is counted under."""
    return kind_of(exc).error_type if isinstance(exc, Exception) else INTERNAL.error_type


def install_error_handlers(app: FastAPI) -> None:
    """Route every error, the service's and the framework's, through the one JSON shape."""

    async def on_service_error(_: Request, exc: Exception) -> Response:
        return error_response(exc)

    async def on_http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException), "handler registered for HTTPException; this is a bug."
        kind = FRAMEWORK_ERROR_TYPES.get(exc.status_code, "http_error")
        return raw_error_response(exc.status_code, kind, str(exc.detail), dict(exc.headers or {}))

    async def on_validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError), "handler registered for validation errors; this is a bug."
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg', 'invalid')}" for err in exc.errors()
        )
        return error_response(InvalidInput(problems or "invalid request"))

    async def on_unexpected(_: Request, exc: Exception) -> Response:
        # A bug: log the traceback here, tell the client nothing internal.
        log.exception("unhandled error", exc_info=exc)
        return error_response(exc)

    app.add_exception_handler(ServiceError, on_service_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unexpected)
