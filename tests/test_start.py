"""The start (issue 29, items 6-8): a port in the way names the fix, what can be checked is checked
before torch is imported, and a signal while the models load stops the start.

Real `ffn-serve` processes where the start itself is what is tested; the settings in-process.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from app.settings import command_line, load_settings
from app.settings_problems import SettingsError

ROOT = Path(__file__).resolve().parents[1]


# ----- item 8: the README's "Another port", and a port that collides with gRPC's ---------------------


def test_the_readmes_other_port_example_is_a_valid_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every command and variable of the README's "Another port" line: settings that start (8001 is gRPC's)."""
    line = next(text for text in (ROOT / "README.md").read_text().splitlines() if text.startswith("Another port:"))
    commands = re.findall(r"`bash scripts/serve\.sh ([^`]*)`", line)
    variables = re.findall(r"`(FFN_[A-Z_]+)=([^`;\s]+)", line)
    assert commands and variables, line
    for args in commands:
        settings = load_settings(**command_line(shlex.split(args)))
        assert settings.port != settings.grpc_port
    for name, value in variables:
        monkeypatch.setenv(name, value)
        settings = load_settings()
        assert str(settings.port) == value and settings.port != settings.grpc_port


def test_a_port_that_is_grpcs_names_both_ways_out() -> None:
    with pytest.raises(SettingsError) as refused:
        load_settings(**command_line(["--port", "8001"]))
    (problem,) = refused.value.problems
    assert "grpc_port must differ from port" in problem
    assert "--grpc-port N (FFN_GRPC_PORT)" in problem and "--no-grpc (FFN_GRPC=false)" in problem
    # Each way out, as the line says it, is a valid start.
    assert load_settings(**command_line(["--port", "8001", "--grpc-port", "9001"])).grpc_port == 9001
    assert load_settings(**command_line(["--port", "8001", "--no-grpc"])).grpc is False
