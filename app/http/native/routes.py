"""Native API handlers: POST /v1/models/{name}/transform and GET /v1/models."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response

from app.engine.facade import ModelFacade
from app.http.endpoints import (
    TIMEOUT_HEADER,
    Endpoint,
    StateDep,
    compressed,
    read_body,
    service_state,
    unless_disconnected,
)
from app.http.native.schemas import ModelList, MonteCarloResponse, TransformRequest, TransformResponse
from app.http.openapi import error_responses
from app.protocol import identity, mc_parameters
from app.protocol import native as codec
from app.protocol.admission import deadline_from
from app.protocol.digest import DIGEST_HEADER
from app.protocol.errors import InvalidInput
from app.protocol.fields import answer_coding, request_coding
from ffn_core.dtypes import DTYPE_NAMES


async def transform(name: str, request: Request) -> Response:
    # Only `request` and the path: FastAPI's per-parameter validation costs more than this whole
    # handler on small requests. The headers are read by hand and documented in _TRANSFORM_DOC.
    state = service_state(request)
    served = state.engine.model(name)
    with state.outcomes.count(name):
        served.check_serving()
        asked = parameters = None
        if request.scope["query_string"]:  # only Monte Carlo dropout takes query parameters
            parameters = codec.query_parameters(request.scope["query_string"])
            asked = mc_parameters.from_query(parameters, served, state.settings.max_mc_passes)
            if asked is None:
                raise InvalidInput(f"a query string asks for Monte Carlo dropout: add {mc_parameters.PASSES}")
        headers = request.headers
        encoding_in = codec.request_encoding(headers.get("content-type"))
        encoding_out = codec.response_encoding(headers.get("accept"))
        coding_in = request_coding(headers.get("content-encoding"))
        coding_out = answer_coding(headers.get("accept-encoding"))
        deadline = deadline_from(headers.get(TIMEOUT_HEADER), state.settings.default_timeout_ms)
        with state.held.request() as hold:
            body = await read_body(request, state.settings.max_body_bytes, hold, coding_in)
            # Looked up again: a reload may have swapped the copy while the body arrived. From here to
            # the batcher nothing awaits, so the copy the rows are checked against is the one they reach.
            served = state.engine.model(name)
            if parameters is not None:
                asked = mc_parameters.from_query(parameters, served, state.settings.max_mc_passes)
            decoded = _decode(
                body,
                headers,
                encoding_in,
                encoding_out,
                served,
                state.settings.max_queue_rows,
            )
            del body  # binary rows are a view of it: those bytes stay held, and counted
            identity.decoded(decoded.shape, decoded.dtype.name)
            if encoding_in == "json":  # the body is gone, parsed into an array of its own
                hold.resize(decoded.rows.nbytes)
            answer_dtype = codec.answer_dtype(decoded, encoding_out)
            if asked is not None:
                result = await unless_disconnected(
                    request, served.infer_monte_carlo(decoded.rows, asked, answer_dtype, deadline=deadline)
                )
                content, answer_headers = codec.encode_monte_carlo(name, result, asked, decoded, encoding_out)
            else:
                output = await unless_disconnected(request, served.infer(decoded.rows, answer_dtype, deadline=deadline))
                content, answer_headers = codec.encode(name, output, decoded, encoding_out)
            answer_headers[DIGEST_HEADER] = served.digest
            content, answer_headers = await compressed(content, answer_headers, coding_out)
        return Response(content, headers=answer_headers)


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
