"""The launcher in this suite: only a test marked `server` starts a server (tests/conftest.py).

A launcher that records its starts stands in for the fork server: the refusal comes before any
process is made, and a start that passes runs a real process (one that exits at once). A process
the test starts (a benchmark, say) is refused too: the refusal is in the environment.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from ffn_testing import Process, ServerFailed, StartRefused, start_server, use_launcher

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def launched() -> Iterator[list[Sequence[str]]]:
    """The argv of every start from here on, each run as a process that exits 0 at once."""
    starts: list[Sequence[str]] = []

    def launcher(argv: Sequence[str], env: Mapping[str, str], cwd: str | Path | None, log: Path) -> Process:
        starts.append(argv)
        return subprocess.Popen([sys.executable, "-c", "pass"])

    previous = use_launcher(launcher)
    try:
        yield starts
    finally:
        use_launcher(previous)


def test_a_test_not_marked_server_is_refused_a_start_before_any_process(launched: list[Sequence[str]]) -> None:
    with pytest.raises(StartRefused) as refused:
        start_server()
    assert str(refused.value).startswith(
        "tests/test_launcher.py::test_a_test_not_marked_server_is_refused_a_start_before_any_process "
        "starts a server but is not marked server: mark this test server (@pytest.mark.server"
    )
    assert launched == []


def test_a_process_a_test_not_marked_server_starts_is_refused_too() -> None:
    code = "from ffn_testing import start_server; start_server()"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "ffn_testing.launcher.StartRefused: tests/test_launcher.py::"
            "test_a_process_a_test_not_marked_server_starts_is_refused_too starts a server but is not marked server"
        )
    )


@pytest.mark.server
def test_a_test_marked_server_may_start_one(launched: list[Sequence[str]]) -> None:
    with pytest.raises(ServerFailed, match="exited with 0 while starting"):
        start_server()
    assert len(launched) == 1 and "--port" in launched[0]
