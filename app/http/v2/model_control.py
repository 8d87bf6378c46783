"""Model control's HTTP routes: POST /v2/repository/models/{name}/load|unload (the rules: app/protocol/v2/model_control.py)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from app.http.endpoints import Endpoint, read_body, service_state
from app.http.openapi import error_responses
from app.protocol.limits import MODEL_CONTROL_BYTES
from app.protocol.v2 import model_control
from app.protocol.v2.model_control import check_unload, parameters_of_body


async def load(name: str, request: Request) -> dict[str, Any]:
    return await model_control.load(service_state(request).engine, name, _parameters(request))


async def _parameters(request: Request) -> dict[str, Any]:
    return parameters_of_body(await read_body(request, MODEL_CONTROL_BYTES))


async def unload(name: str, request: Request) -> dict[str, Any]:
    check_unload(parameters_of_body(await read_body(request, MODEL_CONTROL_BYTES)))
    return await service_state(request).engine.unload(name)


_CONTROL = {"tags": ["v2 extensions"], "responses": error_responses(400, 401, 404, 503)}

ENDPOINTS = [
    Endpoint(
        "POST",
        "/v2/repository/models/{name}/load",
        load,
        openapi={"summary": "Load or reload a model in every worker (model_control = explicit)", **_CONTROL},
    ),
    Endpoint(
        "POST",
        "/v2/repository/models/{name}/unload",
        unload,
        openapi={"summary": "Unload a model in every worker (model_control = explicit)", **_CONTROL},
    ),
]
