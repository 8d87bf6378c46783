"""grpc.health.v1.Health from the one model state: what Kubernetes' gRPC probes and grpc_health_probe ask.

The service "" (the server) and "inference.GRPCInferenceService" are SERVING when the server is
ready (every model loaded and warm, not draining), as GET /v2/health/ready answers 200; a model's
name is SERVING when that model is READY. Any other name is unknown: NOT_FOUND from Check,
SERVICE_UNKNOWN from Watch, as the health protocol says. Like the HTTP health probes, it needs no
API key.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from app.engine.facade import EngineFacade
from app.grpc.malformed import Malformed
from app.grpc.status import refuse
from app.protocol.admission import CallsInFlight
from app.protocol.errors import TooManyCalls

INFERENCE_SERVICE = "inference.GRPCInferenceService"
HEALTH_SERVICE = "grpc.health.v1.Health"
Status = health_pb2.HealthCheckResponse.ServingStatus
WATCH_INTERVAL_S = 1.0  # how often a Watch call looks at the state again


class Health(health_pb2_grpc.HealthServicer):
    def __init__(self, engine: EngineFacade, probes: CallsInFlight) -> None:
        """`probes`: the budget of calls open without a key, which Check and Watch (for its whole life) take."""
        self._engine = engine
        self._probes = probes

    def status(self, service: str) -> int | None:
        """SERVING or NOT_SERVING for a known service name; None for an unknown one."""
        if service in ("", INFERENCE_SERVICE):
            ready = self._engine.ready
        else:
            served = next((m for m in self._engine.models() if m.name == service), None)
            if served is None:
                return None
            ready = served.status.ready
        return health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse | None:
        if isinstance(request, Malformed):
            refuse(context, request.error)
            return None
        try:
            with self._probes.call():
                return self._check(request, context)
        except TooManyCalls as exc:
            refuse(context, exc)
            return None

    def _check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse | None:
        status = self.status(request.service)
        if status is None:
            context.set_code(grpc.StatusCode.NOT_FOUND)
            context.set_details(
                f"unknown service {request.service[:100]!r}: ask for '' (the server), {INFERENCE_SERVICE!r} "
                "or a model's name"
            )
            return None
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        if isinstance(request, Malformed):
            refuse(context, request.error)
            return
        try:
            with self._probes.call():
                await self._watch(request, context)
        except TooManyCalls as exc:
            refuse(context, exc)

    async def _watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        last = None
        while True:
            status = self.status(request.service)
            current = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN if status is None else status
            if current != last:
                await context.write(health_pb2.HealthCheckResponse(status=current))
                last = current
            await asyncio.sleep(WATCH_INTERVAL_S)
