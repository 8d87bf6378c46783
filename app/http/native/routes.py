"""Native API handlers: POST /v1/models/{name}/transform and GET /v1/models."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response

from app.engine.facade import ModelFacade
from app.http import tensor_route
from app.http.endpoints import Endpoint, StateDep
from app.http.native.schemas import ModelList, MonteCarloResponse, TransformRequest, TransformResponse
from app.http.openapi import error_responses
from app.http.tensor_route import TensorCall
from app.observe import identity
from app.protocol import mc_parameters
from app.protocol import native as codec
from app.protocol.digest import DIGEST_HEADER
from app.protocol.errors import InvalidInput
from app.protocol.state import ServiceState
from ffn_core.dtypes import DTYPE_NAMES


@dataclass(frozen=True)
class _Head:
    headers: Headers
    encoding_in: codec.Encoding
    encoding_out: codec.Encoding
    query: dict[str, str] | None  # Monte Carlo dropout's query parameters, when there is a query


class _Transform:
    """The native transform as app/http/tensor_route.py serves it: headers and query, then the body."""

    reads_timeout_header = True

    def head(self, request: Request, state: ServiceState, served: ModelFacade) -> _Head:
        query = None
        if request.scope["query_string"]:  # only Monte Carlo dropout takes query parameters
            query = codec.query_parameters(request.scope["query_string"])
            if mc_parameters.from_query(query, served, state.settings.max_mc_passes) is None:
                raise InvalidInput(f"a query string asks for Monte Carlo dropout: add {mc_parameters.PASSES}")
        headers = request.headers
        encoding_in = codec.request_encoding(headers.get("content-type"))
        return _Head(headers, encoding_in, codec.response_encoding(headers.get("accept")), query)

    def decode(
        self, body: bytes | bytearray, head: _Head, state: ServiceState, served: ModelFacade, deadline: float | None
    ) -> TensorCall[Any]:
        settings = state.settings
        asked = None if head.query is None else mc_parameters.from_query(head.query, served, settings.max_mc_passes)
        decoded = _decode(body, head.headers, head.encoding_in, head.encoding_out, served, settings.max_queue_rows)
        identity.decoded(decoded.shape, decoded.dtype.name)
        answer_dtype = codec.answer_dtype(decoded, head.encoding_out)
        parsed = decoded.rows.nbytes if head.encoding_in == "json" else None  # binary rows view the body

        def digested(encoded: tuple[bytes | memoryview, dict[str, str]]) -> tuple[bytes | memoryview, dict[str, str]]:
            encoded[1][DIGEST_HEADER] = served.digest
            return encoded

        if asked is not None:
            return TensorCall(
                served.infer_monte_carlo(decoded.rows, asked, answer_dtype, deadline=deadline),
                lambda result: digested(
                    codec.encode_monte_carlo(served.name, result, asked, decoded, head.encoding_out)
                ),
                parsed,
            )
        return TensorCall(
            served.infer(decoded.rows, answer_dtype, deadline=deadline),
            lambda output: digested(codec.encode(served.name, output, decoded, head.encoding_out)),
            parsed,
        )


_TRANSFORM = _Transform()


async def transform(name: str, request: Request) -> Response:
    # Only `request` and the path: FastAPI's per-parameter validation costs more than this whole
    # handler on small requests. The headers are read by hand and documented in _TRANSFORM_DOC.
    return await tensor_route.serve(_TRANSFORM, request, name)


# A plain function, not a coroutine: on the hot path an extra await costs more than its work.
def _decode(
    body: bytes | bytearray,
    headers: Headers,
    encoding_in: codec.Encoding,
    encoding_out: codec.Encoding,
    served: ModelFacade,
    max_rows: int,
) -> codec.DecodedInput:
    """The request's rows, refused here if anything is wrong, and checked answerable in `encoding_out`."""
    if encoding_in == "raw":
        decoded = codec.decode_raw(body, headers.get("x-shape"), headers.get("x-dtype"), served.d_model)
    elif encoding_in == "npy":
        decoded = codec.decode_npy(body, served.d_model)
    else:
        decoded = codec.decode_json(body, served.d_model, max_rows)
    codec.check_answerable(encoding_out, decoded.dtype)
    return decoded


async def list_models(state: StateDep) -> Response:
    # A trailing newline, so that `curl /v1/models` leaves the shell prompt on a line of its own.
    listed = [m.describe() for m in state.engine.listed()]
    models = ModelList.model_validate({"models": listed})
    return Response(models.model_dump_json().encode() + b"\n", media_type="application/json")


_BINARY = {"schema": {"type": "string", "format": "binary"}}
_TRANSFORM_DOC = {
    "summary": "Run the FFN on a batch of embeddings",
    "description": (
        'The body is JSON `{"inputs": [[...]]}`, raw little-endian bytes (`application/octet-stream` '
        "with `X-Shape` and `X-Dtype`), or an `.npy` file (`application/x-npy`). `Accept` picks the "
        "answer's encoding among the same three; the answer keeps the request's shape and dtype."
    ),
    "response_model": None,
    "responses": {
        200: {
            "model": TransformResponse | MonteCarloResponse,
            "description": "The FFN's output, same shape as the input; with mc_passes, the mean and std over "
            "the passes (raw and .npy answers stack them: shape [2, ...], mean first).",
            "content": {"application/octet-stream": _BINARY, "application/x-npy": _BINARY},
            "headers": {
                "X-Shape": {"schema": {"type": "string"}, "description": "Raw answers: the shape, e.g. 7,512."},
                "X-Dtype": {"schema": {"type": "string"}, "description": "Raw answers: the dtype of the request."},
                **{
                    header: {"schema": {"type": "string"}, "description": "Monte Carlo answers: the parameter used."}
                    for header in ("X-MC-Passes", "X-MC-Dropout", "X-MC-Seed")
                },
            },
        },
        **error_responses(400, 401, 404, 406, 413, 415, 429, 503, 504, 507),
    },
    "openapi_extra": {
        "parameters": [
            {
                "name": "X-Shape",
                "in": "header",
                "required": False,
                "schema": {"type": "string"},
                "description": "Raw bodies: the shape, e.g. `7,512` or `2,5,512`.",
            },
            {
                "name": "X-Dtype",
                "in": "header",
                "required": False,
                "schema": {"type": "string", "enum": list(DTYPE_NAMES)},
                "description": "Raw bodies: the dtype, little-endian; `float32` by default.",
            },
            {
                "name": "X-Timeout-Ms",
                "in": "header",
                "required": False,
                "schema": {"type": "number"},
                "description": "Deadline in ms; a request still queued then is answered 504.",
            },
            {
                "name": mc_parameters.PASSES,
                "in": "query",
                "required": False,
                "schema": {"type": "integer", "minimum": 2},
                "description": "Monte Carlo dropout: this many stochastic passes (at most max_mc_passes); "
                "the answer is their mean and standard deviation.",
            },
            {
                "name": mc_parameters.SEED,
                "in": "query",
                "required": False,
                "schema": {"type": "integer", "minimum": 0, "maximum": mc_parameters.MAX_SEED},
                "description": "Monte Carlo dropout: the masks' seed; one is drawn (and answered) when absent.",
            },
            {
                "name": mc_parameters.DROPOUT,
                "in": "query",
                "required": False,
                "schema": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
                "description": "Monte Carlo dropout: the rate, instead of the model's.",
            },
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
    Endpoint(
        "GET",
        "/v1/models",
        list_models,
        openapi={
            "summary": "List the served models",
            "response_model": ModelList,
            "responses": error_responses(401),
            "tags": ["native"],
        },
    ),
]
