"""The edge's errors, and the one table that maps every error to an HTTP status, a gRPC status and error_type.

Engine errors (app.engine.errors) are kinds without statuses; the edge adds its own (bad input,
auth, negotiation, limits). `ERRORS` maps both to `{"error": ..., "error_type": ...}` answers,
the way TEI's router maps ErrorType to StatusCode. Every error answer of the service, whether
from a route, the fast path, the guard or a health probe, is rendered by `error_response`, and
carries the request's id (`request_id`, also its X-Request-Id header) and, for a V2 request that
sent one, its `id`. The gRPC door (app/grpc/status.py) reads the same table's `grpc` column, so
both doors agree.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from grpc import StatusCode
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from app import request_context
from app.control import Unanswered
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


class NotApplied(EdgeError):
    """A change every serving process must apply did not reach them all (one exited, or refused it)."""


class RegionNotFound(EdgeError):
    """No shared-memory region of that name is registered."""


def _close_connection(exc: Exception) -> dict[str, str]:
    """Answers after which the connection cannot be trusted (framing, a half-read head): close it."""
    return {"Connection": "close"}


def _retry_after(seconds: Callable[[Exception], int]) -> Callable[[Exception], dict[str, str]]:
    return lambda exc: {"Retry-After": str(seconds(exc))}


@dataclass(frozen=True)
class ErrorKind:
    """How one kind of error is answered: its HTTP status, its gRPC status, its error_type, its headers.

    The gRPC codes are Triton's where Triton has the case (an unsupported extension is
    UNIMPLEMENTED there), else the canonical mapping of the HTTP status (google.rpc.Code).
    """

    status: int
    error_type: str
    grpc: StatusCode
    headers: Callable[[Exception], dict[str, str]] = field(default=lambda exc: {})


ERRORS: dict[type[Exception], ErrorKind] = {
    InvalidInput: ErrorKind(400, "invalid_input", StatusCode.INVALID_ARGUMENT),
    UnsupportedExtension: ErrorKind(400, "unsupported_extension", StatusCode.UNIMPLEMENTED),
    # As an extension turned off by a setting (system shared memory): UNIMPLEMENTED over gRPC.
    engine.ModelControlOff: ErrorKind(400, "model_control_off", StatusCode.UNIMPLEMENTED),
    # Triton answers a failed load 400, whatever the reason; tritonclient raises on any of them.
    engine.LoadFailed: ErrorKind(400, "load_failed", StatusCode.INVALID_ARGUMENT),
    Unauthorized: ErrorKind(
        401, "unauthorized", StatusCode.UNAUTHENTICATED, lambda exc: {"WWW-Authenticate": "Bearer"}
    ),
    engine.ModelNotFound: ErrorKind(404, "model_not_found", StatusCode.NOT_FOUND),
    RegionNotFound: ErrorKind(404, "region_not_found", StatusCode.NOT_FOUND),
    NotFound: ErrorKind(404, "not_found", StatusCode.NOT_FOUND),
    NotAcceptable: ErrorKind(406, "not_acceptable", StatusCode.INVALID_ARGUMENT),
    RequestTimeout: ErrorKind(408, "request_timeout", StatusCode.DEADLINE_EXCEEDED, _close_connection),
    PayloadTooLarge: ErrorKind(413, "payload_too_large", StatusCode.RESOURCE_EXHAUSTED),
    engine.RequestTooLarge: ErrorKind(413, "payload_too_large", StatusCode.RESOURCE_EXHAUSTED),
    UnsupportedMediaType: ErrorKind(415, "unsupported_media_type", StatusCode.INVALID_ARGUMENT),
    engine.Overloaded: ErrorKind(
        429,
        "overloaded",
        StatusCode.RESOURCE_EXHAUSTED,
        _retry_after(lambda exc: exc.retry_after_s if isinstance(exc, engine.Overloaded) else 1),
    ),
    NonFiniteOutput: ErrorKind(422, "non_finite_output", StatusCode.OUT_OF_RANGE),
    TooManyBytesHeld: ErrorKind(429, "too_many_bytes_held", StatusCode.RESOURCE_EXHAUSTED, _retry_after(lambda exc: 1)),
    HeaderTooLarge: ErrorKind(431, "header_too_large", StatusCode.RESOURCE_EXHAUSTED, _close_connection),
    ClientDisconnected: ErrorKind(499, "client_closed_request", StatusCode.CANCELLED),
    # Starlette's own: the client left while its body was being read.
    ClientDisconnect: ErrorKind(499, "client_closed_request", StatusCode.CANCELLED),
    engine.ModelError: ErrorKind(500, "model_error", StatusCode.INTERNAL),
    UnsupportedTransferEncoding: ErrorKind(
        501, "unsupported_transfer_encoding", StatusCode.UNIMPLEMENTED, _close_connection
    ),
    engine.Unavailable: ErrorKind(503, "unavailable", StatusCode.UNAVAILABLE, _retry_after(lambda exc: 1)),
    TooManyConnections: ErrorKind(
        503,
        "too_many_connections",
        StatusCode.UNAVAILABLE,
        lambda exc: {"Retry-After": "1", **_close_connection(exc)},
    ),
    NotApplied: ErrorKind(503, "unavailable", StatusCode.UNAVAILABLE, _retry_after(lambda exc: 1)),
    Unanswered: ErrorKind(503, "unavailable", StatusCode.UNAVAILABLE, _retry_after(lambda exc: 1)),
    engine.DeadlineExceeded: ErrorKind(504, "deadline_exceeded", StatusCode.DEADLINE_EXCEEDED),
    engine.InsufficientMemory: ErrorKind(507, "insufficient_memory", StatusCode.RESOURCE_EXHAUSTED),
}
# Anything else is a bug: answered 500 with nothing internal in the message.
INTERNAL = ErrorKind(500, "internal", StatusCode.INTERNAL)
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


def error_body(message: str, error_type: str, request_id: str | None = None) -> bytes:
    """The one JSON error shape: {"error": what was wrong, "error_type": its kind, "request_id": ...}.

    `request_id`: the current request's (app/request_context.py) unless given; a fresh one for an
    answer given outside any request (the protocol's own refusals). A V2 request's `id` is added
    as "id" once its body has been read. Clients that read "error" and "error_type" read on.
    """
    body: dict[str, str] = {"error": message, "error_type": error_type}
    context = request_context.current()
    if request_id is None:
        request_id = context.request_id if context is not None else request_context.new_request_id()
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
