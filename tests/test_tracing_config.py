"""When tracing is on, where spans go, what is refused at start, and that off costs no OpenTelemetry SDK."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.cli import main
from app.config.tracing import Export, problems, traces_export

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_otel_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)


def test_tracing_is_off_unless_an_endpoint_is_named() -> None:
    assert traces_export(None, {}) is None
    assert traces_export(None, {"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"}) is None


def test_the_setting_wins_and_the_variables_follow_the_otlp_rules() -> None:
    both = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4318"}
    assert traces_export("http://flag:4318/", both) == Export("http://flag:4318/v1/traces", "otlp_endpoint")
    assert traces_export(None, both) == Export("http://env:4318/v1/traces", "OTEL_EXPORTER_OTLP_ENDPOINT")
    # The signal's own variable is the full URL, used as it is, and beats the base one.
    traces = {**both, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://c:9/custom"}
    assert traces_export(None, traces) == Export("https://c:9/custom", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


@pytest.mark.parametrize("off", [{"OTEL_SDK_DISABLED": "TRUE"}, {"OTEL_TRACES_EXPORTER": "none"}])
def test_the_standard_switches_keep_it_off(off: dict[str, str]) -> None:
    assert traces_export("http://flag:4318", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4318", **off}) is None


@pytest.mark.parametrize(
    ("environ", "says"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER='zipkin': ffn-serve exports traces with OTLP only"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"}, "must be an absolute http:// or https:// URL"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://h:99999"}, "is not a URL"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "as OTLP over HTTP (http/protobuf) only"),
        ({"OTEL_TRACES_SAMPLER": "sometimes"}, "is not one of always_on, always_off, traceidratio"),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1%"}, "takes a ratio from 0 to 1"),
        ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}, "ratio from 0 to 1"),
    ],
)
def test_what_would_fail_or_surprise_is_refused_at_start(environ: dict[str, str], says: str) -> None:
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", **environ}
    (problem,) = problems(None, environ)
    assert says in problem


def test_sampler_choices_that_are_fine_pass() -> None:
    environ = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_TRACES_SAMPLER": "ParentBased_TraceIdRatio",
        "OTEL_TRACES_SAMPLER_ARG": "0.01",
    }
    assert problems(None, environ) == []
    # Without an endpoint nothing is exported, so nothing of it can go wrong.
    assert problems(None, {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == []


def test_the_command_stops_with_one_line_per_problem(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "sometimes")
    assert main(["--port", "0"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and all(line.startswith("ffn-serve: OTEL_") for line in lines)
    assert main(["--otlp-endpoint", "collector:4318"]) == 2
    assert "--otlp-endpoint" in capsys.readouterr().err


def test_an_endpoint_with_credentials_is_refused_without_echoing_them(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 41: the refusal printed the password it refused to log.
    assert main(["--otlp-endpoint", "http://tracer:s3cr3t-pw@collector:4318"]) == 2
    err = capsys.readouterr().err
    assert "credentials" in err and "s3cr3t-pw" not in err and "tracer" not in err and "collector:4318" in err
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "https://tracer:s3cr3t-pw@collector:4318")
    (line,) = problems(None, dict(os.environ))
    assert "credentials" in line and "s3cr3t-pw" not in line and "tracer" not in line and "***@collector" in line


def _sdk_loaded_after_create_app(env: dict[str, str]) -> bool:
    code = (
        "import sys, json\n"
        "from app.main import create_app\n"
        "from app.config.settings import Settings\n"
        "create_app(Settings())\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk') "
        "or m.startswith('opentelemetry.exporter'))))\n"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "FFN_"))}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**clean, **env}, capture_output=True, text=True, check=True
    )
    return bool(json.loads(result.stdout.splitlines()[-1]))


def test_a_service_that_does_not_trace_never_imports_the_sdk_or_the_exporter() -> None:
    assert not _sdk_loaded_after_create_app({})
    assert _sdk_loaded_after_create_app({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"})  # the check sees it
