"""Typed errors: one exception class per way a call can fail, carrying the server's message.

Every error the client raises is an `FFNError`. HTTP failures map by status code; an answer
that breaks the wire contract is a `ProtocolError`; no answer at all is a `TransportError`.
"""

from __future__ import annotations

import email.utils
import json
import re
import time
from collections.abc import Mapping


class FFNError(Exception):
    """A failed call. `status` is the HTTP status (None when no answer came back)."""

    default_status: int | None = None

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        error_type: str = "error",
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status if status is not None else self.default_status
        self.error_type = error_type
        self.retry_after = retry_after  # seconds, from a Retry-After header

    def __str__(self) -> str:
        status = f"HTTP {self.status} " if self.status is not None else ""
        return f"{status}{self.error_type}: {self.message}"


class BadRequest(FFNError):
    """400: the tensor is malformed or does not fit the model (shape, dtype, d_model)."""

    default_status = 400


class Unauthorized(FFNError):
    """401: the API key is missing or wrong."""

    default_status = 401


class ModelNotFound(FFNError):
    """404: no model of that name (or no such route on this server)."""

    default_status = 404


class NotAcceptable(FFNError):
    """406: the server cannot answer in the asked `Accept` encoding."""

    default_status = 406


class PayloadTooLarge(FFNError):
    """413: the request body is over the server's limit; send fewer rows per request."""

    default_status = 413


class UnsupportedMediaType(FFNError):
    """415: the server does not read this Content-Type."""

    default_status = 415


class Overloaded(FFNError):
    """429: the model's queue is full; `retry_after` says when to come back."""

    default_status = 429


class ServerError(FFNError):
    """5xx: the server failed (any 5xx without a class of its own)."""

    default_status = 500


class Unavailable(ServerError):
    """503: the server is not ready yet, or draining before shutdown."""

    default_status = 503


class DeadlineExceeded(ServerError):
    """504: the request's deadline (X-Timeout-Ms or the server default) passed before it ran."""

    default_status = 504


class OutOfMemory(ServerError):
    """507: the device ran out of memory for this batch; send fewer rows."""

    default_status = 507


class ProtocolError(FFNError):
    """The answer does not follow the wire contract (missing header, wrong size, bad JSON)."""


class TransportError(FFNError):
    """No answer: connection refused or reset, or the client-side timeout passed."""


class Timeout(TransportError):
    """The client-side timeout passed before the answer came back."""


ERRORS_BY_STATUS: dict[int, type[FFNError]] = {
    cls.default_status: cls
    for cls in (
        BadRequest,
        Unauthorized,
        ModelNotFound,
        NotAcceptable,
        PayloadTooLarge,
        UnsupportedMediaType,
        Overloaded,
        ServerError,
        Unavailable,
        DeadlineExceeded,
        OutOfMemory,
    )
}


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header: delta-seconds or an HTTP date; None if absent or bad."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def error_from_response(status: int, headers: Mapping[str, str], body: bytes) -> FFNError:
    """The typed error for a non-200 answer, with the server's `error` and `error_type`."""
    message, error_type = "", ""
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    if isinstance(payload, dict):
        # Our own {"error", "error_type"}; FastAPI's {"detail"} for routes the app does not own.
        detail = payload.get("error", payload.get("detail", ""))
        message = detail if isinstance(detail, str) else json.dumps(detail)
        error_type = str(payload.get("error_type", ""))
    elif body:
        message = body.decode("utf-8", "replace").strip()
        # A proxy's HTML error page (nginx: "<title>504 Gateway Time-out</title>"): its title says it.
        title = re.search(r"<title>\s*(.*?)\s*</title>", message, re.I | re.S)
        if title:
            message = f"{title[1]} (an HTML page, from a proxy?)"
    cls = ERRORS_BY_STATUS.get(status, ServerError if status >= 500 else FFNError)
    return cls(
        message or f"HTTP {status}",
        status=status,
        error_type=error_type or cls.__name__,
        retry_after=parse_retry_after(headers.get("retry-after")),
    )
