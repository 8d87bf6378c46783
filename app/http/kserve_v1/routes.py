"""KServe V1 handlers: predict (instances -> predictions) and model readiness (the semantics: app/protocol/kserve_v1.py)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from app.engine.facade import ModelFacade
from app.http import tensor_route
from app.http.endpoints import Endpoint, service_state
from app.http.openapi import error_responses, json_body
from app.http.tensor_route import TensorCall
from app.observe import identity
from app.protocol import kserve_v1
from app.protocol.state import ServiceState

READY_PATH = "/v1/models/{name}"  # probes: the guard lets them through without a key
LIVE_PATH = "/"
_ALIVE = b'{"status":"alive"}'


class _Predict:
    """KServe V1 predict as app/http/tensor_route.py serves it: the content type, then the instances."""

    reads_timeout_header = True

    def head(self, request: Request, state: ServiceState, served: ModelFacade) -> None:
        kserve_v1.check_content(request.headers.get("content-type"))

    def decode(
        self, body: bytes | bytearray, head: None, state: ServiceState, served: ModelFacade, deadline: float | None
    ) -> TensorCall[Any]:
        decoded = kserve_v1.decode(body, served.d_model, state.settings.max_queue_rows)
        identity.decoded(decoded.shape, decoded.dtype.name)
        return TensorCall(
            served.infer(decoded.rows, decoded.dtype, deadline=deadline),
            lambda output: (kserve_v1.encode(output, decoded), {"content-type": kserve_v1.MEDIA_TYPE}),
            decoded.rows.nbytes,  # the body is gone, parsed into an array of its own
        )


_PREDICT = _Predict()


async def predict(name: str, request: Request) -> Response:
    # Only `request` and the path, as the other tensor routes (app/http/native/routes.py says why).
    return await tensor_route.serve(_PREDICT, request, name)


async def server_live() -> Response:
    """KServe's model server answers its root so: the V1 liveness its SDK reads (`is_server_live`)."""
    return Response(_ALIVE, media_type=kserve_v1.MEDIA_TYPE)


async def model_ready(name: str, request: Request) -> Response:
    return Response(kserve_v1.model_ready(service_state(request).engine, name), media_type=kserve_v1.MEDIA_TYPE)


_INSTANCES: dict[str, Any] = {
    "oneOf": [
        {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
        {"type": "array", "items": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}},
    ],
    "description": "One instance per element: a list of d_model numbers, or [seq, d_model].",
}
_PREDICT_DOC: dict[str, Any] = {
    "summary": "Run the FFN (KServe V1: instances in, predictions out)",
    "response_model": None,
    "responses": {
        200: {
            "description": "One prediction per instance, each of its instance's shape.",
            "content": {
                "application/json": {
                    "schema": {
                        "type": "object",
                        "required": ["predictions"],
                        "properties": {"predictions": {**_INSTANCES, "description": "One per instance."}},
                    }
                }
            },
        },
        **error_responses(400, 401, 404, 413, 415, 429, 503, 504, 507),
    },
    "openapi_extra": json_body(
        {
            "type": "object",
            "properties": {
                "instances": _INSTANCES,
                "inputs": {**_INSTANCES, "description": "As instances."},
            },
            "additionalProperties": False,
            "minProperties": 1,
            "maxProperties": 1,
        }
    ),
    "tags": ["kserve v1"],
}

ENDPOINTS = [
    Endpoint("POST", "/v1/models/{name}:predict", predict, fast=True, openapi=_PREDICT_DOC),
    Endpoint(
        "GET",
        LIVE_PATH,
        server_live,
        openapi={
            "summary": "Liveness, KServe V1: the process answers (a probe: needs no API key)",
            "response_class": Response,
            "responses": {
                200: {
                    "description": "Alive.",
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "required": ["status"],
                                "properties": {"status": {"type": "string", "enum": ["alive"]}},
                            }
                        }
                    },
                }
            },
            "tags": ["kserve v1"],
        },
    ),
    Endpoint(
        "GET",
        READY_PATH,
        model_ready,
        openapi={
            "summary": "Model readiness, KServe V1 (a probe: needs no API key)",
            "response_class": Response,
            "responses": {
                200: {
                    "description": "The model is ready.",
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "required": ["name", "ready"],
                                "properties": {"name": {"type": "string"}, "ready": {"type": "boolean"}},
                            }
                        }
                    },
                },
                **error_responses(404, 503),
            },
            "tags": ["kserve v1"],
        },
    ),
]
