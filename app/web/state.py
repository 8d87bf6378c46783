"""ServiceState: what the routes share, built in create_app and read from `request.app.state.service`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request

from app.control import Control
from app.engine.service import Engine
from app.metrics import Metrics
from app.settings import Settings
from app.tracing.trace_settings import TraceSettings
from app.web.errors import error_type_of

if TYPE_CHECKING:  # the OpenTelemetry SDK is imported only when tracing is on
    from app.tracing.spans import Tracing


@dataclass
class ServiceState:
    settings: Settings
    engine: Engine
    metrics: Metrics
    control: Control  # commands every serving process applies (app/control.py)
    trace_settings: TraceSettings  # Triton's trace settings, this process's copy (app/tracing/trace_settings.py)
    tracing: Tracing | None = None  # None: requests are not traced

    @contextmanager
    def count(self, model: str, protocol: str = "http") -> Iterator[None]:
        """Count one request's outcome in ffn_requests_total{model, outcome, protocol}: ok or its error_type."""
        try:
            yield
        except Exception as exc:
            self.metrics.requests.labels(model=model, outcome=error_type_of(exc), protocol=protocol).inc()
            raise
        self.metrics.requests.labels(model=model, outcome="ok", protocol=protocol).inc()


def service_state(request: Request) -> ServiceState:
    """The app's ServiceState (a plain function: the tensor routes skip FastAPI's dependencies)."""
    state: ServiceState = request.app.state.service
    return state


async def _state_dependency(request: Request) -> ServiceState:
    # async on purpose: FastAPI runs a sync dependency in a worker thread, a thread hop per request.
    return service_state(request)


StateDep = Annotated[ServiceState, Depends(_state_dependency)]
