"""OpenTelemetry tracing of requests: off unless an OTLP endpoint is named, and free when off.

- config.py: whether tracing is on and where spans go (settings and OTEL_* variables), checked at start.
- trace_settings.py: Triton's trace settings (level, rate, count, log frequency), per server and model.
- spans.py: the spans themselves and their export; imported, with the OpenTelemetry SDK, only when on.

The edge calls in at two places only (app/http/endpoints.py: FastPath, and the stage marks of
app/observe/identity.py); the engine reports batches through its observer hook (app/engine/observe.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.config.tracing import Export
from app.tracing.trace_settings import TraceSettings

if TYPE_CHECKING:
    from app.tracing.spans import Tracing


def start_tracing(export: Export | None, settings: TraceSettings) -> Tracing | None:
    """The process's Tracing when spans have somewhere to go (`export`), else None and nothing imported."""
    if export is None:
        return None
    from app.tracing.spans import Tracing  # the SDK and the exporter: about 0.2 s of imports

    return Tracing(export, settings)
