"""Triton's logging extension, applied at runtime in every worker (its doors: GET/POST /v2/logging, LogSettings).

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

from app.observe.logs import LogFormat, LogSettings, apply_log_settings, current_log_settings
from app.protocol.broadcast import apply_everywhere
from app.protocol.errors import InvalidInput
from app.protocol.fields import bool_field, int_field, str_field
from app.protocol.state import ServiceState

log = logging.getLogger("ffn_serve")

COMMAND = "log_settings"  # the control command, and its sticky key: the latest settings win
FORMATS: tuple[str, ...] = get_args(LogFormat)
_NAMES = ("log_file", "log_info", "log_warning", "log_error", "log_verbose_level", "log_format")


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
