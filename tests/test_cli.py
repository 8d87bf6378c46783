"""The ffn-serve command: --help from Settings, --version, warnings, log formats, exit codes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from app import __version__
from app.settings import Settings, misspelt_variables

CLI = [sys.executable, "-m", "app.cli"]


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_help_lists_every_setting_with_its_flag_variable_and_default() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())  # argparse wraps lines; compare with single spaces
    for name, field in Settings.model_fields.items():
        flag, variable = "--" + name.replace("_", "-"), "FFN_" + name.upper()
        assert flag in text and f"[env: {variable}]" in text, name
        assert field.description and " ".join(field.description.split()) in text, name
    assert "(default: 8000)" in text and "(default: 1024)" in text  # port, max_batch_rows


def test_version() -> None:
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"ffn-serve {__version__}"


def test_a_misspelt_variable_names_the_nearest_setting() -> None:
    warnings = misspelt_variables({"FFN_MAX_BACH_ROWS": "8", "FFN_PORT": "1", "OTHER": "x"})
    assert len(warnings) == 1
    assert "FFN_MAX_BACH_ROWS" in warnings[0] and "did you mean FFN_MAX_BATCH_ROWS?" in warnings[0]


def test_invalid_settings_exit_2_with_a_message() -> None:
    result = run_cli("--port", "70000")
    assert result.returncode == 2
    assert "invalid settings" in result.stderr and "port" in result.stderr


def test_a_port_in_use_exits_3_before_loading_anything(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("--port", str(port), "--log-format", "json")
    assert result.returncode == 3
    records = [json.loads(line) for line in result.stderr.splitlines()]
    errors = [r["message"] for r in records if r["level"] == "error"]
    assert errors == [f"cannot listen on 127.0.0.1:{port}: Address already in use"]
    assert not any("loaded model" in r["message"] or r["message"].startswith("ready") for r in records)


@pytest.mark.parametrize("flag", ["--no-warmup", "--warmup"])
def test_boolean_flags_parse(flag: str) -> None:
    from app.settings import command_line

    assert command_line([flag]) == {"warmup": flag == "--warmup"}


def test_json_logs_are_one_object_per_line_and_say_what_started() -> None:
    import httpx

    from ffn_client.testing import start_server

    with start_server(env={"FFN_LOG_FORMAT": "json", "FFN_ACCESS_LOG": "true", "FFN_API_KEY": "k"}) as server:
        httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer k"})
        assert server.stop() == 0
        log = server.logs()  # read before the block ends: a clean exit deletes the log
    records = [json.loads(line) for line in log.splitlines() if line.strip()]
    messages = [r["message"] for r in records]
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    assert messages[0].startswith(f"ffn-serve {__version__}, torch ")
    assert any(m.startswith("loaded model demo: relu, d_model 512, d_ff 2048, float32 on cpu") for m in messages)
    assert any(
        m.startswith("settings changed from defaults: ") and "api_key=***" in m and "log_format=json" in m
        for m in messages
    )
    assert "auth on (Bearer API key)" in messages
    assert any(m == f"listening on http://127.0.0.1:{server.port}" for m in messages)
    access = [r for r in records if r["logger"] == "uvicorn.access" and r.get("path") == "/v1/models"]
    assert access and access[0]["status"] == 200 and access[0]["method"] == "GET"


@pytest.mark.parametrize("key", ["", " ", "\t\n", "two words", "key\x7f"])
def test_a_blank_or_unsendable_api_key_refuses_to_start(key: str) -> None:
    # Issue 11, class 9: an empty FFN_API_KEY used to turn auth off without a word.
    result = run_cli(env={**os.environ, "FFN_API_KEY": key})
    assert result.returncode == 2, result.stderr
    assert "invalid settings" in result.stderr and "api_key" in result.stderr
    if key.strip():
        assert key not in result.stderr  # a refused key is not echoed to the log
