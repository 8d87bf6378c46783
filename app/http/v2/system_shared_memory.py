"""The system shared-memory extension's HTTP routes, and CUDA shared memory's (the extension: app/protocol/v2/system_shared_memory.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from app.http.endpoints import Endpoint, StateDep, read_body, service_state
from app.http.openapi import error_responses, json_body
from app.protocol.fields import loads_json
from app.protocol.limits import SHARED_MEMORY_BYTES
from app.protocol.v2.system_shared_memory import (
    cuda_register,
    cuda_status,
    cuda_unregister,
    regions_of,
    register_document,
    status,
    unregister,
)


async def all_status(state: StateDep) -> list[dict[str, Any]]:
    return status(state)


async def region_status(region: str, state: StateDep) -> list[dict[str, Any]]:
    return status(state, region)


async def register_region(region: str, request: Request) -> Response:
    state = service_state(request)
    regions_of(state)  # off: the same 400 whatever the body
    body = await read_body(request, SHARED_MEMORY_BYTES)
    await register_document(state, region, loads_json(body))
    return Response(status_code=200)


async def unregister_region(region: str, state: StateDep) -> Response:
    await unregister(state, region)
    return Response(status_code=200)


async def unregister_all(state: StateDep) -> Response:
    await unregister(state)
    return Response(status_code=200)


async def cuda_all_status(state: StateDep) -> list[dict[str, Any]]:
    return cuda_status(state)


async def cuda_region_status(region: str, state: StateDep) -> list[dict[str, Any]]:
    return cuda_status(state, region)


async def cuda_register_region(region: str, state: StateDep) -> Response:
    await cuda_register(state)
    return Response(status_code=200)  # not reached: registering is refused


async def cuda_unregister_region(region: str) -> Response:
    cuda_unregister(region)
    return Response(status_code=200)


async def cuda_unregister_all() -> Response:
    cuda_unregister()
    return Response(status_code=200)


_TAGS = {"tags": ["v2 extensions"]}
_STATUS = {
    "summary": "System shared-memory regions (system shared memory extension)",
    "responses": error_responses(400, 401),
    **_TAGS,
}
_CHANGE = {"response_class": Response, "responses": {200: {"content": {}}, **error_responses(400, 401, 503)}, **_TAGS}
# Triton's clients call these (perf_analyzer's clean-up unregisters all CUDA regions), but they are no
# extension of this server's (GET /v2 does not list it): kept out of the OpenAPI page.
_CUDA_ROUTES: list[tuple[str, str, Callable[..., Awaitable[Any]]]] = [
    ("GET", "/v2/cudasharedmemory/status", cuda_all_status),
    ("GET", "/v2/cudasharedmemory/region/{region}/status", cuda_region_status),
    ("POST", "/v2/cudasharedmemory/region/{region}/register", cuda_register_region),
    ("POST", "/v2/cudasharedmemory/unregister", cuda_unregister_all),
    ("POST", "/v2/cudasharedmemory/region/{region}/unregister", cuda_unregister_region),
]

ENDPOINTS = [
    Endpoint("GET", "/v2/systemsharedmemory/status", all_status, openapi=_STATUS),
    Endpoint(
        "GET",
        "/v2/systemsharedmemory/region/{region}/status",
        region_status,
        openapi={**_STATUS, "responses": error_responses(400, 401, 404)},
    ),
    Endpoint(
        "POST",
        "/v2/systemsharedmemory/region/{region}/register",
        register_region,
        openapi={
            **_CHANGE,
            "summary": "Register a system shared-memory region in every worker",
            "responses": {200: {"content": {}}, **error_responses(400, 401, 413, 503)},
            "openapi_extra": json_body(
                {
                    "type": "object",
                    "required": ["key", "byte_size"],
                    "properties": {
                        "key": {
                            "type": "string",
                            "description": "The object's shm_open name, /dev/shm/<key>.",
                        },
                        "offset": {"type": "integer", "minimum": 0, "default": 0},
                        "byte_size": {"type": "integer", "minimum": 1},
                    },
                    "additionalProperties": False,
                }
            ),
        },
    ),
    Endpoint(
        "POST",
        "/v2/systemsharedmemory/region/{region}/unregister",
        unregister_region,
        openapi={**_CHANGE, "summary": "Unregister a system shared-memory region in every worker"},
    ),
    Endpoint(
        "POST",
        "/v2/systemsharedmemory/unregister",
        unregister_all,
        openapi={**_CHANGE, "summary": "Unregister every system shared-memory region"},
    ),
    *(Endpoint(method, path, handler, openapi={"include_in_schema": False}) for method, path, handler in _CUDA_ROUTES),
]
