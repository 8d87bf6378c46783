"""The supervisor's bookkeeping, without worker processes: its loop runs on a controlled clock."""

from __future__ import annotations

import logging
import math
import multiprocessing
import socket
from collections.abc import Sequence
from multiprocessing.connection import Connection
from types import SimpleNamespace

import pytest

from app.config.settings import Settings
from app.control import ALIVE, APPLIED, HEARTBEAT, Reply
from app.process.listeners import Listeners
from app.process.liveness import DRAIN_OVERDUE, SILENT, STARTING_SILENCE_S, TURN_S, drain_allowance_s, verdict
from app.process.supervisor import Supervisor


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
    """What the supervisor's watch uses of a worker process: its pid, terminate() and kill()."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.sentinel = object()  # never ready: the fake never exits
        self.kills = 0
        self.terms = 0

    def kill(self) -> None:
        self.kills += 1

    def terminate(self) -> None:
        self.terms += 1

    def is_alive(self) -> bool:
        return True


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
    assert [verdict(slot, supervisor.settings) for slot in supervisor._slots] == [(160.0, "late", True)] * 2
    with caplog.at_level(logging.ERROR, logger="ffn_serve"):
        supervisor._judge(159.9)
        assert (first.kills, second.kills) == (0, 0)
        supervisor._judge(160.0)
        assert (first.kills, second.kills) == (1, 1)
        supervisor._judge(200.0)  # killed once: its exit is on the way
        assert (first.kills, second.kills) == (1, 1)
    assert "worker 1 (pid 1001) was not ready 60.0 s after its start (worker_start_timeout_s 60)" in caplog.text
    assert caplog.text.count("killing it") == 2


def test_a_starting_worker_whose_beats_stop_is_killed_before_its_deadline(caplog: pytest.LogCaptureFixture) -> None:
    supervisor, (stopped, beating) = watched(worker_start_timeout_s=300.0)
    supervisor._slots[0].beat_at = 110.0  # then SIGSTOP: no more beats
    supervisor._slots[1].beat_at = 139.0
    with caplog.at_level(logging.ERROR, logger="ffn_serve"):
        supervisor._judge(110.0 + STARTING_SILENCE_S - 0.1)
        assert stopped.kills == 0
        supervisor._judge(110.0 + STARTING_SILENCE_S)
    assert (stopped.kills, beating.kills) == (1, 0)
    assert f"worker 1 (pid 1001) sent no heartbeat for {STARTING_SILENCE_S:.1f} s while starting" in caplog.text


def test_a_silent_ready_worker_is_asked_to_drain_then_killed_if_it_stays_silent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Issue 28, class 8: a worker whose loop was held (busy, not hung) was SIGKILLed at once, and
    # the request it was running never got an answer. A drain answers it if the loop comes back.
    supervisor, (ready, _) = watched(heartbeat_timeout_s=5.0, worker_start_timeout_s=60.0)
    slot = supervisor._slots[0]
    slot.ready, slot.beat_at = True, 500.0  # long past its start deadline, beating
    supervisor._slots[1].process = None  # the other slot is empty
    assert verdict(slot, supervisor.settings) == (505.0, SILENT, False)
    with caplog.at_level(logging.ERROR, logger="ffn_serve"):
        supervisor._judge(504.9)
        assert (ready.terms, ready.kills) == (0, 0)
        supervisor._judge(505.0)
        assert (ready.terms, ready.kills) == (1, 0)
        supervisor._judge(509.9)
        assert (ready.terms, ready.kills) == (1, 0)
        supervisor._judge(510.0)
        assert (ready.terms, ready.kills) == (1, 1)
    assert "worker 1 (pid 1001) sent no heartbeat for 5.0 s (heartbeat_timeout_s) while" in caplog.text
    assert "asking it to drain (SIGTERM)" in caplog.text
    assert "sent no heartbeat for 5.0 s more after it was asked to drain" in caplog.text
    assert "the requests it holds are lost" in caplog.text


def test_a_worker_asked_to_drain_that_beats_again_drains_to_the_drains_deadline() -> None:
    supervisor, (ready, _) = watched(heartbeat_timeout_s=5.0, drain_timeout_s=20.0)
    slot = supervisor._slots[0]
    slot.ready, slot.beat_at = True, 500.0
    supervisor._judge(505.0)
    slot.beat_at = 508.0  # its loop came back: it drains what it accepted
    allowance = drain_allowance_s(supervisor.settings)
    assert allowance > 20.0
    assert verdict(slot, supervisor.settings) == (505.0 + allowance, DRAIN_OVERDUE, True)
    supervisor._judge(505.0 + allowance - 0.1)
    assert (ready.terms, ready.kills) == (1, 0)
    supervisor._judge(505.0 + allowance)
    assert (ready.terms, ready.kills) == (1, 1)


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


def test_the_pipe_is_read_dry_before_a_worker_is_judged_and_its_beats_are_answered() -> None:
    # Issue 28, class 8: one message read per wake-up; after a pause, a worker whose pipe began with
    # a broadcast's reply rather than a beat was judged on its beat from before the pause.
    supervisor, _ = watched()
    slot = supervisor._slots[0]
    ours, theirs = multiprocessing.Pipe()
    slot.conn = ours
    theirs.send((APPLIED, 99, Reply(1, ok=True)))  # for a broadcast the relay no longer waits for
    theirs.send((HEARTBEAT,))
    theirs.send((HEARTBEAT,))
    supervisor._receive(slot)
    assert slot.beat_at is not None and not ours.poll()
    assert theirs.recv() == (ALIVE,)  # one answer for the beats of one wake-up
    assert not theirs.poll()


# ----- the supervisor's loop on a controlled clock ------------------------------------------------


class Script:
    """The supervisor loop's clock and its waits: each wait lasts as the test says, and the workers
    named for it send a heartbeat meanwhile. When the script ends, so does the loop."""

    def __init__(self, supervisor: Supervisor, steps: Sequence[tuple[float, Sequence[int]]]) -> None:
        self.now = 100.0
        self.steps = list(steps)
        self.workers: dict[int, Connection] = {}
        self.waits: list[float] = []
        for slot in supervisor._slots:
            ours, theirs = multiprocessing.Pipe()
            slot.conn, slot.ready, slot.beat_at = ours, True, self.now
            self.workers[slot.index] = theirs

    def monotonic(self) -> float:
        return self.now

    def wait(self, waitables: list[object], timeout: float | None) -> list[object]:
        if not self.steps:
            raise Finished
        self.waits.append(math.inf if timeout is None else timeout)
        lasts, beating = self.steps.pop(0)
        self.now += lasts
        for index in beating:
            self.workers[index].send((HEARTBEAT,))
        return [each for each in waitables if isinstance(each, Connection) and each.poll()]


class Finished(Exception):
    """The script has run out."""


def run(supervisor: Supervisor, script: Script, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("app.process.supervisor.time", SimpleNamespace(monotonic=script.monotonic))
    monkeypatch.setattr("app.process.supervisor.wait", script.wait)
    wakeup, other = socket.socketpair()
    with pytest.raises(Finished):
        supervisor._loop(wakeup)
    wakeup.close()
    other.close()


def normal(seconds: float, beating: Sequence[int]) -> list[tuple[float, Sequence[int]]]:
    """`seconds` of the supervisor running, waking every TURN_S, hearing from the workers `beating`."""
    return [(TURN_S, beating)] * round(seconds / TURN_S)


def test_a_supervisor_paused_longer_than_the_heartbeat_timeout_kills_nobody(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Issue 28, class 8: paused 40 s (SIGSTOP, starved, its machine paused), the supervisor killed
    # both healthy workers on resuming: it counted its own pause as their silence. Here it resumes
    # before they do (a paused machine: the workers have not yet run to beat), and they beat a
    # second later.
    supervisor, processes = watched(heartbeat_timeout_s=5.0)
    script = Script(supervisor, [*normal(2.0, [1, 2]), (40.0, []), *normal(1.0, []), *normal(10.0, [1, 2])])
    with caplog.at_level(logging.WARNING, logger="ffn_serve"):
        run(supervisor, script, monkeypatch)
    assert [(p.terms, p.kills) for p in processes] == [(0, 0), (0, 0)], caplog.text
    assert max(script.waits) <= TURN_S  # the loop wakes at least every TURN_S, so a later wake is a pause
    assert "the supervisor did not run for 39.5 s" in caplog.text


def test_a_worker_is_judged_silent_only_over_time_the_supervisor_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    # Worker 2 stops beating: 3 s of the supervisor running, a 40 s wait of which it ran at most
    # TURN_S (a later wake is a pause), then 1 s running make 4.5 s of silence, short of the 5 s
    # timeout; 0.5 s more, and it is asked to drain; silent 5 s more (another pause between), it is
    # killed. Worker 1 beats throughout, and is left alone.
    supervisor, (one, two) = watched(heartbeat_timeout_s=5.0)
    script = Script(supervisor, [*normal(3.0, [1]), (40.0, [1]), *normal(1.0, [1])])
    run(supervisor, script, monkeypatch)
    assert [(p.terms, p.kills) for p in (one, two)] == [(0, 0), (0, 0)]
    script.steps = normal(0.5, [1])
    run(supervisor, script, monkeypatch)
    assert (two.terms, two.kills) == (1, 0)
    script.steps = [*normal(2.0, [1]), (30.0, [1]), *normal(2.0, [1])]
    run(supervisor, script, monkeypatch)
    assert (two.terms, two.kills) == (1, 0)
    script.steps = normal(0.5, [1])
    run(supervisor, script, monkeypatch)
    assert [(p.terms, p.kills) for p in (one, two)] == [(0, 0), (1, 1)]
