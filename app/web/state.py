"""ServiceState: what the routes share, built in create_app and read from `request.app.state.service`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from app.control import Control
from app.engine.service import Engine
from app.metrics import Metrics
from app.settings import Settings
from app.web.errors import error_type_of
from app.web.held import HeldBytes


@dataclass
class ServiceState:
    settings: Settings
    engine: Engine
    metrics: Metrics
    control: Control  # commands every serving process applies (app/control.py)
    held: HeldBytes  # bytes held by the requests this process is answering (app/web/held.py)

    @contextmanager
    def count(self, model: str) -> Iterator[None]:
        """Count one request's outcome in ffn_requests_total{model, outcome}: ok or its error_type."""
        try:
            yield
        except Exception as exc:
            self.metrics.requests.labels(model=model, outcome=error_type_of(exc)).inc()
            raise
        self.metrics.requests.labels(model=model, outcome="ok").inc()


def service_state(request: Request) -> ServiceState:
    """The app's ServiceState (a plain function: the tensor routes skip FastAPI's dependencies)."""
    state: ServiceState = request.app.state.service
    return state


async def _state_dependency(request: Request) -> ServiceState:
    # async on purpose: FastAPI runs a sync dependency in a worker thread, a thread hop per request.
    return service_state(request)


StateDep = Annotated[ServiceState, Depends(_state_dependency)]
