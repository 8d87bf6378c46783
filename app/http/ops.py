"""Operational endpoints: health probes (open even with an API key) and Prometheus metrics.

The probes answer KServe's bodies, `{"live": true}` and `{"ready": true}`: the V2 protocol allows
an empty body, but KServe's REST client reads these (tritonclient reads the status alone).
"""

from __future__ import annotations

from starlette.responses import Response

from app.engine.errors import Unavailable
from app.http.endpoints import Endpoint, StateDep
from app.http.errors import error_response
from app.http.openapi import error_responses
from app.protocol.v2.schemas import ServerLive, ServerReady

HEALTH_PREFIX = "/v2/health/"  # the guard lets these through without a key: probes carry none
METRICS_PATH = "/metrics"  # the one path of the metrics port, where it needs no key


_LIVE = b'{"live":true}'
_READY = b'{"ready":true}'


async def live() -> Response:
    return Response(_LIVE, media_type="application/json")


async def ready(state: StateDep) -> Response:
    readiness = state.engine.readiness()
    if readiness.ready:
        return Response(_READY, media_type="application/json")
    return error_response(Unavailable(f"not ready: {readiness.reason}"))


async def metrics(state: StateDep) -> Response:
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


ENDPOINTS = [
    Endpoint(
        "GET",
        HEALTH_PREFIX + "live",
        live,
        openapi={
            "summary": "Liveness: the process answers",
            "response_model": ServerLive,
            "tags": ["health"],
        },
    ),
    Endpoint(
        "GET",
        HEALTH_PREFIX + "ready",
        ready,
        openapi={
            "summary": "Readiness: every model loaded and warm, and not draining",
            "response_model": ServerReady,
            "responses": error_responses(503),
            "tags": ["health"],
        },
    ),
    Endpoint(
        "GET",
        METRICS_PATH,
        metrics,
        openapi={
            "summary": "Prometheus metrics",
            "response_class": Response,
            "responses": {200: {"content": {"text/plain": {"schema": {"type": "string"}}}}, **error_responses(401)},
            "tags": ["metrics"],
        },
    ),
]
