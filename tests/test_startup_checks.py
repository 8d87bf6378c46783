"""Start-up robustness (issue 20, classes 10-14, 16): what a bad config, variable or system limit gets.

Each mistake is one line on stderr and exit 2, at once and without a traceback (the settings
are checked before torch is imported, so these runs take a fraction of a second); a connection
cap past the process's descriptor limit is raised to fit or lowered with a log line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from starlette.types import Message, Receive, Scope, Send

from app.http.edge import GuardMiddleware
from app.main import ENDPOINTS
from app.settings import ROUTE_WORDS
from ffn_client.testing import start_server

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


def test_the_descriptor_limit_is_raised_to_fit_the_cap() -> None:
    with start_server(env={"FFN_WARMUP": "0"}, prefix=with_limit(256, 4096)) as server:
        assert soft_limit(server.pid) >= 1024 + 64
        assert "does not fit" not in server.logs()


def test_a_cap_past_the_hard_limit_is_lowered_with_a_log_line() -> None:
    # Before: the cap never triggered; past the limit clients were reset, and nothing was logged.
    with start_server(env={"FFN_WARMUP": "0"}, prefix=with_limit(256, 256)) as server:
        assert "max_connections 1024 does not fit this process's file descriptor limit (256" in server.logs()
        assert "at most 192 connections are served" in server.logs()
