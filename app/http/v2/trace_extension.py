"""The trace extension's HTTP routes: GET/POST /v2/trace/setting and /v2/models/{name}/trace/setting.

The settings and their rules are app/protocol/v2/trace_extension.py's.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from app.http.endpoints import Endpoint, StateDep, read_body, service_state
from app.http.openapi import error_responses, json_body
from app.protocol.fields import loads_json
from app.protocol.limits import TRACE_SETTINGS_BYTES
from app.protocol.v2.trace_extension import settings_of, update_settings
from app.tracing.trace_settings import LEVELS, MODE, OFF


async def _update(request: Request, name: str | None) -> dict[str, Any]:
    body = await read_body(request, TRACE_SETTINGS_BYTES)
    return await update_settings(service_state(request), name, loads_json(body) if body.strip() else {})


async def get_setting(state: StateDep) -> dict[str, Any]:
    return await settings_of(state, None)


async def get_model_setting(name: str, state: StateDep) -> dict[str, Any]:
    return await settings_of(state, name)


async def update_setting(request: Request) -> dict[str, Any]:
    return await _update(request, None)


async def update_model_setting(name: str, request: Request) -> dict[str, Any]:
    return await _update(request, name)


_SETTING_SCHEMAS: dict[str, Any] = {
    "trace_level": {"type": "array", "items": {"type": "string", "enum": [OFF, *LEVELS]}},
    "trace_rate": {"type": "string"},
    "trace_count": {"type": "string"},
    "log_frequency": {"type": "string"},
    "trace_mode": {"type": "string", "enum": [MODE]},
}
_SETTINGS_SCHEMA = {"type": "object", "properties": _SETTING_SCHEMAS, "required": list(_SETTING_SCHEMAS)}
_GET = {
    "summary": "Trace settings (Triton's trace extension)",
    "responses": {200: {"content": {"application/json": {"schema": _SETTINGS_SCHEMA}}}, **error_responses(401, 404)},
    "tags": ["v2 extensions"],
}
_POST = {
    **_GET,
    "summary": "Change trace settings, in every worker (Triton's trace extension)",
    "responses": {
        200: {"content": {"application/json": {"schema": _SETTINGS_SCHEMA}}},
        **error_responses(400, 401, 404, 413, 503),
    },
    "openapi_extra": json_body(
        {
            "type": "object",
            "description": "Only the settings to change; null puts one back.",
            "properties": {name: {"anyOf": [schema, {"type": "null"}]} for name, schema in _SETTING_SCHEMAS.items()},
        },
        required=False,
    ),
}

ENDPOINTS = [
    Endpoint("GET", "/v2/trace/setting", get_setting, openapi=_GET),
    Endpoint("POST", "/v2/trace/setting", update_setting, openapi=_POST),
    Endpoint("GET", "/v2/models/{name}/trace/setting", get_model_setting, openapi=_GET),
    Endpoint("POST", "/v2/models/{name}/trace/setting", update_model_setting, openapi=_POST),
]
