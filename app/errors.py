"""Service errors and the one place that maps them to HTTP.

Every error a client can cause is a `ServiceError` subclass with a status and an error_type;
`install_error_handlers` renders them, and FastAPI/Starlette's own errors, as
`{"error": "<what was wrong>", "error_type": "<kind>"}`. Nothing below the routes raises
HTTPException.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

log = logging.getLogger("ffn_serve")


class ServiceError(Exception):
    """An error with an HTTP status, a machine-readable kind and a message for the client."""

    status: int = 500
    error_type: str = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def headers(self) -> dict[str, str]:
        return {}


class InvalidInput(ServiceError):
    status, error_type = 400, "invalid_input"


class Unauthorized(ServiceError):
    status, error_type = 401, "unauthorized"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class ModelNotFound(ServiceError):
    status, error_type = 404, "model_not_found"


class NotAcceptable(ServiceError):
    status, error_type = 406, "not_acceptable"


class PayloadTooLarge(ServiceError):
    status, error_type = 413, "payload_too_large"


class UnsupportedMediaType(ServiceError):
    status, error_type = 415, "unsupported_media_type"


class Overloaded(ServiceError):
    status, error_type = 429, "overloaded"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class Unavailable(ServiceError):
    """Not ready yet, or draining before shutdown."""

    status, error_type = 503, "unavailable"

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"}


class DeadlineExceeded(ServiceError):
    status, error_type = 504, "deadline_exceeded"


class InsufficientMemory(ServiceError):
    """The request alone does not fit in the device's memory."""

    status, error_type = 507, "insufficient_memory"


class ModelError(ServiceError):
    """The forward pass failed for a reason that is not the client's: a bug or a device fault."""

    status, error_type = 500, "model_error"


def error_response(status: int, error_type: str, message: str, headers: dict[str, str] | None = None) -> Response:
    body = orjson.dumps({"error": message, "error_type": error_type})
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def render(exc: ServiceError) -> Response:
    return error_response(exc.status, exc.error_type, exc.message, exc.headers())


_STARLETTE_KINDS = {
    400: "invalid_input",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
}


def install_error_handlers(app: FastAPI) -> None:
    """Route every error through the one JSON shape."""

    async def on_service_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, ServiceError)
        return render(exc)

    async def on_http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        kind = _STARLETTE_KINDS.get(exc.status_code, "http_error")
        return error_response(exc.status_code, kind, str(exc.detail), dict(exc.headers or {}))

    async def on_validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg', 'invalid')}" for err in exc.errors()
        )
        return error_response(400, "invalid_input", problems or "invalid request")

    async def on_unexpected(_: Request, exc: Exception) -> Response:
        # A bug: log the traceback here, tell the client nothing internal.
        log.exception("unhandled error", exc_info=exc)
        return error_response(500, "internal", "internal server error")

    app.add_exception_handler(ServiceError, on_service_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unexpected)
    _document_validation_errors_as_400(app)


def _document_validation_errors_as_400(app: FastAPI) -> None:
    """Drop FastAPI's automatic 422 entries from /openapi.json: validation errors are answered 400 here."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()  # also cached in app.openapi_schema; edited in place
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
