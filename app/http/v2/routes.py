"""Open Inference Protocol (KServe V2) handlers: server and model metadata, readiness, infer."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import numpy as np
import orjson
from starlette.requests import Request
from starlette.responses import Response

from app.engine.errors import Unavailable
from app.engine.facade import ModelFacade
from app.engine.montecarlo import MonteCarloResult
from app.http import tensor_route
from app.http.endpoints import Endpoint, StateDep
from app.http.errors import error_response
from app.http.openapi import error_responses, inline_defs
from app.http.tensor_route import TensorCall
from app.http.v2 import extensions, model_control
from app.protocol.state import ServiceState
from app.protocol.v2 import codec, metadata
from app.protocol.v2 import infer as infer_step
from app.protocol.v2.schemas import InferRequest, InferResponse, ModelMetadata, ModelReady, ServerMetadata


async def server_metadata(state: StateDep) -> ServerMetadata:
    return metadata.server_metadata(state)


def _model_ready(state: ServiceState, name: str, version: str | None) -> Response:
    status = state.engine.model(name, version).status
    if status.ready:  # KServe's body: its SDK may read it (tritonclient reads the status alone)
        return Response(orjson.dumps({"name": name, "ready": True}), media_type="application/json")
    return error_response(Unavailable(f"model {name!r} is not ready: {status.reason}"))


class _Infer:
    """V2 infer as app/http/tensor_route.py serves it: the content type, then the body (app/protocol/v2/infer.py)."""

    reads_timeout_header = False  # the deadline is the body's `timeout` parameter

    def head(self, request: Request, state: ServiceState, served: ModelFacade) -> str | None:
        header_length = request.headers.get(codec.HEADER_LENGTH)
        # With the binary extension the body is not JSON, whatever Content-Type the client sent.
        codec.check_content(request.headers.get("content-type") if header_length is None else None)
        return header_length

    def decode(
        self,
        body: bytes | bytearray,
        header_length: str | None,
        state: ServiceState,
        served: ModelFacade,
        deadline: float | None,
    ) -> TensorCall[Any]:
        call = infer_step.decoded(state, served, body, header_length)
        rows, dtype = call.request.rows, call.request.dtype
        work: Awaitable[np.ndarray | MonteCarloResult]
        if call.monte_carlo is None:
            work = served.infer(rows, dtype, deadline=call.deadline)
        else:  # the answer is the mean over the passes, `output_std` their spread; the parameters used are echoed
            work = served.infer_monte_carlo(rows, call.monte_carlo, dtype, deadline=call.deadline)
        # JSON data or shared memory: the body is dropped, its tensor kept; a binary input views the body.
        parsed = None if call.request.binary_input else rows.nbytes
        return TensorCall(work, lambda answer: infer_step.encoded(served.name, served, call, answer), parsed)


_INFER_ROUTE = _Infer()


# The route handlers: FastAPI reads their signatures, so each route gets its own, with exactly
# its path's parameters. The tensor routes take only the path and `request`: FastAPI's
# per-parameter validation would cost more than the rest of a small request.


async def model_metadata(name: str, state: StateDep) -> ModelMetadata:
    return metadata.model_metadata(state, name, None)


async def model_version_metadata(name: str, version: str, state: StateDep) -> ModelMetadata:
    return metadata.model_metadata(state, name, version)


async def model_ready(name: str, state: StateDep) -> Response:
    return _model_ready(state, name, None)


async def model_version_ready(name: str, version: str, state: StateDep) -> Response:
    return _model_ready(state, name, version)


async def infer(name: str, request: Request) -> Response:
    return await tensor_route.serve(_INFER_ROUTE, request, name)


async def infer_version(name: str, version: str, request: Request) -> Response:
    return await tensor_route.serve(_INFER_ROUTE, request, name, version)


_V2_ERRORS = error_responses(400, 401, 404, 413, 415, 429, 503, 504, 507)
_METADATA = {
    "summary": "Model metadata",
    "response_model": ModelMetadata,
    "responses": error_responses(401, 404),
    "tags": ["v2"],
}
_READY = {
    "summary": "Model readiness (a probe: needs no API key)",
    "response_model": ModelReady,
    "responses": error_responses(404, 503),
    "tags": ["v2"],
}
_INFER: dict[str, Any] = {
    "summary": "Run the FFN (Open Inference Protocol)",
    "response_model": None,
    "responses": {
        200: {
            "model": InferResponse,
            "description": "Outputs; with binary outputs, a JSON header followed by raw bytes.",
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        },
        **_V2_ERRORS,
    },
    "openapi_extra": {
        "parameters": [
            {
                "name": "Inference-Header-Content-Length",
                "in": "header",
                "required": False,
                "schema": {"type": "integer"},
                "description": "Binary extension: length of the JSON header at the body's start.",
            },
        ],
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": inline_defs(InferRequest.model_json_schema())},
                "application/octet-stream": {
                    "schema": {"type": "string", "format": "binary"},
                    "description": "Binary tensor data extension: the JSON header (its length in "
                    "Inference-Header-Content-Length) followed by the inputs' raw bytes.",
                },
            },
        },
    },
    "tags": ["v2"],
}

ENDPOINTS = [
    # The extensions first: /v2/models/stats must match before /v2/models/{name} does.
    *extensions.ENDPOINTS,
    *model_control.ENDPOINTS,
    Endpoint(
        "GET",
        "/v2",
        server_metadata,
        openapi={
            "summary": "Server metadata",
            "response_model": ServerMetadata,
            "responses": error_responses(401),
            "tags": ["v2"],
        },
    ),
    # KServe's V2 REST spec writes this path as `/v2/`: answered as such, never by a redirect.
    Endpoint("GET", "/v2/", server_metadata, openapi={"response_model": ServerMetadata, "include_in_schema": False}),
    Endpoint("GET", "/v2/models/{name}", model_metadata, openapi=_METADATA),
    Endpoint("GET", "/v2/models/{name}/versions/{version}", model_version_metadata, openapi=_METADATA),
    Endpoint("GET", "/v2/models/{name}/ready", model_ready, openapi=_READY),
    Endpoint("GET", "/v2/models/{name}/versions/{version}/ready", model_version_ready, openapi=_READY),
    Endpoint("POST", "/v2/models/{name}/infer", infer, fast=True, openapi=_INFER),
    Endpoint("POST", "/v2/models/{name}/versions/{version}/infer", infer_version, fast=True, openapi=_INFER),
]
