"""Open Inference Protocol (KServe V2) handlers: server and model metadata, readiness, infer."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from app.engine.errors import Unavailable
from app.http.endpoints import Endpoint, StateDep, compressed, read_body, service_state, unless_disconnected
from app.http.errors import error_response
from app.http.openapi import error_responses, inline_defs
from app.http.v2 import extensions, model_control
from app.protocol import identity, mc_parameters
from app.protocol.admission import deadline_from
from app.protocol.digest import ANSWER_PARAMETER, DIGEST_HEADER
from app.protocol.fields import answer_coding, request_coding
from app.protocol.state import ServiceState
from app.protocol.v2 import codec, metadata
from app.protocol.v2.schemas import InferRequest, InferResponse, ModelMetadata, ModelReady, ServerMetadata


async def server_metadata(state: StateDep) -> ServerMetadata:
    return metadata.server_metadata(state)


def _model_ready(state: ServiceState, name: str, version: str | None) -> Response:
    status = state.engine.model(name, version).status
    if status.ready:  # KServe's body: its SDK may read it (tritonclient reads the status alone)
        return Response(orjson.dumps({"name": name, "ready": True}), media_type="application/json")
    return error_response(Unavailable(f"model {name!r} is not ready: {status.reason}"))


async def _infer(request: Request, name: str, version: str | None) -> Response:
    state: ServiceState = service_state(request)
    served = state.engine.model(name, version)
    with state.outcomes.count(name):
        served.check_serving()
        header_length = request.headers.get(codec.HEADER_LENGTH)
        # With the binary extension the body is not JSON, whatever Content-Type the client sent.
        content_type = request.headers.get("content-type") if header_length is None else None
        codec.check_content(content_type)
        coding_in = request_coding(request.headers.get("content-encoding"))
        coding_out = answer_coding(request.headers.get("accept-encoding"))
        with state.held.request() as hold:
            body = await read_body(request, state.settings.max_body_bytes, hold, coding_in)
            # Looked up again: a reload may have swapped the copy while the body arrived. From here to
            # the batcher nothing awaits, so the copy the rows are checked against is the one they reach.
            served = state.engine.model(name, version)
            decoded = codec.decode(
                body,
                header_length,
                served.d_model,
                state.settings.max_queue_rows,
                state.shared_memory,
                state.settings.max_body_bytes,
            )
            if not decoded.binary_input:  # JSON data or shared memory: the body is dropped, its tensor kept
                hold.resize(decoded.rows.nbytes)
            del body  # a binary input is a view of the body: those bytes stay held, and counted
            identity.decoded(decoded.shape, decoded.dtype.name)
            timeout_ms = None if decoded.timeout_us is None else decoded.timeout_us / 1000.0
            deadline = deadline_from(timeout_ms, state.settings.default_timeout_ms)
            # Most requests carry no parameters: then none asks for Monte Carlo dropout.
            asked = (
                mc_parameters.from_json(decoded.parameters, served, state.settings.max_mc_passes)
                if decoded.parameters
                else None
            )
            if asked is None:
                output = await unless_disconnected(
                    request, served.infer(decoded.rows, decoded.dtype, deadline=deadline)
                )
                content, headers = codec.encode(
                    name, served.version, decoded, {codec.OUTPUT_NAME: output}, {ANSWER_PARAMETER: served.digest}
                )
            else:
                # `output` is the mean over the passes, `output_std` their spread; the parameters used are echoed.
                result = await unless_disconnected(
                    request, served.infer_monte_carlo(decoded.rows, asked, decoded.dtype, deadline=deadline)
                )
                tensors = {codec.OUTPUT_NAME: result.mean, codec.STD_OUTPUT_NAME: result.std}
                parameters = {**mc_parameters.echoed(asked), ANSWER_PARAMETER: served.digest}
                content, headers = codec.encode(name, served.version, decoded, tensors, parameters)
            headers[DIGEST_HEADER] = served.digest
            content, headers = await compressed(content, headers, coding_out)
        return Response(content, headers=headers)


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
    return await _infer(request, name, None)


async def infer_version(name: str, version: str, request: Request) -> Response:
    return await _infer(request, name, version)


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
