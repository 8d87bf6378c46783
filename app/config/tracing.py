"""Whether requests are traced, and where spans go: the `otlp_endpoint` setting and the standard OTEL_* variables.

Tracing is on when an OTLP endpoint is named, by the setting (`--otlp-endpoint`,
`FFN_OTLP_ENDPOINT`, as TEI's flag) or by OpenTelemetry's own variables
(`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, used as it is, or `OTEL_EXPORTER_OTLP_ENDPOINT`, to
which `/v1/traces` is added); the setting wins. `OTEL_SDK_DISABLED=true` or
`OTEL_TRACES_EXPORTER=none` keep it off whatever is named. Spans go as OTLP over HTTP
(protobuf), the protocol every collector takes on port 4318. Everything else the SDK reads
itself: OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER(_ARG), OTEL_BSP_*,
OTEL_EXPORTER_OTLP_(TRACES_)HEADERS, _TIMEOUT, _COMPRESSION.

Nothing here imports OpenTelemetry: a service that does not trace never loads the SDK.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from app.config.settings_problems import url_problem, without_credentials

# The samplers OpenTelemetry's SDK environment specification names and the Python SDK implements.
SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
PROTOCOL = "http/protobuf"


@dataclass(frozen=True)
class Export:
    """Where spans are sent: the full URL the exporter posts to, and which setting or variable named it."""

    endpoint: str
    named_by: str


def traces_export(otlp_endpoint: str | None, environ: Mapping[str, str]) -> Export | None:
    """Where this process sends its spans; None when tracing is off."""
    if _flag(environ, "OTEL_SDK_DISABLED") == "true" or _flag(environ, "OTEL_TRACES_EXPORTER") == "none":
        return None
    if otlp_endpoint:
        return Export(otlp_endpoint.rstrip("/") + "/v1/traces", "otlp_endpoint")
    traces = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if traces:
        return Export(traces, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    if base:
        return Export(base.rstrip("/") + "/v1/traces", "OTEL_EXPORTER_OTLP_ENDPOINT")
    return None


def endpoint_problem(url: str, *, base: bool = True) -> str | None:
    """Why `url` cannot be an OTLP/HTTP endpoint (app/config/settings_problems.py: url_problem); None if it can.

    `base`: /v1/traces is added to it (the setting, OTEL_EXPORTER_OTLP_ENDPOINT); else it is the
    traces endpoint itself (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT).
    """
    return url_problem(url, "base" if base else "endpoint")


def problems(otlp_endpoint: str | None, environ: Mapping[str, str]) -> list[str]:
    """One line per OTEL_* variable that would make tracing fail or do what was not asked; checked at start."""
    found = []
    exporter = _flag(environ, "OTEL_TRACES_EXPORTER")
    if exporter not in (None, "otlp", "none"):
        found.append(
            f"OTEL_TRACES_EXPORTER={environ['OTEL_TRACES_EXPORTER']!r}: ffn-serve exports traces with OTLP only "
            "(otlp, or none for no traces)"
        )
    export = traces_export(otlp_endpoint, environ)
    if export is None:
        return found
    if export.named_by != "otlp_endpoint":  # the setting is checked with the settings
        named = environ[export.named_by].strip()
        problem = endpoint_problem(named, base=export.named_by == "OTEL_EXPORTER_OTLP_ENDPOINT")
        if problem is not None:
            found.append(f"{export.named_by}={without_credentials(repr(named))} {problem}")
    for variable in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = environ.get(variable, "").strip()
        if protocol and protocol != PROTOCOL:
            found.append(f"{variable}={protocol!r}: ffn-serve sends traces as OTLP over HTTP ({PROTOCOL}) only")
    sampler = _flag(environ, "OTEL_TRACES_SAMPLER")
    if sampler is not None and sampler not in SAMPLERS:
        found.append(f"OTEL_TRACES_SAMPLER={environ['OTEL_TRACES_SAMPLER']!r} is not one of {', '.join(SAMPLERS)}")
    argument = environ.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    if sampler in ("traceidratio", "parentbased_traceidratio") and argument:
        try:
            ratio = float(argument)
        except ValueError:
            ratio = -1.0
        if not 0.0 <= ratio <= 1.0:
            found.append(f"OTEL_TRACES_SAMPLER_ARG={argument!r}: the {sampler} sampler takes a ratio from 0 to 1")
    return found


def _flag(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name, "").strip().lower()
    return value or None
