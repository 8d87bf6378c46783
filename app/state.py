"""ServiceState: what the routes share, built in create_app and read through deps."""

from __future__ import annotations

from contextlib import contextmanager
from collections.abc import Iterator
from dataclasses import dataclass, field

from app.errors import ServiceError, Unavailable
from app.metrics import Metrics
from app.registry import Registry, ServedModel
from app.settings import Settings


@dataclass
class ServiceState:
    settings: Settings
    registry: Registry
    metrics: Metrics
    draining: bool = False
    started: bool = field(default=False)

    @property
    def ready(self) -> bool:
        return self.started and not self.draining and self.registry.ready

    def check_serving(self, served: ServedModel) -> None:
        """Refuse new work while draining or before the model is warm."""
        if self.draining:
            raise Unavailable("the server is draining before shutdown")
        if not served.warm:
            raise Unavailable(f"model {served.name!r} is still warming up")

    @contextmanager
    def count(self, model: str) -> Iterator[None]:
        """Count one request's outcome in ffn_requests_total{model, outcome}."""
        try:
            yield
        except ServiceError as exc:
            self.metrics.requests.labels(model=model, outcome=exc.error_type).inc()
            raise
        except Exception:
            self.metrics.requests.labels(model=model, outcome="internal").inc()
            raise
        self.metrics.requests.labels(model=model, outcome="ok").inc()
