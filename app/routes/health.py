"""Health (open even with an API key) and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from app.deps import StateDep
from app.errors import error_response
from app.schemas import error_responses

router = APIRouter(tags=["health"])


@router.get("/v2/health/live", summary="Liveness: the process answers", response_class=Response,
            responses={200: {"content": {}}})
async def live() -> Response:
    return Response(status_code=200)


@router.get(
    "/v2/health/ready",
    summary="Readiness: every model loaded and warm, and not draining",
    response_class=Response,  # 200 has no body; without this the page would promise JSON
    responses={200: {"content": {}}, **error_responses(503)},
)
async def ready(state: StateDep) -> Response:
    if state.ready:
        return Response(status_code=200)
    reason = "draining before shutdown" if state.draining else "models are still loading or warming up"
    return error_response(503, "unavailable", f"not ready: {reason}")


metrics_router = APIRouter(tags=["metrics"])


@metrics_router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}, **error_responses(401)},
)
async def metrics(state: StateDep) -> Response:
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
