"""Everything that shapes /openapi.json beyond what the routes declare, in one place.

- Error answers are documented with the one error body, by status (`error_responses`).
- FastAPI's automatic 422 entries are dropped: validation errors are answered 400 here.
- JSON Schemas with `$defs` are written inline for hand-written request bodies
  (`inline_defs`): FastAPI does not copy them into the page's components.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, Field

_ERROR_DESCRIPTIONS = {
    400: "Malformed or mismatched input.",
    401: "Missing or wrong API key.",
    404: "Unknown model.",
    406: "Unsupported Accept.",
    413: "Body too large.",
    415: "Unsupported Content-Type or Content-Encoding.",
    429: "Queue full; retry after the Retry-After header's seconds.",
    503: "Not ready, or draining before shutdown.",
    504: "Deadline passed while queued.",
    507: "The request alone does not fit in the device's memory.",
}


class ErrorBody(BaseModel):
    error: str = Field(description="What was wrong, for a person to read.")
    error_type: str = Field(description="The kind of error, for a program: invalid_input, model_not_found, ...")
    request_id: str = Field(description="The request's id: its X-Request-Id, or the one the server gave it.")
    id: str | None = Field(default=None, description="A V2 infer request's `id`, when it sent one.")


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error statuses a route can answer."""
    return {status: {"model": ErrorBody, "description": _ERROR_DESCRIPTIONS[status]} for status in statuses}


def json_body(schema: dict[str, Any], *, required: bool = True) -> dict[str, Any]:
    """An operation's `openapi_extra` declaring a JSON request body of `schema` (routes that read the body by hand)."""
    return {"requestBody": {"required": required, "content": {"application/json": {"schema": schema}}}}


def inline_defs(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with its `$defs` written in place."""
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {key: resolve(value) for key, value in node.items()}
        if isinstance(node, list):
            return [resolve(value) for value in node]
        return node

    return resolve(schema)


def document_validation_errors_as_400(app: FastAPI) -> None:
    """Drop FastAPI's automatic 422 entries (and their schemas) from the page."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()  # also cached in app.openapi_schema: edited in place, once
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
