"""ServiceState: what both doors share, built by app/main.py's build_service: the engine, the settings, the budgets, the metrics.

The serving process hands the one state to both doors (app/process/server.py): the HTTP app keeps it as
`app.state.service`, where its routes read it (app/http/endpoints.py), and the gRPC server is given
it when it starts (app/grpc/server.py). Neither door reads the other's objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from app.config.settings import Settings
from app.control import Control
from app.engine.facade import ServingEngine
from app.engine.linger import Arrivals
from app.observe.metrics import Metrics
from app.protocol.admission import HeldBytes, Outcomes
from app.protocol.shared_memory import SharedMemoryRegions
from app.tracing.trace_settings import TraceSettings

if TYPE_CHECKING:  # the OpenTelemetry SDK is imported only when tracing is on
    from app.tracing.spans import Tracing


@dataclass
class ServiceState:
    settings: Settings
    # The engine: the doors use its facade (app/engine/facade.py's EngineFacade); the serving process, its
    # lifecycle too. app/main.py wires app/engine/service.py's, or a front's app/handoff/remote.py's.
    engine: ServingEngine
    metrics: Metrics
    control: Control  # commands every serving process applies (app/control.py)
    held: HeldBytes  # bytes held by the requests this process is answering (app/protocol/admission.py)
    trace_settings: TraceSettings  # Triton's trace settings, this process's copy (app/tracing/trace_settings.py)
    tracing: Tracing | None = None  # None: requests are not traced
    shared_memory: SharedMemoryRegions | None = None  # the registered regions; None: the extension is off
    # Requests a door has begun to receive, which this process's batchers linger for (app/engine/linger.py);
    # None in a front, whose engine batches in its own process.
    arrivals: Arrivals | None = None
    # Each request's outcome in ffn_requests_total (app/protocol/admission.py), counted through `outcomes.count`.
    outcomes: Outcomes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.outcomes = Outcomes(self.metrics.requests)
