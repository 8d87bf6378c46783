"""The logging extension's HTTP routes: GET and POST /v2/logging (the extension: app/protocol/v2/log_settings.py)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from starlette.requests import Request

from app.http.endpoints import Endpoint, read_body, service_state
from app.http.openapi import error_responses, json_body
from app.protocol.errors import InvalidInput
from app.protocol.fields import json_type, loads_json
from app.protocol.limits import LOG_SETTINGS_BYTES
from app.protocol.v2.log_settings import FORMATS, log_settings


class LogSettingsModel(BaseModel):
    """Triton's log settings (every one in an answer; any of them in a POST)."""

    log_file: str = ""
    log_info: bool
    log_warning: bool
    log_error: bool
    log_verbose_level: int
    log_format: str


async def get_logging(request: Request) -> dict[str, Any]:
    return await log_settings(service_state(request))


async def post_logging(request: Request) -> dict[str, Any]:
    body = await read_body(request, LOG_SETTINGS_BYTES)
    document = loads_json(body) if body.strip() else {}  # an empty POST reads, as in Triton
    if not isinstance(document, dict):
        raise InvalidInput(f"a log settings request must be a JSON object, got {json_type(document)}")
    return await log_settings(service_state(request), document)


_OPENAPI = {"response_model": LogSettingsModel, "tags": ["v2 extensions"]}
ENDPOINTS = [
    Endpoint(
        "GET",
        "/v2/logging",
        get_logging,
        openapi={**_OPENAPI, "summary": "Log settings (logging extension)", "responses": error_responses(401)},
    ),
    Endpoint(
        "POST",
        "/v2/logging",
        post_logging,
        openapi={
            **_OPENAPI,
            "summary": "Change log settings in every worker (logging extension)",
            "responses": error_responses(400, 401, 413, 503),
            "openapi_extra": json_body(
                {
                    "type": "object",
                    "properties": {
                        "log_file": {"type": "string", "enum": [""]},
                        "log_info": {"type": "boolean"},
                        "log_warning": {"type": "boolean"},
                        "log_error": {"type": "boolean"},
                        "log_verbose_level": {"type": "integer", "minimum": 0},
                        "log_format": {"type": "string", "enum": list(FORMATS)},
                    },
                    "additionalProperties": False,
                },
                required=False,
            ),
        },
    ),
]
