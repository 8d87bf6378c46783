"""Open Inference Protocol (KServe V2) routes: server and model metadata, readiness, infer."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from app import v2_codec
from app.codecs import request_encoding
from app.deps import StateDep
from app.errors import ModelNotFound, error_response
from app.http import deadline_from, read_body, unless_disconnected
from app.schemas import error_responses
from app.state import ServiceState
from app.v2_schemas import InferRequest, InferResponse, ModelMetadata, ServerMetadata

router = APIRouter(tags=["v2"])
SERVER_NAME = "ffn-serve"
MODEL_VERSION = "1"
_V2_ERRORS = error_responses(400, 401, 404, 413, 415, 429, 503, 504, 507)


@router.get("/v2", summary="Server metadata", response_model=ServerMetadata, responses=error_responses(401))
async def server_metadata() -> ServerMetadata:
    from app import __version__

    return ServerMetadata(name=SERVER_NAME, version=__version__, extensions=["binary_tensor_data"])


def _check_version(version: str | None) -> None:
    if version is not None and version != MODEL_VERSION:
        raise ModelNotFound(f"model version {version[:32]!r} is not served; the only version is {MODEL_VERSION!r}")


def _model_metadata(name: str, state: ServiceState, version: str | None = None) -> ModelMetadata:
    _check_version(version)
    served = state.registry.get(name)
    datatype = v2_codec.DATATYPE_OF[served.spec.dtype]
    shape = [-1, served.d_model]
    return ModelMetadata(
        name=name, versions=[MODEL_VERSION], platform="pytorch_ffn",
        inputs=[{"name": v2_codec.INPUT_NAME, "datatype": datatype, "shape": shape}],
        outputs=[{"name": v2_codec.OUTPUT_NAME, "datatype": datatype, "shape": shape}],
    )


def _model_ready(name: str, state: ServiceState, version: str | None = None) -> Response:
    _check_version(version)
    served = state.registry.get(name)
    if served.warm and not state.draining:
        return Response(status_code=200)
    return error_response(503, "unavailable", f"model {name!r} is not ready")


_READY = {"summary": "Model readiness", "response_class": Response,  # 200 has no body
          "responses": {200: {"content": {}}, **error_responses(401, 404, 503)}}
_METADATA = {"summary": "Model metadata", "response_model": ModelMetadata, "responses": error_responses(401, 404)}


@router.get("/v2/models/{name}", **_METADATA)
async def model_metadata(name: str, state: StateDep) -> ModelMetadata:
    return _model_metadata(name, state)


@router.get("/v2/models/{name}/versions/{version}", **_METADATA)
async def model_version_metadata(name: str, version: str, state: StateDep) -> ModelMetadata:
    return _model_metadata(name, state, version)


@router.get("/v2/models/{name}/ready", **_READY)
async def model_ready(name: str, state: StateDep) -> Response:
    return _model_ready(name, state)


@router.get("/v2/models/{name}/versions/{version}/ready", **_READY)
async def model_version_ready(name: str, version: str, state: StateDep) -> Response:
    return _model_ready(name, state, version)

def _inline_defs(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with its `$defs` written in place: FastAPI does not copy them into the page's components."""
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {key: resolve(value) for key, value in node.items()}
        if isinstance(node, list):
            return [resolve(value) for value in node]
        return node

    return resolve(schema)


_INFER_BODY = {
    "parameters": [
        {"name": "Inference-Header-Content-Length", "in": "header", "required": False, "schema": {"type": "integer"},
         "description": "Binary extension: length of the JSON header at the body's start."},
    ],
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": _inline_defs(InferRequest.model_json_schema())},
            "application/octet-stream": {
                "schema": {"type": "string", "format": "binary"},
                "description": "Binary tensor data extension: the JSON header (its length in "
                "Inference-Header-Content-Length) followed by the inputs' raw bytes.",
            },
        },
    }
}
_INFER_RESPONSES = {
    200: {
        "model": InferResponse,
        "description": "Outputs; with binary outputs, a JSON header followed by raw bytes.",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    },
    **_V2_ERRORS,
}


async def _infer(name: str, version: str | None, request: Request) -> Response:
    # No FastAPI parameters beyond the path: see the native transform route for why headers are read by hand.
    state: ServiceState = request.app.state.service
    _check_version(version)
    inference_header_content_length = request.headers.get(v2_codec.HEADER_LENGTH)
    served = state.registry.get(name)
    with state.count(name):
        state.check_serving(served)
        if inference_header_content_length is None:
            request_encoding(request.headers.get("content-type"), request.headers.get("content-encoding"))
        else:
            request_encoding(None, request.headers.get("content-encoding"))
        body = await read_body(request, state.settings.max_body_bytes)
        decoded = v2_codec.decode(body, inference_header_content_length, served.d_model)
        timeout_ms = None if decoded.timeout_us is None else _us_to_ms(decoded.timeout_us)
        deadline = deadline_from(timeout_ms, state.settings.default_timeout_ms)
        output = await unless_disconnected(request, served.batcher.submit(decoded.rows, deadline=deadline))
        content, headers = v2_codec.encode(name, decoded, output)
        return Response(content, headers=headers, media_type=headers.pop("content-type"))


def _us_to_ms(timeout_us: object) -> float | str:
    if isinstance(timeout_us, (int, float)) and not isinstance(timeout_us, bool):
        return timeout_us / 1000.0
    return str(timeout_us)  # deadline_from refuses it with a clear message


_INFER = {"summary": "Run the FFN (Open Inference Protocol)", "response_model": None,
          "responses": _INFER_RESPONSES, "openapi_extra": _INFER_BODY}


@router.post("/v2/models/{name}/infer", **_INFER)
async def infer(name: str, request: Request) -> Response:
    return await _infer(name, None, request)


@router.post("/v2/models/{name}/versions/{version}/infer", **_INFER)
async def infer_version(name: str, version: str, request: Request) -> Response:
    return await _infer(name, version, request)
