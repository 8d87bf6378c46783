"""ServiceState: what the routes share, built in create_app and read from `request.app.state.service`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request
from prometheus_client import Counter

from app.control import Control
from app.engine.service import Engine
from app.metrics import Metrics
from app.settings import Settings
from app.web.errors import error_type_of


@dataclass
class ServiceState:
    settings: Settings
    engine: Engine
    metrics: Metrics
    control: Control  # commands every serving process applies (app/control.py)
    # ffn_requests_total's children by (model, outcome), each looked up once (a label lookup costs µs).
    _outcomes: dict[tuple[str, str], Counter] = field(default_factory=dict, repr=False)

    def count(self, model: str) -> Counting:
        """Count one request's outcome in ffn_requests_total{model, outcome}: ok or its error_type (`with`)."""
        return Counting(self, model)

    def counter(self, model: str, outcome: str) -> Counter:
        """The ffn_requests_total child of (model, outcome)."""
        child = self._outcomes.get((model, outcome))
        if child is None:
            child = self._outcomes[model, outcome] = self.metrics.requests.labels(model=model, outcome=outcome)
        return child


class Counting:
    """`with state.count(model):` counts the block's outcome once: ok, or the error_type of what it raised."""

    __slots__ = ("model", "state")

    def __init__(self, state: ServiceState, model: str) -> None:
        self.state, self.model = state, model

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: object) -> None:
        if error is None:
            self.state.counter(self.model, "ok").inc()
        elif isinstance(error, Exception):
            self.state.counter(self.model, error_type_of(error)).inc()


def service_state(request: Request) -> ServiceState:
    """The app's ServiceState (a plain function: the tensor routes skip FastAPI's dependencies)."""
    state: ServiceState = request.app.state.service
    return state


async def _state_dependency(request: Request) -> ServiceState:
    # async on purpose: FastAPI runs a sync dependency in a worker thread, a thread hop per request.
    return service_state(request)


StateDep = Annotated[ServiceState, Depends(_state_dependency)]
