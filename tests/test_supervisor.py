"""The supervisor's bookkeeping, without worker processes."""

from __future__ import annotations

import logging
import socket

import pytest

from app.listeners import Listeners
from app.settings import Settings
from app.supervisor import Supervisor


def test_a_worker_ready_after_the_stop_began_announces_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """SIGTERM while a worker still warms up: its late READY must not log the closed sockets (EBADF, exit 1)."""
    listening = socket.create_server(("127.0.0.1", 0))
    supervisor = Supervisor(Settings(workers=2, warmup=False), Listeners(listening))
    supervisor._stop(None)  # what SIGTERM does first: the listening sockets close
    assert listening.fileno() == -1
    with caplog.at_level(logging.INFO, logger="ffn_serve"):
        for slot in supervisor._slots:
            supervisor._ready(slot)
    assert "worker 2 (pid None) ready" in caplog.text
    assert "listening on" not in caplog.text and "ready: 2 workers" not in caplog.text
