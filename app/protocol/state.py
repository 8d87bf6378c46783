"""ServiceState: what both doors share, built in create_app: the engine, the settings, the budgets, the metrics.

The HTTP door reads it from `request.app.state.service` (app/http/state.py), the gRPC door is
handed it when it starts (app/grpc/server.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import Counter

from app.control import Control
from app.engine.service import Engine
from app.metrics import Metrics
from app.protocol.admission import HeldBytes
from app.protocol.errors import ERRORS, INTERNAL, error_type_of
from app.protocol.shared_memory import SharedMemoryRegions
from app.settings import Settings
from app.tracing.trace_settings import TraceSettings

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
    held: HeldBytes  # bytes held by the requests this process is answering (app/protocol/admission.py)
    trace_settings: TraceSettings  # Triton's trace settings, this process's copy (app/tracing/trace_settings.py)
    tracing: Tracing | None = None  # None: requests are not traced
    shared_memory: SharedMemoryRegions | None = None  # the registered regions; None: the extension is off
    # ffn_requests_total's children by (model, outcome, protocol), each looked up once (a lookup costs µs).
    _outcomes: dict[tuple[str, str, str], Counter] = field(default_factory=dict, repr=False)

    def count_from_zero(self, model: str) -> None:
        """Create the model's ffn_requests_total series for every outcome and door, at 0.

        Labelled series appear on first use otherwise, and `increase()` over the first error of a
        kind reads 0: an alert on it would never fire. (The model's histograms are created with it.)
        """
        for outcome in OUTCOMES:
            for protocol in PROTOCOLS:
                self.counter(model, outcome, protocol)

    def count(self, model: str, protocol: str = "http") -> Counting:
        """Count one request's outcome in ffn_requests_total{model, outcome, protocol}: ok or its error_type (`with`)."""
        return Counting(self, model, protocol)

    def counter(self, model: str, outcome: str, protocol: str = "http") -> Counter:
        """The ffn_requests_total child of (model, outcome, protocol)."""
        child = self._outcomes.get((model, outcome, protocol))
        if child is None:
            child = self.metrics.requests.labels(model=model, outcome=outcome, protocol=protocol)
            self._outcomes[model, outcome, protocol] = child
        return child


class Counting:
    """`with state.count(model):` counts the block's outcome once: ok, or the error_type of what it raised."""

    __slots__ = ("model", "protocol", "state")

    def __init__(self, state: ServiceState, model: str, protocol: str) -> None:
        self.state, self.model, self.protocol = state, model, protocol

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: object) -> None:
        if error is None:
            self.state.counter(self.model, "ok", self.protocol).inc()
        elif isinstance(error, Exception):
            self.state.counter(self.model, error_type_of(error), self.protocol).inc()
