"""Start-up robustness (issue 20, classes 10-14, 16): what a bad config, variable or system limit gets.

Each mistake is one line on stderr and exit 2, at once and without a traceback (the settings
are checked before torch is imported, so these runs take a fraction of a second); a connection
cap past the process's descriptor limit is raised to fit or lowered with a log line.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from starlette.types import Message, Receive, Scope, Send

from app.config import settings as settings_module
from app.config.settings import ROUTE_WORDS, Settings, load_settings
from app.config.settings_problems import SettingsError
from app.config.tracing import problems
from app.http.edge import GuardMiddleware
from app.main import ENDPOINTS
from ffn_testing import start_server

CLI = [sys.executable, "-m", "app.cli"]


def refused(*args: str, env: dict[str, str] | None = None) -> str:
    """Run the command, which must exit 2 with one line; that line."""
    result = subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})}
    )
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ffn-serve: "), result.stderr[-2000:]
    return lines[0]


# ----- class 10: --config is read with the weight files' checks --------------------------------------


def test_a_config_that_is_a_fifo_a_device_or_a_folder_is_refused_unread(tmp_path: Path) -> None:
    fifo = tmp_path / "ffn.toml"
    os.mkfifo(fifo)  # before: opened for reading, the start waited for a writer forever
    assert "is a FIFO (named pipe), not a regular file" in refused("--config", str(fifo))
    assert "is a character device, not a regular file" in refused("--config", "/dev/zero")  # before: ate memory
    assert "is a directory, not a regular file" in refused("--config", str(tmp_path))


def test_a_config_larger_than_a_config_is_refused_unread(tmp_path: Path) -> None:
    big = tmp_path / "big.toml"
    big.write_bytes(b"# " + b"x" * (2 << 20) + b"\n")
    assert "a config file holds at most" in refused("--config", str(big))


# ----- class 11: malformed TOML, nesting, links --------------------------------------------------------


def test_invalid_utf8_and_deep_nesting_in_the_config_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b'log_level = "\xff"\n')
    assert "is not UTF-8 text (byte 0xff at offset 13)" in refused("--config", str(bad))
    deep = tmp_path / "deep.toml"
    deep.write_text("x = " + "[" * 100_000 + "]" * 100_000 + "\n")  # before: RecursionError, exit 1
    assert "nested too deeply" in refused("--config", str(deep))


def test_a_deeply_nested_list_variable_or_flag_is_one_line() -> None:
    nested = "[" * 20_000 + "]" * 20_000
    assert refused(env={"FFN_MODELS": nested}) == (
        "ffn-serve: invalid setting models (environment variable FFN_MODELS): a list or table nested too deeply"
    )
    assert "nested too deeply" in refused("--models", nested)


def test_a_weights_symlink_loop_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    config = tmp_path / "ffn.toml"
    config.write_text('[[models]]\nname = "m"\nweights = "loop"\n')
    line = refused("--config", str(config))
    assert "models[0].weights 'loop'" in line and "loop" in line


# ----- class 12: model names that are route words -----------------------------------------------------


def test_the_route_words_are_every_literal_after_v2_models() -> None:
    words = {
        endpoint.path.split("/")[3]
        for endpoint in ENDPOINTS
        if endpoint.path.startswith("/v2/models/") and not endpoint.path.split("/")[3].startswith("{")
    }
    assert words == ROUTE_WORDS


@pytest.mark.parametrize("word", sorted(ROUTE_WORDS))
def test_a_model_named_as_a_route_word_is_refused(word: str) -> None:
    # Before: a model named `stats` started, and GET /v2/models/stats answered the statistics instead.
    line = refused(env={"FFN_MODELS": f'[{{"name": "{word}"}}]'})
    assert (
        f"invalid setting models[0].name (environment variable FFN_MODELS): {word!r} is a word of the V2 paths" in line
    )


# ----- class 13: an API key that cannot fit in a head -------------------------------------------------


def test_an_api_key_longer_than_half_the_head_budget_is_refused() -> None:
    # Before: accepted, and then every request carrying the right key got 431.
    line = refused(env={"FFN_API_KEY": "k" * 3000, "FFN_MAX_HEADER_BYTES": "4096"})
    assert "the API key is 3000 characters" in line and "k" * 100 not in line
    assert "max_header_bytes (4096)" in line


# ----- class 14: only HTTP reaches the app -------------------------------------------------------------


async def test_the_guard_refuses_a_websocket_before_the_app_and_passes_lifespan_on() -> None:
    reached: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        reached.append(scope["type"])

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        return {"type": "websocket.connect"}

    guard = GuardMiddleware(app, api_key="k", max_header_bytes=16384)
    await guard({"type": "websocket", "path": "/v2/health/live", "headers": []}, receive, send)
    assert reached == [] and sent == [{"type": "websocket.close", "code": 1008}]
    await guard({"type": "lifespan"}, receive, send)
    assert reached == ["lifespan"]


# ----- class 16: a connection cap past the descriptor limit ----------------------------------------------


def soft_limit(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no open-files line")


def with_limit(soft: int, hard: int) -> tuple[str, ...]:
    """A command prefix that starts the server with these descriptor limits (sh's ulimit, then exec)."""
    return ("sh", "-c", f'ulimit -Sn {soft} && ulimit -Hn {hard} && exec "$@"', "sh")


@pytest.mark.server
def test_the_descriptor_limit_is_raised_to_fit_the_cap() -> None:
    with start_server(env={"FFN_WARMUP": "0"}, prefix=with_limit(256, 4096)) as server:
        assert soft_limit(server.pid) >= 1024 + 64
        assert "does not fit" not in server.logs()


@pytest.mark.server
def test_a_cap_past_the_hard_limit_is_lowered_with_a_log_line() -> None:
    # Before: the cap never triggered; past the limit clients were reset, and nothing was logged.
    with start_server(env={"FFN_WARMUP": "0"}, prefix=with_limit(256, 256)) as server:
        assert "max_connections 1024 does not fit this process's file descriptor limit (256" in server.logs()
        assert "at most 192 connections are served" in server.logs()


# ----- issue 28 class 10: settings that would turn a budget off, and URLs ----------------------------


def refused_lines(*args: str, env: dict[str, str] | None = None) -> list[str]:
    """Run the command, which must exit 2; its stderr lines, each of one problem."""
    result = subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})}
    )
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert all(line.startswith("ffn-serve: ") for line in lines), result.stderr[-2000:]
    return lines


def test_an_infinite_timeout_is_refused_naming_each_setting() -> None:
    # Before: `--read-timeout-s inf` started, with the body's deadline off and nothing said.
    assert refused("--read-timeout-s", "inf") == (
        "ffn-serve: invalid setting read_timeout_s (flag --read-timeout-s): must be a finite number of seconds: "
        "inf would turn this bound off (got 'inf')"
    )
    lines = refused_lines(
        "--send-timeout-s", "Infinity", env={"FFN_HEADER_TIMEOUT_S": "inf", "FFN_DEFAULT_TIMEOUT_MS": "1e400"}
    )
    assert len(lines) == 3
    for line, where in zip(
        sorted(lines),
        [
            "default_timeout_ms (environment variable FFN_DEFAULT_TIMEOUT_MS)",
            "header_timeout_s (environment variable FFN_HEADER_TIMEOUT_S)",
            "send_timeout_s (flag --send-timeout-s)",
        ],
        strict=True,
    ):
        assert line.startswith(f"ffn-serve: invalid setting {where}: must be a finite number of"), line
        assert "would turn this bound off" in line


def test_every_float_setting_is_finite_and_every_timeout_at_most_a_day() -> None:
    floats = [name for name, field in Settings.model_fields.items() if field.annotation is float]
    timeouts = settings_module.TIMEOUTS
    assert set(timeouts) <= set(floats)
    for name in floats:
        for value in (math.inf, -math.inf, math.nan):
            with pytest.raises(SettingsError) as refusal:
                load_settings(**{name: value})
            (line,) = refusal.value.problems
            assert line.startswith(f"invalid setting {name} (flag --{name.replace('_', '-')}): "), line
    for name in timeouts:
        day = settings_module.MAX_TIMEOUT_S * (1000 if name.endswith("_ms") else 1)
        assert getattr(load_settings(**{name: day}), name) == day
        with pytest.raises(SettingsError, match="a longer bound is no bound"):
            load_settings(**{name: day * 1.5})


def test_a_zero_body_rate_starts_with_a_line_saying_the_rate_bound_is_off() -> None:
    # Before: it started silently. The line comes before the port is bound: a taken port ends the start there.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = subprocess.run(
            [*CLI, "--port", port, "--log-format", "json", "--min-body-rate", "0", "--read-timeout-s", "7"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        default = subprocess.run(
            [*CLI, "--port", port, "--log-format", "json"], capture_output=True, text=True, timeout=60
        )
    assert result.returncode == default.returncode == 3
    warnings = [r["message"] for r in log_records(result.stderr) if r["level"] == "warning"]
    assert warnings == [
        "min_body_rate is 0: the bound on a body's rate is off; a body may take any time as long as it never "
        "pauses for read_timeout_s (7 s)"
    ]
    assert not [r for r in log_records(default.stderr) if r["level"] == "warning"]


def log_records(stderr: str) -> list[dict[str, str]]:
    """The JSON log records of `stderr`, less the refused start's own `ffn-serve: ...` line."""
    return [json.loads(line) for line in stderr.splitlines() if not line.startswith("ffn-serve: ")]


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://collector:4318\n", "holds '\\n' at character 21"),  # before: accepted
        ("http://collector:4318\r\nX-Injected: 1", "holds '\\r' at character 21"),
        ("http://coll\tector:4318", "holds '\\t' at character 11"),
        ("\x1bhttp://collector:4318", "holds '\\x1b' at character 0"),
        ("http://collector :4318", "holds ' ' at character 16"),
        ("http://cöllector:4318", "holds 'ö' at character 8"),
        ("ftp://collector:4318", "must be an absolute http:// or https:// URL with a host"),
        ("http:///v1", "must be an absolute http:// or https:// URL with a host"),
        ("http://collector:99999", "is not a URL"),
        ("http://user:secret@collector:4318", "must not hold credentials"),
        ("http://collector:4318?tenant=a", "must have no query or fragment"),
        ("http://collector:4318#x", "must have no query or fragment"),
    ],
)
def test_a_malformed_otlp_endpoint_stops_the_start(url: str, says: str) -> None:
    line = refused("--otlp-endpoint", url)
    assert line.startswith("ffn-serve: invalid setting otlp_endpoint (flag --otlp-endpoint): the OTLP endpoint ")
    assert says in line, line
    assert "secret" not in line or "credentials" in line


def test_the_otlp_variables_are_held_to_the_same_rules() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/\x01"}
    assert "holds '\\x01' at character 22" in refused(env=env)
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces?tenant=a"}
    assert load_settings() is not None and problems(None, env) == []  # the traces endpoint is used as it is
    assert "must not hold credentials" in problems(None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://u:p@c/v1"})[0]


@pytest.mark.parametrize(
    ("origin", "says"),
    [
        ("https://app.example/", "must be an origin, scheme://host[:port] with no path"),
        ("https://app.example/path", "must be an origin"),
        ("null", "must be an absolute http:// or https:// URL with a host"),
        ("https://app.example\n", "holds '\\n'"),
        ("app.example", "must be an absolute http:// or https:// URL with a host"),
    ],
)
def test_a_cors_origin_that_could_never_match_stops_the_start(origin: str, says: str) -> None:
    line = refused(env={"FFN_CORS_ORIGINS": json.dumps(["https://ok.example", origin])})
    assert line.startswith("ffn-serve: invalid setting cors_origins (environment variable FFN_CORS_ORIGINS): ")
    assert says in line, line


def test_origins_and_endpoints_that_are_fine_pass() -> None:
    settings = load_settings(
        cors_origins=["*", "https://app.example", "http://127.0.0.1:3000", "http://[::1]:8080"],
        otlp_endpoint="https://otel.example:4318/base/",
    )
    assert settings.cors_origins[-1] == "http://[::1]:8080"
    assert problems(settings.otlp_endpoint, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == []
