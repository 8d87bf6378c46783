"""The suite's fork server (tests/forkserver.py): a forked start is a real server, and what a fork
cannot give a start is started the plain way."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from ffn_client import Client
from ffn_testing import SERVE_COMMAND, start_server, use_launcher
from tests.forkserver import Forked, ForkServer
from tests.reference import assert_close, demo_reference

# Every test here starts the suite's fork server, a process that imports the whole server (or servers from it).
pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def forks() -> Iterator[ForkServer]:
    """A fork server of this file's own (each costs an import of the server: 3 s of CPU), the
    launcher while its tests run."""
    own = ForkServer()
    previous = use_launcher(own.launch)
    try:
        yield own
    finally:
        use_launcher(previous)
        own.close()


def test_a_forked_start_serves_right_and_its_sigterm_exit_is_reported(forks: ForkServer) -> None:
    x = np.linspace(-2, 2, 3 * 512, dtype=np.float32).reshape(3, 512)
    with start_server(env={"FFN_WARMUP": "0", "FFN_MAX_BATCH_ROWS": "8"}) as server:
        assert isinstance(server.proc, Forked)
        assert server.proc.poll() is None
        with Client(server.url) as client:
            assert_close(client.transform("demo", x), demo_reference(x.astype(np.float64)))
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes()
        assert b"tests.forkserver" in cmdline  # the fork, not a fresh interpreter
    assert server.returncode == 0  # the drain's exit, asked of the fork server


def test_a_killed_fork_reports_the_signal_as_popen_does(forks: ForkServer) -> None:
    server = start_server(env={"FFN_WARMUP": "0"})
    server.proc.kill()
    assert server.proc.wait(30) == -signal.SIGKILL
    server.returncode = -signal.SIGKILL


def test_the_start_takes_its_own_environment_and_folder(forks: ForkServer, tmp_path: Path) -> None:
    with start_server(env={"FFN_WARMUP": "0", "FFN_LOG_LEVEL": "warning"}, cwd=tmp_path) as server:
        assert isinstance(server.proc, Forked)
        assert os.readlink(f"/proc/{server.pid}/cwd") == str(tmp_path)
        assert httpx.get(f"{server.url}/v2/health/ready", timeout=30).status_code == 200
        assert " INFO " not in server.logs()  # its FFN_LOG_LEVEL, not the fork server's


def test_what_a_fork_cannot_give_is_started_the_plain_way(forks: ForkServer, tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.touch()
    base = {k: v for k, v in os.environ.items() if not k.startswith("FFN_")} | {"PYTHONUNBUFFERED": "1"}
    plain = [
        ([*SERVE_COMMAND, "--version"], {**base, "MALLOC_ARENA_MAX": "2"}),  # read by glibc as it loads
        ([*SERVE_COMMAND, "--version"], {**base, "FFN_WORKERS": "2"}),  # a supervisor imports no torch
        ([*SERVE_COMMAND, "--workers", "2", "--version"], base),
        (["env", *SERVE_COMMAND, "--version"], base),  # a prefix
    ]
    for argv, env in plain:
        proc = forks.launch(argv, env, None, log)
        assert isinstance(proc, subprocess.Popen), argv
        assert proc.wait(60) == 0
    forked = forks.launch([*SERVE_COMMAND, "--version"], base, None, log)
    assert isinstance(forked, Forked)
    assert forked.wait(60) == 0
    # Read only when used: a start that differs in these alone is still a fork. torch sets the
    # first in the test process at its first torch.compile; had it made every later start a plain
    # one, a run would have started 15 servers the slow way.
    used_later = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TMPDIR": str(tmp_path)} | {
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_SERVICE_NAME": "forked",
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "1",
    }
    forked = forks.launch([*SERVE_COMMAND, "--version"], {**base, **used_later}, None, log)
    assert isinstance(forked, Forked)
    assert forked.wait(60) == 0
