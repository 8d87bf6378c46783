"""Native API handlers: POST /v1/models/{name}/transform and GET /v1/models."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from app.web.endpoints import Endpoint
from app.web.http import TIMEOUT_HEADER, deadline_from, read_body, unless_disconnected
from app.web.native import codec
from app.web.native.schemas import ModelList, TransformRequest, TransformResponse
from app.web.openapi import error_responses
from app.web.state import StateDep, service_state
from ffn_core.dtypes import DTYPE_NAMES


async def transform(name: str, request: Request) -> Response:
    # Only `request` and the path: FastAPI's per-parameter validation costs more than this whole
    # handler on small requests. The headers are read by hand and documented in _TRANSFORM_DOC.
    state = service_state(request)
    served = state.engine.registry.get(name)
    with state.count(name):
        state.engine.check_serving(served)
        headers = request.headers
        encoding_in = codec.request_encoding(headers.get("content-type"), headers.get("content-encoding"))
        encoding_out = codec.response_encoding(headers.get("accept"))
        deadline = deadline_from(headers.get(TIMEOUT_HEADER), state.settings.default_timeout_ms)
        body = await read_body(request, state.settings.max_body_bytes, state.settings.read_timeout_s)
        if encoding_in == "raw":
            decoded = codec.decode_raw(body, headers.get("x-shape"), headers.get("x-dtype"), served.d_model)
        elif encoding_in == "npy":
            decoded = codec.decode_npy(body, served.d_model)
        else:
            decoded = codec.decode_json(body, served.d_model, state.settings.max_queue_rows)
        codec.check_answerable(encoding_out, decoded.dtype)
        output = await unless_disconnected(request, served.batcher.submit(decoded.rows, deadline=deadline))
        content, answer_headers = codec.encode(name, output, decoded, encoding_out)
        return Response(content, headers=answer_headers)


async def list_models(state: StateDep) -> ModelList:
    return ModelList.model_validate({"models": [m.describe() for m in state.engine.registry.models.values()]})


_BINARY = {"schema": {"type": "string", "format": "binary"}}
_TRANSFORM_DOC = {
    "summary": "Run the FFN on a batch of embeddings",
    "description": (
        "The body is JSON `{\"inputs\": [[...]]}`, raw little-endian bytes (`application/octet-stream` "
        "with `X-Shape` and `X-Dtype`), or an `.npy` file (`application/x-npy`). `Accept` picks the "
        "answer's encoding among the same three; the answer keeps the request's shape and dtype."
    ),
    "response_model": None,
    "responses": {
        200: {
            "model": TransformResponse,
            "description": "The FFN's output, same shape as the input.",
            "content": {"application/octet-stream": _BINARY, "application/x-npy": _BINARY},
            "headers": {
                "X-Shape": {"schema": {"type": "string"}, "description": "Raw answers: the shape, e.g. 7,512."},
                "X-Dtype": {"schema": {"type": "string"}, "description": "Raw answers: the dtype of the request."},
            },
        },
        **error_responses(400, 401, 404, 406, 413, 415, 429, 503, 504, 507),
    },
    "openapi_extra": {
        "parameters": [
            {"name": "X-Shape", "in": "header", "required": False, "schema": {"type": "string"},
             "description": "Raw bodies: the shape, e.g. `7,512` or `2,5,512`."},
            {"name": "X-Dtype", "in": "header", "required": False,
             "schema": {"type": "string", "enum": list(DTYPE_NAMES)},
             "description": "Raw bodies: the dtype, little-endian; `float32` by default."},
            {"name": "X-Timeout-Ms", "in": "header", "required": False, "schema": {"type": "number"},
             "description": "Deadline in ms; a request still queued then is answered 504."},
        ],
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": TransformRequest.model_json_schema(ref_template="#/components/schemas/{model}")
                },
                "application/octet-stream": _BINARY,
                "application/x-npy": _BINARY,
            },
        },
    },
    "tags": ["native"],
}

ENDPOINTS = [
    Endpoint("POST", "/v1/models/{name}/transform", transform, fast=True, openapi=_TRANSFORM_DOC),
    Endpoint("GET", "/v1/models", list_models, openapi={
        "summary": "List the served models", "response_model": ModelList, "responses": error_responses(401),
        "tags": ["native"],
    }),
]
