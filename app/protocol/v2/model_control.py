"""Triton's model repository load and unload, in its shapes (POST /v2/repository/models/{name}/load|unload).

The body is empty or `{"parameters": {...}}`. A load takes `config`: a JSON string with the keys of
a `[[models]]` table (tritonclient's `load_model(name, config=...)`); an unload takes Triton's
`unload_dependents` (there are none here). Anything else is a 400 naming it, `file:` parameters
(tritonclient's `files=`) included: weights are read from the model repository folder only.
The work is the engine's (`Engine.load`, `Engine.unload`) and the parameters are read here
(`load`, `load_config`, `check_unload`), so that both doors (the gRPC twins: app/grpc/service.py)
answer alike; with `model_control = none` both answer 400 naming the setting.

A success is 200 with a JSON body: the model, its version and each worker's reply (Triton's body
is empty; tritonclient reads only the status).
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from typing import Any

from app.engine.facade import EngineFacade
from app.errors import ServiceError
from app.protocol.errors import InvalidInput
from app.protocol.fields import bool_field, loads_json, parameters_field, str_field

_FILES = (
    "file parameters (tritonclient's files=) are not supported: put the weights in the model "
    "repository folder and name them in the config parameter's weights"
)


async def load(engine: EngineFacade, name: str, parameters: Awaitable[Mapping[str, Any]]) -> dict[str, Any]:
    """A load, whichever door: its parameters (`parameters`, the door's reading of them), then Engine.load.

    A load refused for its parameters (or its body) counts as a failed load, as the engine's own refusals do.
    """
    try:
        config = load_config(await parameters)
    except ServiceError:
        engine.count_refused_load(name)
        raise
    return await engine.load(name, config)


def load_config(parameters: Mapping[str, Any]) -> str | None:
    """A load's `config` parameter (both doors); InvalidInput for any other parameter."""
    _only(parameters, {"config"})
    return str_field(parameters, "config", "parameter")


def check_unload(parameters: Mapping[str, Any]) -> None:
    """An unload's parameters (both doors): Triton's `unload_dependents`, a boolean (a model here has none)."""
    _only(parameters, {"unload_dependents"})
    bool_field(parameters, "unload_dependents", "parameter")


def _only(parameters: Mapping[str, Any], allowed: set[str]) -> None:
    for key in parameters:
        if key.startswith("file:"):
            raise InvalidInput(_FILES)
        if key not in allowed:
            raise InvalidInput(f"unknown parameter {key[:64]!r}; this request takes {', '.join(sorted(allowed))}")


def parameters_of_body(body: bytes | bytearray) -> dict[str, Any]:
    """An HTTP body's `parameters` object ({} for an empty body), each a scalar; InvalidInput for anything else.

    Over gRPC a ModelRepositoryParameter can only be a scalar (bool, int64, string, bytes).
    """
    if not body.strip():
        return {}
    document = loads_json(body)
    if not isinstance(document, dict):
        raise InvalidInput('the body must be a JSON object: {"parameters": {...}}')
    unknown = sorted(set(document) - {"parameters"})
    if unknown:
        raise InvalidInput(f"unknown member {unknown[0][:64]!r}: the body holds only parameters")
    return parameters_field(document, "request")
