"""Native API: POST /v1/models/{name}/transform in JSON, raw binary or .npy; GET /v1/models."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from app import codecs
from app.deps import StateDep
from app.errors import NotAcceptable
from app.state import ServiceState
from app.http import TIMEOUT_HEADER, deadline_from, read_body, unless_disconnected
from app.schemas import ModelList, TransformRequest, TransformResponse, error_responses

router = APIRouter(tags=["native"])

_BINARY = {"schema": {"type": "string", "format": "binary"}}
_TRANSFORM_BODY = {
    "parameters": [
        {"name": "X-Shape", "in": "header", "required": False, "schema": {"type": "string"},
         "description": "Raw bodies: the shape, e.g. `7,512` or `2,5,512`."},
        {"name": "X-Dtype", "in": "header", "required": False,
         "schema": {"type": "string", "enum": ["float32", "float16", "bfloat16"]},
         "description": "Raw bodies: `float32` (default), `float16` or `bfloat16`, little-endian."},
        {"name": "X-Timeout-Ms", "in": "header", "required": False, "schema": {"type": "number"},
         "description": "Deadline in ms; a request still queued then is answered 504."},
    ],
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": TransformRequest.model_json_schema(ref_template="#/components/schemas/{model}")},
            "application/octet-stream": _BINARY,
            "application/x-npy": _BINARY,
        },
    }
}


@router.post(
    "/v1/models/{name}/transform",
    summary="Run the FFN on a batch of embeddings",
    description=(
        "The body is JSON `{\"inputs\": [[...]]}`, raw little-endian bytes (`application/octet-stream` "
        "with `X-Shape` and `X-Dtype`), or an `.npy` file (`application/x-npy`). `Accept` picks the "
        "answer's encoding among the same three; the answer keeps the request's shape and dtype."
    ),
    response_model=None,
    responses={
        200: {
            "model": TransformResponse,
            "description": "The FFN's output, same shape as the input.",
            "content": {"application/octet-stream": _BINARY, "application/x-npy": _BINARY},
            "headers": {
                "X-Shape": {"schema": {"type": "string"}, "description": "Raw answers: the shape, e.g. 7,512."},
                "X-Dtype": {"schema": {"type": "string"}, "description": "Raw answers: float32, float16 or bfloat16."},
            },
        },
        **error_responses(400, 401, 404, 406, 413, 415, 429, 503, 504, 507),
    },
    openapi_extra=_TRANSFORM_BODY,
)
async def transform(name: str, request: Request) -> Response:
    # Only `request` as a parameter: FastAPI's per-parameter validation costs more than this whole
    # handler on small requests. The headers are read by hand and documented in the OpenAPI parameters above.
    state: ServiceState = request.app.state.service
    served = state.registry.get(name)
    with state.count(name):
        state.check_serving(served)
        headers = request.headers
        encoding_in = codecs.request_encoding(headers.get("content-type"), headers.get("content-encoding"))
        encoding_out = codecs.response_encoding(headers.get("accept"))
        deadline = deadline_from(headers.get(TIMEOUT_HEADER), state.settings.default_timeout_ms)
        body = await read_body(request, state.settings.max_body_bytes)
        if encoding_in == "raw":
            decoded = codecs.decode_raw(body, headers.get("x-shape"), headers.get("x-dtype"), served.d_model)
        elif encoding_in == "npy":
            decoded = codecs.decode_npy(body, served.d_model)
        else:
            decoded = codecs.decode_json(body, served.d_model)
        if encoding_out == "npy" and decoded.dtype == "bfloat16":
            raise NotAcceptable("numpy has no bfloat16: Accept application/octet-stream for a bfloat16 answer")
        output = await unless_disconnected(request, served.batcher.submit(decoded.rows, deadline=deadline))
        return _answer(name, output, decoded, encoding_out)


def _answer(name: str, output, decoded: codecs.DecodedInput, encoding: codecs.Encoding) -> Response:
    if encoding == "json":
        return Response(codecs.encode_json(name, output, decoded.shape), media_type="application/json")
    if encoding == "npy":
        return Response(codecs.encode_npy(output, decoded.shape, decoded.dtype), media_type="application/x-npy")
    wire = codecs.to_wire_dtype(output, decoded.dtype)
    return Response(
        codecs.raw_bytes(wire),
        media_type="application/octet-stream",
        headers={"X-Shape": ",".join(map(str, decoded.shape)), "X-Dtype": decoded.dtype},
    )


@router.get("/v1/models", summary="List the served models", response_model=ModelList,
            responses=error_responses(401))
async def list_models(state: StateDep) -> ModelList:
    return ModelList.model_validate({"models": [m.describe() for m in state.registry.models.values()]})
