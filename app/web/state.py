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
from app.web.errors import ERRORS, INTERNAL, error_type_of
from app.web.shared_memory import SharedMemoryRegions

# Every outcome ffn_requests_total can count: ok, and each error_type of the one error table.
OUTCOMES = ("ok", *sorted({kind.error_type for kind in ERRORS.values()} | {INTERNAL.error_type}))
PROTOCOLS = ("http", "grpc")  # ffn_requests_total's protocol label: the two doors

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
    shared_memory: SharedMemoryRegions | None = None  # the registered regions; None: the extension is off

    def count_from_zero(self, model: str) -> None:
        """Create the model's ffn_requests_total series for every outcome and door, at 0.

        Labelled series appear on first use otherwise, and `increase()` over the first error of a
        kind reads 0: an alert on it would never fire. (The model's histograms are created with it.)
        """
        for outcome in OUTCOMES:
            for protocol in PROTOCOLS:
                self.metrics.requests.labels(model=model, outcome=outcome, protocol=protocol)

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
