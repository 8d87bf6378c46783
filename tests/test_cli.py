"""The ffn-serve command: --help from Settings, --version, warnings, log formats, exit codes."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app import __version__
from app.cli import main
from app.config.settings import Settings, misspelt_variables
from ffn_testing import start_server

pytestmark = pytest.mark.server  # ffn-serve processes: real servers, or the command exiting early

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


def test_invalid_settings_exit_2_with_one_line_per_problem() -> None:
    result = run_cli("--port", "70000", "--max-wait-ms", "-1")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "ffn-serve: invalid setting port (flag --port): Input should be less than or equal to 65535 (got '70000')",
        "ffn-serve: invalid setting max_wait_ms (flag --max-wait-ms): Input should be greater than or equal to 0 "
        "(got '-1')",
    ]


def settings_errors(capsys: pytest.CaptureFixture[str], *argv: str) -> list[str]:
    """The lines `ffn-serve argv` prints for settings it refuses (exit 2), run in-process."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "pydantic.dev" not in err and "http" not in err  # no pydantic link
    return err.splitlines()


def test_a_misspelt_key_in_the_config_file_names_the_file_and_the_nearest_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "my.toml"
    config.write_text('max_bach_rows = 8\n\n[[models]]\nname = "m"\ndtyp = "float16"\n')
    assert sorted(settings_errors(capsys, "--config", str(config))) == [
        f"ffn-serve: unknown setting max_bach_rows (config file {config}); did you mean max_batch_rows?",
        f"ffn-serve: unknown setting models[0].dtyp (config file {config}); did you mean dtype?",
    ]


def test_a_bad_value_in_the_config_file_names_the_key_the_file_and_the_value(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "my.toml"
    config.write_text('port = "eighty"\n\n[[models]]\nname = "m"\ndevice = "gpu"\n')
    monkeypatch.setenv("FFN_CONFIG", str(config))
    assert sorted(settings_errors(capsys)) == [
        f"ffn-serve: invalid setting models[0].device (config file {config}): String should match pattern "
        "'^(auto|cpu|cuda|cuda:\\d+)$' (got 'gpu')",
        f"ffn-serve: invalid setting port (config file {config}): Input should be a valid integer, unable to parse "
        "string as an integer (got 'eighty')",
    ]


def test_a_bad_flag_names_the_flag_and_the_nearest_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert settings_errors(capsys, "stray", "--max-bach-rows", "8", "--workers", "0", "--no-warmupp") == [
        "ffn-serve: unexpected argument 'stray': every setting is a flag (--name value)",
        "ffn-serve: unknown flag --max-bach-rows; did you mean --max-batch-rows?",
        "ffn-serve: unknown flag --no-warmupp; did you mean --no-warmup?",
    ]
    assert settings_errors(capsys, "--workers", "0") == [
        "ffn-serve: invalid setting workers (flag --workers): Input should be greater than or equal to 1 (got '0')"
    ]


def test_a_bad_variable_names_the_variable(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FFN_MAX_QUEUE_ROWS", "0")
    monkeypatch.setenv("FFN_CORS_ORIGINS", "https://a.example")  # a list is JSON in a variable
    [line] = settings_errors(capsys)
    assert line.startswith(
        "ffn-serve: invalid setting cors_origins (environment variable FFN_CORS_ORIGINS): "
        "a list or table here is written as JSON: "
    )
    monkeypatch.setenv("FFN_CORS_ORIGINS", '["https://a.example"]')
    assert settings_errors(capsys) == [
        "ffn-serve: invalid setting max_queue_rows (environment variable FFN_MAX_QUEUE_ROWS): Input should be "
        "greater than or equal to 1 (got '0')"
    ]


def test_the_same_key_from_the_flag_the_variable_and_the_file_names_the_one_used(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "my.toml"
    config.write_text("max_batch_rows = -1\n")
    assert settings_errors(capsys, "--config", str(config))[0].startswith(
        f"ffn-serve: invalid setting max_batch_rows (config file {config}): "
    )
    monkeypatch.setenv("FFN_MAX_BATCH_ROWS", "-2")
    assert settings_errors(capsys, "--config", str(config))[0].startswith(
        "ffn-serve: invalid setting max_batch_rows (environment variable FFN_MAX_BATCH_ROWS): "
    )
    assert settings_errors(capsys, "--config", str(config), "--max-batch-rows", "-3")[0].startswith(
        "ffn-serve: invalid setting max_batch_rows (flag --max-batch-rows): "
    )


def test_settings_are_checked_before_torch_or_the_server_is_imported(tmp_path: Path) -> None:
    """A mistake is reported at once: torch alone takes seconds to import on a busy machine."""
    config = tmp_path / "my.toml"
    config.write_text("max_bach_rows = 8\n")
    code = (
        "import sys; from app.cli import main; code = main(['--config', sys.argv[1]]); "
        "heavy = sorted(m for m in ('torch', 'app.process.server', 'app.engine', 'uvicorn', 'fastapi') if m in sys.modules); "
        "print('imported:', heavy); sys.exit(code)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(config)], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert result.returncode == 2
    assert result.stdout == "imported: []\n"
    assert "did you mean max_batch_rows?" in result.stderr


def test_help_shows_readable_metavars_not_type_names() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    for shown in ("--config FILE", "--api-key KEY", "--models JSON", "--cors-origins ORIGIN", "--port PORT"):
        assert shown in result.stdout, shown
    usage = result.stdout.split("\n\n")[0]
    metavars = set(re.findall(r"\[--[\w-]+ ([^\]]+)\]", usage))
    assert not metavars & {"SecretStr", "list[JSON]", "list[str]", "Path", "int", "float", "str"}, metavars
    assert {"FILE", "KEY", "JSON", "PORT", "MS", "SECONDS", "BYTES", "ROWS"} <= metavars, metavars


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the banner names the GPUs")
@pytest.mark.parametrize("env", [{"FFN_TORCH_THREADS": "1"}, {"FFN_TORCH_THREADS": "2", "FFN_BATCH_INVARIANT": "true"}])
def test_the_banner_says_the_torch_threads_the_setting_gives(env) -> None:
    with start_server(env={**env, "FFN_WARMUP": "false"}) as server:
        first = server.logs().splitlines()[0]
    assert first.endswith(", CPU only (1 torch thread)"), first


def test_a_port_in_use_exits_3_before_loading_anything(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("--port", str(port), "--log-format", "json")
    assert result.returncode == 3
    # A refused start is one `ffn-serve: ...` line, as a settings mistake is, whatever the log format.
    assert result.stderr.splitlines() == [
        f"ffn-serve: cannot listen on 127.0.0.1:{port}: Address already in use: another ffn-serve may be running "
        "there; stop it, or choose another port with --port N (FFN_PORT)"
    ]


@pytest.mark.parametrize("flag", ["--no-warmup", "--warmup"])
def test_boolean_flags_parse(flag: str) -> None:
    from app.config.settings import command_line

    assert command_line([flag]) == {"warmup": flag == "--warmup"}


def test_json_logs_are_one_object_per_line_and_say_what_started() -> None:
    import httpx

    from ffn_testing import start_server

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
    assert result.stderr.startswith(
        "ffn-serve: invalid setting api_key (environment variable FFN_API_KEY): the API key"
    )
    if key.strip():
        assert key not in result.stderr  # a refused key is not echoed to the log
