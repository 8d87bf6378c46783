"""Triton's logging extension: GET/POST /v2/logging, applied at runtime in every worker.

The settings, in Triton's JSON shape: `log_file` (always "": records go to stderr, and a file
cannot be chosen over the network), `log_info`, `log_warning`, `log_error` (each severity on or
off, independently), `log_verbose_level` (above 0, debug records too) and `log_format` (this
server's two, `text` and `json`, where Triton has `default` and `ISO8601`). A POST changes only
the settings it names (null: unchanged), answers all of them, and is applied in every serving
process by a sticky control command, so a worker started later logs the same way.

`log_settings(state, update)` is the whole extension, for each protocol's door to call.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, get_args

from pydantic import BaseModel
from starlette.requests import Request

from app.logs import LogFormat, LogSettings, apply_log_settings, current_log_settings
from app.web.broadcast import apply_everywhere
from app.web.endpoints import Endpoint
from app.web.errors import InvalidInput
from app.web.fields import bool_field, int_field, json_type, str_field
from app.web.http import read_body
from app.web.openapi import error_responses
from app.web.state import ServiceState, service_state
from app.web.tensors import loads_json

log = logging.getLogger("ffn_serve")

COMMAND = "log_settings"  # the control command, and its sticky key: the latest settings win
FORMATS: tuple[str, ...] = get_args(LogFormat)
_NAMES = ("log_file", "log_info", "log_warning", "log_error", "log_verbose_level", "log_format")
MAX_BODY_BYTES = 4096  # six small settings


class LogSettingsModel(BaseModel):
    """Triton's log settings (every one in an answer; any of them in a POST)."""

    log_file: str = ""
    log_info: bool
    log_warning: bool
    log_error: bool
    log_verbose_level: int
    log_format: str


def as_json(settings: LogSettings) -> dict[str, Any]:
    return {
        "log_file": "",
        "log_info": settings.info,
        "log_warning": settings.warning,
        "log_error": settings.error,
        "log_verbose_level": settings.verbose_level,
        "log_format": settings.format,
    }


def updated(settings: LogSettings, update: dict[str, Any]) -> LogSettings:
    """`settings` with the members of a POST body applied; InvalidInput (400) names any mistake."""
    unknown = sorted(set(update) - set(_NAMES))
    if unknown:
        raise InvalidInput(f"unknown log setting {unknown[0][:64]!r}; the settings are {list(_NAMES)}")
    where = "log setting"
    log_file = str_field(update, "log_file", where)
    if log_file:
        raise InvalidInput('log_file cannot be changed over the network: the server logs to stderr (log_file "")')
    changes: dict[str, Any] = {}
    for name, field in (("log_info", "info"), ("log_warning", "warning"), ("log_error", "error")):
        value = bool_field(update, name, where)
        if value is not None:
            changes[field] = value
    verbose = int_field(update, "log_verbose_level", where, minimum=0, maximum=2**32 - 1)
    if verbose is not None:
        changes["verbose_level"] = verbose
    log_format = str_field(update, "log_format", where)
    if log_format is not None:
        if log_format not in FORMATS:
            raise InvalidInput(f"log_format must be one of {list(FORMATS)}, got {log_format[:32]!r}")
        changes["format"] = log_format
    return replace(settings, **changes)


async def log_settings(state: ServiceState, update: dict[str, Any] | None = None) -> dict[str, Any]:
    """The logging extension: the current settings, after applying `update` in every process if given."""
    if not update:
        return as_json(current_log_settings())
    new = updated(current_log_settings(), update)
    await apply_everywhere(state.control, COMMAND, as_json(new), sticky=COMMAND)
    return as_json(new)


async def apply_command(args: dict[str, Any]) -> dict[str, Any]:
    """The control handler, in each process: settings as a POST's answer gave them, checked again."""
    apply_log_settings(updated(LogSettings(), args))
    settings = as_json(current_log_settings())
    log.info("log settings now %s", settings)
    return settings


async def get_logging(request: Request) -> dict[str, Any]:
    return await log_settings(service_state(request))


async def post_logging(request: Request) -> dict[str, Any]:
    body = await read_body(request, MAX_BODY_BYTES)
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
            "openapi_extra": {
                "requestBody": {
                    "required": False,
                    "content": {
                        "application/json": {
                            "schema": {
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
                            }
                        }
                    },
                }
            },
        },
    ),
]
