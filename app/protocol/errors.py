"""The protocol's errors, and the one table that maps every error to an HTTP status, a gRPC code and error_type.

Engine errors (app.engine.errors) are kinds without statuses; the protocol adds its own (bad
input, auth, negotiation, limits). `ERRORS` maps both to how each door answers them, the way
TEI's router maps ErrorType to StatusCode: the HTTP door renders `{"error", "error_type"}` bodies
(app/http/errors.py), the gRPC door the `grpc` column's code, named here as a plain value
(app/grpc/status.py turns it into grpc.StatusCode), so both doors agree and this module imports
neither door's stack.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from app.control import Unanswered
from app.engine import errors as engine
from app.errors import ServiceError


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


class HttpVersionNotSupported(EdgeError):
    """A request line naming an HTTP version other than 1.1 and 1.0 (RFC 9110 §15.6.6: 505); the connection is closed."""


class TooManyBytesHeld(EdgeError):
    """The requests this process is answering hold its budget of bytes (max_held_bytes); retry shortly."""


class TooManyCalls(EdgeError):
    """The door runs its maximum of calls at once (max_connections); retry shortly."""


class TooManyConnections(EdgeError):
    """The server holds its maximum of open connections; this one is answered and closed."""


class NotApplied(EdgeError):
    """A change every serving process must apply did not reach them all (one exited, or refused it)."""


class RegionNotFound(EdgeError):
    """No shared-memory region of that name is registered."""


class QuietStreamClosed(EdgeError):
    """A gRPC stream quiet between its messages gave its room to another call; start a new stream."""


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
    grpc: str  # a grpc.StatusCode member's name: INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...
    headers: Callable[[Exception], dict[str, str]] = field(default=lambda exc: {})


ERRORS: dict[type[Exception], ErrorKind] = {
    InvalidInput: ErrorKind(400, "invalid_input", "INVALID_ARGUMENT"),
    UnsupportedExtension: ErrorKind(400, "unsupported_extension", "UNIMPLEMENTED"),
    # As an extension turned off by a setting (system shared memory): UNIMPLEMENTED over gRPC.
    engine.ModelControlOff: ErrorKind(400, "model_control_off", "UNIMPLEMENTED"),
    # Triton answers a failed load 400, whatever the reason; tritonclient raises on any of them.
    engine.LoadFailed: ErrorKind(400, "load_failed", "INVALID_ARGUMENT"),
    Unauthorized: ErrorKind(401, "unauthorized", "UNAUTHENTICATED", lambda exc: {"WWW-Authenticate": "Bearer"}),
    engine.ModelNotFound: ErrorKind(404, "model_not_found", "NOT_FOUND"),
    RegionNotFound: ErrorKind(404, "region_not_found", "NOT_FOUND"),
    NotFound: ErrorKind(404, "not_found", "NOT_FOUND"),
    NotAcceptable: ErrorKind(406, "not_acceptable", "INVALID_ARGUMENT"),
    RequestTimeout: ErrorKind(408, "request_timeout", "DEADLINE_EXCEEDED", _close_connection),
    PayloadTooLarge: ErrorKind(413, "payload_too_large", "RESOURCE_EXHAUSTED"),
    engine.RequestTooLarge: ErrorKind(413, "payload_too_large", "RESOURCE_EXHAUSTED"),
    UnsupportedMediaType: ErrorKind(415, "unsupported_media_type", "INVALID_ARGUMENT"),
    engine.Overloaded: ErrorKind(
        429,
        "overloaded",
        "RESOURCE_EXHAUSTED",
        _retry_after(lambda exc: exc.retry_after_s if isinstance(exc, engine.Overloaded) else 1),
    ),
    NonFiniteOutput: ErrorKind(422, "non_finite_output", "OUT_OF_RANGE"),
    TooManyBytesHeld: ErrorKind(429, "too_many_bytes_held", "RESOURCE_EXHAUSTED", _retry_after(lambda exc: 1)),
    HeaderTooLarge: ErrorKind(431, "header_too_large", "RESOURCE_EXHAUSTED", _close_connection),
    ClientDisconnected: ErrorKind(499, "client_closed_request", "CANCELLED"),
    engine.ModelError: ErrorKind(500, "model_error", "INTERNAL"),
    UnsupportedTransferEncoding: ErrorKind(501, "unsupported_transfer_encoding", "UNIMPLEMENTED", _close_connection),
    engine.Unavailable: ErrorKind(503, "unavailable", "UNAVAILABLE", _retry_after(lambda exc: 1)),
    TooManyCalls: ErrorKind(429, "too_many_calls", "RESOURCE_EXHAUSTED", _retry_after(lambda exc: 1)),
    TooManyConnections: ErrorKind(
        503,
        "too_many_connections",
        "UNAVAILABLE",
        lambda exc: {"Retry-After": "1", **_close_connection(exc)},
    ),
    NotApplied: ErrorKind(503, "unavailable", "UNAVAILABLE", _retry_after(lambda exc: 1)),
    QuietStreamClosed: ErrorKind(503, "unavailable", "UNAVAILABLE", _retry_after(lambda exc: 1)),
    Unanswered: ErrorKind(503, "unavailable", "UNAVAILABLE", _retry_after(lambda exc: 1)),
    engine.DeadlineExceeded: ErrorKind(504, "deadline_exceeded", "DEADLINE_EXCEEDED"),
    HttpVersionNotSupported: ErrorKind(505, "http_version_not_supported", "UNIMPLEMENTED", _close_connection),
    engine.InsufficientMemory: ErrorKind(507, "insufficient_memory", "RESOURCE_EXHAUSTED"),
}
# Anything else is a bug: answered 500 with nothing internal in the message.
INTERNAL = ErrorKind(500, "internal", "INTERNAL")


def kind_of(exc: Exception) -> ErrorKind:
    """The table's entry for `exc`'s class or its nearest listed base; INTERNAL if none."""
    for cls in type(exc).__mro__:
        kind = ERRORS.get(cls)
        if kind is not None:
            return kind
    return INTERNAL


def error_type_of(exc: BaseException) -> str:
    """The error_type a request that failed with `exc` is counted under."""
    return kind_of(exc).error_type if isinstance(exc, Exception) else INTERNAL.error_type


Door = Literal["http", "grpc"]


def message_of(exc: Exception, door: Door) -> str:
    """What the client reads for `exc` through `door`: the error's message, and where to go next on that door.

    Errors carry data (which model, which setting); the hint that names a path or a method is the
    door's, so that a gRPC client is never told to GET an HTTP path.
    """
    message = exc.message if isinstance(exc, ServiceError) else str(exc)
    hint = _hint(exc, door)
    return f"{message}; {hint}" if hint else message


def _hint(exc: Exception, door: Door) -> str | None:
    if isinstance(exc, engine.ModelNotFound) and exc.version is None:
        if exc.unloaded:
            load = f"POST /v2/repository/models/{exc.name[:100]}/load" if door == "http" else "RepositoryModelLoad"
            return f"{load} serves it again"
        return "GET /v1/models lists the models" if door == "http" else "RepositoryIndex lists the models"
    if isinstance(exc, engine.ModelControlOff):
        return "start the server with --model-control explicit (FFN_MODEL_CONTROL=explicit) to load and unload them"
    return None
