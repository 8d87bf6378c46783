"""Settings precedence: command-line flags, then FFN_* variables, then the config file, then defaults.

In-process through load_settings(**flags), and once end to end through `python -m app.cli`.
conftest clears every FFN_* variable first, so each test sets exactly the ones it names.
"""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import numpy as np
import pytest

from app.config.settings import Settings, load_settings
from ffn_testing import HOST, free_port, metric_value, start_server

DEFAULTS = Settings()


def write_config(folder: Path, text: str, name: str = "ffn.toml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def test_file_values_replace_defaults_and_the_rest_stay_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write_config(tmp_path, "port = 8101\nmax_batch_rows = 32\n")
    monkeypatch.setenv("FFN_CONFIG", str(config))
    settings = load_settings()
    assert (settings.port, settings.max_batch_rows) == (8101, 32)
    assert (settings.max_queue_rows, settings.max_wait_ms, settings.host) == (
        DEFAULTS.max_queue_rows,
        DEFAULTS.max_wait_ms,
        DEFAULTS.host,
    )


def test_environment_beats_the_file_field_by_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_config(tmp_path, "port = 8101\nmax_batch_rows = 32\nmax_wait_ms = 3.0\n")
    monkeypatch.setenv("FFN_CONFIG", str(config))
    monkeypatch.setenv("FFN_PORT", "8202")
    monkeypatch.setenv("FFN_MAX_BATCH_ROWS", "64")
    settings = load_settings()
    assert (settings.port, settings.max_batch_rows) == (8202, 64)
    assert settings.max_wait_ms == 3.0  # not in the environment: the file's


@pytest.mark.parametrize("config_from", ["environment", "flag"])
def test_flags_beat_the_environment_and_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config_from: str
) -> None:
    config = write_config(tmp_path, 'port = 8101\nhost = "127.0.0.2"\nmax_batch_rows = 32\n')
    monkeypatch.setenv("FFN_PORT", "8202")
    monkeypatch.setenv("FFN_HOST", "127.0.0.3")
    if config_from == "environment":
        monkeypatch.setenv("FFN_CONFIG", str(config))
        settings = load_settings(port=8303, host=None)  # None: the flag was not given
    else:
        settings = load_settings(config=config, port=8303, host=None)
    assert settings.port == 8303
    assert settings.host == "127.0.0.3"  # no --host: the environment's, not the file's
    assert settings.max_batch_rows == 32


def test_config_flag_beats_ffn_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FFN_CONFIG", str(write_config(tmp_path, "port = 8101\n", "env.toml")))
    settings = load_settings(config=write_config(tmp_path, "port = 8404\n", "flag.toml"))
    assert settings.port == 8404


def test_model_weights_are_relative_to_the_file(tmp_path: Path) -> None:
    folder = tmp_path / "configs"
    folder.mkdir()
    config = write_config(folder, '[[models]]\nname = "m"\nweights = "weights/m.safetensors"\n')
    (model,) = load_settings(config=config).models
    assert model.weights == (folder / "weights" / "m.safetensors").resolve()


def test_empty_environment_means_defaults() -> None:
    assert load_settings() == DEFAULTS


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((HOST, port)) == 0


@pytest.mark.server
def test_the_process_applies_flag_over_environment_over_file(tmp_path: Path) -> None:
    """--port beats FFN_PORT beats the file's port; FFN_MAX_QUEUE_ROWS beats the file's; the file's
    max_batch_rows beats the default."""
    file_port, env_port = free_port(), free_port()
    config = write_config(tmp_path, f"port = {file_port}\nmax_queue_rows = 8\nmax_batch_rows = 4\nwarmup = false\n")
    env = {"FFN_PORT": str(env_port), "FFN_MAX_QUEUE_ROWS": "16"}
    with start_server(env=env, config=config) as server:  # the launcher passes --port
        assert server.port not in (file_port, env_port)
        assert not listening(file_port) and not listening(env_port)
        with httpx.Client(base_url=server.url, timeout=30.0) as client:
            ok = client.post("/v1/models/demo/transform", json={"inputs": np.zeros((12, 512)).tolist()})
            assert ok.status_code == 200, ok.text  # 12 rows fit the environment's 16, not the file's 8
            too_big = client.post("/v1/models/demo/transform", json={"inputs": np.zeros((17, 512)).tolist()})
            assert too_big.status_code == 413 and "at most 16 rows" in too_big.json()["error"]
            page = client.get("/metrics").text
        assert metric_value(page, "ffn_max_batch_rows", model="demo") == 4
