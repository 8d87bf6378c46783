"""Liveness on its own (app/process/liveness.py): the verdicts on a worker, and a stretch the supervisor did not run.

No processes and no clock: a Slot's times are plain numbers, as the supervisor's loop would set them.
"""

from __future__ import annotations

import pytest

from app.config.settings import Settings
from app.process.liveness import (
    DRAIN_OVERDUE,
    LATE,
    SILENT,
    SILENT_DRAINING,
    SILENT_STARTING,
    STARTING_SILENCE_S,
    Slot,
    Verdict,
    drain_allowance_s,
    reason,
    verdict,
)

SETTINGS = Settings(heartbeat_timeout_s=5.0, worker_start_timeout_s=60.0, drain_timeout_s=20.0)


class Process:
    """A slot only asks whether it holds a process, and its pid."""

    pid = 4242


def slot(**times: object) -> Slot:
    return Slot(1, process=Process(), **times)  # type: ignore[arg-type]


# One slot in each state a verdict can name, and the verdict it gets.
STATES = {
    "ready": (slot(ready=True, started_at=0.0, beat_at=100.0), Verdict(105.0, SILENT, kill=False)),
    "asked to drain, silent": (
        slot(ready=True, started_at=0.0, beat_at=100.0, drain_asked_at=105.0),
        Verdict(110.0, SILENT_DRAINING, kill=True),
    ),
    "draining": (
        slot(ready=True, started_at=0.0, beat_at=107.0, drain_asked_at=105.0),
        Verdict(105.0 + drain_allowance_s(SETTINGS), DRAIN_OVERDUE, kill=True),
    ),
    "starting, beating": (
        slot(started_at=100.0, beat_at=101.0),
        Verdict(101.0 + STARTING_SILENCE_S, SILENT_STARTING, kill=True),
    ),
    "starting, no beat yet": (slot(started_at=100.0), Verdict(160.0, LATE, kill=True)),
}


@pytest.mark.parametrize("state", STATES)
def test_each_state_has_its_verdict(state: str) -> None:
    watched, expected = STATES[state]
    assert verdict(watched, SETTINGS) == expected


@pytest.mark.parametrize("state", STATES)
def test_a_stretch_the_supervisor_did_not_run_moves_the_verdict_on_by_its_length(state: str) -> None:
    # Issue 28, class 8: a supervisor paused 40 s counted the pause as its workers' silence.
    original, before = STATES[state]
    watched = Slot(**{**original.__dict__})
    watched.resumed(40.0)
    assert verdict(watched, SETTINGS) == before._replace(at=before.at + 40.0)


def test_a_ready_worker_without_a_beat_yet_and_a_killed_one_are_never_judged() -> None:
    assert verdict(slot(ready=True, beat_at=None), SETTINGS) is None
    assert verdict(slot(ready=True, beat_at=100.0, killed=True), SETTINGS) is None
    assert verdict(Slot(1), SETTINGS) is None


def test_a_starting_worker_is_killed_by_whichever_comes_first() -> None:
    # Beating until close to its start deadline: late comes first; silent early: the silence does.
    assert verdict(slot(started_at=100.0, beat_at=150.0), SETTINGS) == Verdict(160.0, LATE, kill=True)
    assert verdict(slot(started_at=100.0, beat_at=101.0), SETTINGS).what == SILENT_STARTING  # type: ignore[union-attr]


def test_the_drain_allowance_is_the_drain_the_close_grace_and_a_margin() -> None:
    assert drain_allowance_s(SETTINGS) > SETTINGS.drain_timeout_s
    assert drain_allowance_s(SETTINGS.model_copy(update={"drain_timeout_s": 30.0})) == drain_allowance_s(SETTINGS) + 10


def test_each_verdicts_log_line_says_why_and_what_follows() -> None:
    ready = slot(ready=True, beat_at=100.0)
    assert reason(ready, SILENT, 105.0, SETTINGS).startswith(
        "sent no heartbeat for 5.0 s (heartbeat_timeout_s) while the supervisor ran"
    )
    assert "asking it to drain (SIGTERM)" in reason(ready, SILENT, 105.0, SETTINGS)
    asked = slot(ready=True, beat_at=100.0, drain_asked_at=105.0)
    assert "the requests it holds are lost, their connections closed" in reason(asked, SILENT_DRAINING, 110.0, SETTINGS)
    assert reason(asked, DRAIN_OVERDUE, 140.0, SETTINGS).startswith("still runs 35.0 s after it was asked to drain")
    starting = slot(started_at=100.0)
    assert "(worker_start_timeout_s 60)" in reason(starting, LATE, 160.0, SETTINGS)
