"""Triton's trace extension (its doors: GET/POST /v2/trace/setting, /v2/models/{name}/trace/setting, TraceSetting).

The settings, and what each means here, are app/tracing/trace_settings.py's. The JSON is
Triton's: every value a string (`"trace_rate": "100"`), `trace_level` a list (`["TIMESTAMPS"]`),
a POST naming only the settings it changes, JSON null putting one back (the server's to its
start-up value, a model's to the server's), and the answer the settings after the change.
`trace_mode` is always "opentelemetry" (the only mode here; a POST may repeat it). `trace_file`
cannot be set: Triton refuses that over the network too, and here spans go over OTLP, not to a
file. Unlike Triton, an unknown setting or level is refused rather than ignored, so that a typo
never passes for a change.

A POST is applied in every serving process through control commands, one per setting, each
sticky under its scope and name: a worker started later replays the latest value of every
setting, and two POSTs that change different settings cannot undo each other. Without an OTLP
endpoint there is nothing to trace with: GET says OFF, POST is refused with how to turn it on.
"""

from __future__ import annotations

import asyncio
from typing import Any

from app.control import Handler, Reply, Unanswered
from app.engine.errors import Unavailable
from app.protocol.errors import InvalidInput
from app.protocol.fields import json_type, list_field, str_field
from app.protocol.state import ServiceState
from app.tracing.trace_settings import FIELDS, LEVELS, MODE, OFF

COMMAND = "trace_setting"  # the control command that applies one setting in a serving process
UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1
_WHERE = "trace setting"


def parse_update(document: object) -> dict[str, Any]:
    """The settings a POST body changes: name -> value, or None to put it back. InvalidInput if any is wrong."""
    if not isinstance(document, dict):
        raise InvalidInput(f"a trace setting request must be a JSON object, got {json_type(document)}")
    unknown = sorted(set(document) - {*FIELDS, "trace_mode", "trace_file"})
    if unknown:
        raise InvalidInput(f"unknown trace setting {unknown[0][:64]!r}; the settings are {', '.join(FIELDS)}")
    if "trace_file" in document:
        raise InvalidInput(
            "trace_file cannot be set: this server sends traces over OTLP (--otlp-endpoint), not to a file"
        )
    mode = str_field(document, "trace_mode", _WHERE)
    if mode is not None and mode != MODE:
        raise InvalidInput(f"trace_mode must be {MODE!r}, the only trace mode of this server, got {mode[:32]!r}")
    update: dict[str, Any] = {}
    if "trace_level" in document:
        update["trace_level"] = _level(list_field(document, "trace_level", _WHERE))
    if "trace_rate" in document:
        update["trace_rate"] = _integer(document, "trace_rate", 0, UINT32_MAX)
    if "trace_count" in document:
        update["trace_count"] = _integer(document, "trace_count", -1, INT32_MAX)
    if "log_frequency" in document:
        update["log_frequency"] = _integer(document, "log_frequency", 0, UINT32_MAX)
    return update


def _level(levels: list[Any] | None) -> list[str] | None:
    if levels is None:
        return None
    if not levels or not all(isinstance(level, str) for level in levels):
        raise InvalidInput(f"trace_level must be a list of strings: [{OFF!r}], or any of {list(LEVELS)}")
    if OFF in levels:
        if len(levels) > 1:
            raise InvalidInput(f"trace_level {OFF!r} must be the only level given")
        return []
    unknown = [level for level in levels if level not in LEVELS]
    if unknown:
        raise InvalidInput(f"unknown trace level {unknown[0][:32]!r}; the levels are {OFF}, {', '.join(LEVELS)}")
    return [level for level in LEVELS if level in levels]  # Triton's order, each once


def _integer(document: dict[str, Any], key: str, minimum: int, maximum: int) -> int | None:
    """A setting sent as a string of ASCII digits (Triton's JSON), within [minimum, maximum]; None for null."""
    text = str_field(document, key, _WHERE)
    if text is None:
        return None
    digits = text.removeprefix("-")
    if digits.isascii() and digits.isdigit() and len(digits) <= 10:  # 10 digits hold any 32-bit value
        value = int(text)
        if minimum <= value <= maximum:
            return value
    raise InvalidInput(f'{key} must be a string holding an integer in [{minimum}, {maximum}], got "{text[:32]}"')


async def settings_of(state: ServiceState, name: str | None) -> dict[str, Any]:
    """The trace settings of the server (`name` None) or of a model: what GET answers (and gRPC's twin)."""
    if name is not None:
        state.engine.model(name)  # 404 for a model this server does not serve
    return state.trace_settings.describe(name)


async def update_settings(state: ServiceState, name: str | None, document: object) -> dict[str, Any]:
    """Apply a POST's settings (`document`, Triton's JSON) in every serving process; the settings after."""
    if name is not None:
        state.engine.model(name)
    update = parse_update(document)
    if update and state.tracing is None:
        raise InvalidInput(
            "tracing is off: start the server with an OTLP endpoint (--otlp-endpoint, FFN_OTLP_ENDPOINT or "
            "OTEL_EXPORTER_OTLP_ENDPOINT) to trace requests"
        )
    problem = state.trace_settings.problem(name, update)
    if problem is not None:
        raise InvalidInput(problem)
    await _broadcast(state, name, update)
    return state.trace_settings.describe(name)


async def _broadcast(state: ServiceState, name: str | None, update: dict[str, Any]) -> None:
    """Apply each changed setting in every serving process; Unavailable (503) if one did not."""
    try:
        answers: list[list[Reply]] = await asyncio.gather(
            *(
                state.control.broadcast(
                    COMMAND, {"model": name, "field": field, "value": value}, sticky=f"{COMMAND}:{name or ''}:{field}"
                )
                for field, value in update.items()
            )
        )
    except Unanswered as exc:
        raise Unavailable(f"the trace setting may not have reached every worker: {exc.message}") from None
    for reply in (reply for replies in answers for reply in replies):
        if not reply.ok:
            raise Unavailable(f"worker {reply.worker} did not apply the trace setting: {reply.error}")


def apply_command(state: ServiceState) -> Handler:
    """The control handler that applies one setting in this process (registered in create_app)."""

    async def apply(args: dict[str, Any]) -> dict[str, Any]:
        state.trace_settings.apply(args["model"], args["field"], args["value"])
        return {}

    return apply
