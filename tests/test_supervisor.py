"""The supervisor's bookkeeping, without worker processes."""

from __future__ import annotations

import logging
import multiprocessing
import socket

import pytest

from app.control import HEARTBEAT
from app.listeners import Listeners
from app.settings import Settings
from app.supervisor import STARTING_SILENCE_S, Supervisor


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


class FakeProcess:
    """What the supervisor's watch uses of a worker process: its pid, and kill()."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.kills = 0

    def kill(self) -> None:
        self.kills += 1


def watched(**settings: object) -> tuple[Supervisor, list[FakeProcess]]:
    """A supervisor of two workers started at time 100, not ready, with no heartbeat yet."""
    supervisor = Supervisor(
        Settings(workers=2, warmup=False, **settings), Listeners(socket.create_server(("127.0.0.1", 0)))
    )
    processes = [FakeProcess(1000 + slot.index) for slot in supervisor._slots]
    for slot, process in zip(supervisor._slots, processes, strict=True):
        slot.process = process  # type: ignore[assignment]
        slot.started_at = 100.0
    return supervisor, processes


def test_a_worker_not_ready_within_the_start_timeout_is_killed_once(caplog: pytest.LogCaptureFixture) -> None:
    # Issue 20, class 8, while loading: a worker hung before it was ready was never watched.
    supervisor, (first, second) = watched(worker_start_timeout_s=60.0)
    supervisor._slots[1].beat_at = 159.0  # it beats, so it runs: but it is as late as the first
    assert supervisor._timeout() is not None
    with caplog.at_level(logging.ERROR, logger="ffn_serve"):
        supervisor._kill_the_silent(159.9)
        assert (first.kills, second.kills) == (0, 0)
        supervisor._kill_the_silent(160.0)
        assert (first.kills, second.kills) == (1, 1)
        supervisor._kill_the_silent(200.0)  # killed once: its exit is on the way
        assert (first.kills, second.kills) == (1, 1)
    assert "worker 1 (pid 1001) was not ready 60.0 s after its start (worker_start_timeout_s 60)" in caplog.text
    assert caplog.text.count("killing it") == 2


def test_a_starting_worker_whose_beats_stop_is_killed_before_its_deadline(caplog: pytest.LogCaptureFixture) -> None:
    supervisor, (stopped, beating) = watched(worker_start_timeout_s=300.0)
    supervisor._slots[0].beat_at = 110.0  # then SIGSTOP: no more beats
    supervisor._slots[1].beat_at = 139.0
    with caplog.at_level(logging.ERROR, logger="ffn_serve"):
        supervisor._kill_the_silent(110.0 + STARTING_SILENCE_S - 0.1)
        assert stopped.kills == 0
        supervisor._kill_the_silent(110.0 + STARTING_SILENCE_S)
    assert (stopped.kills, beating.kills) == (1, 0)
    assert f"worker 1 (pid 1001) sent no heartbeat for {STARTING_SILENCE_S:.1f} s while starting" in caplog.text


def test_a_ready_worker_is_held_to_the_heartbeat_timeout_and_no_start_deadline() -> None:
    supervisor, (ready, _) = watched(heartbeat_timeout_s=5.0, worker_start_timeout_s=60.0)
    slot = supervisor._slots[0]
    slot.ready, slot.beat_at = True, 500.0  # long past its start deadline, beating
    supervisor._slots[1].process = None  # the other slot is empty
    assert supervisor._timeout() is not None
    supervisor._kill_the_silent(504.9)
    assert ready.kills == 0
    supervisor._kill_the_silent(505.0)
    assert ready.kills == 1


def test_heartbeats_count_from_the_start_but_not_after_a_kill() -> None:
    supervisor, _ = watched()
    slot = supervisor._slots[0]
    ours, theirs = multiprocessing.Pipe()
    slot.conn = ours
    theirs.send((HEARTBEAT,))
    supervisor._receive(slot)
    assert slot.beat_at is not None  # a starting worker's beat is counted
    slot.killed, slot.beat_at = True, None
    theirs.send((HEARTBEAT,))
    supervisor._receive(slot)
    assert slot.beat_at is None
