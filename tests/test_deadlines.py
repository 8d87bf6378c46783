"""A connection's deadlines on one timer (app/http/transport/budgets.py: Deadlines), driven by a hand-turned clock."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest

from app.http.transport.budgets import Deadlines


class Timer:
    def __init__(self, at: float, callback: Callable[[], None]) -> None:
        self.at, self.callback, self.cancelled = at, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class HandTurnedLoop:
    """The two members Deadlines uses: time() and call_at(); `advance` runs what comes due, in order."""

    def __init__(self) -> None:
        self.now = 100.0
        self.timers: list[Timer] = []

    def time(self) -> float:
        return self.now

    def call_at(self, at: float, callback: Callable[[], None]) -> Timer:
        timer = Timer(at, callback)
        self.timers.append(timer)
        return timer

    def armed(self) -> list[Timer]:
        return [t for t in self.timers if not t.cancelled and t.at != -1]

    def advance(self, seconds: float) -> None:
        end = self.now + seconds
        while True:
            due = sorted((t for t in self.armed() if t.at <= end), key=lambda t: t.at)
            if not due:
                break
            timer = due[0]
            self.now = max(self.now, timer.at)
            timer.at = -1  # ran
            timer.callback()
        self.now = end


@pytest.fixture
def clock() -> HandTurnedLoop:
    return HandTurnedLoop()


def deadlines_on(clock: HandTurnedLoop, calls: list[str]) -> Deadlines:
    return Deadlines(cast(Any, clock), (lambda: calls.append("head"), lambda: calls.append("keep-alive")))


def test_a_deadline_that_passes_calls_its_handler_once(clock: HandTurnedLoop) -> None:
    calls: list[str] = []
    deadlines = deadlines_on(clock, calls)
    deadlines.set(0, 10.0)
    clock.advance(9.9)
    assert calls == []
    clock.advance(0.2)
    assert calls == ["head"]
    clock.advance(100.0)
    assert calls == ["head"] and not deadlines.is_set(0)


def test_a_cleared_deadline_calls_nothing(clock: HandTurnedLoop) -> None:
    calls: list[str] = []
    deadlines = deadlines_on(clock, calls)
    deadlines.set(0, 10.0)
    deadlines.set(1, 5.0)
    deadlines.clear(0)
    clock.advance(20.0)
    assert calls == ["keep-alive"]


def test_requests_that_move_the_deadlines_arm_one_timer_per_period_not_two_per_request(clock: HandTurnedLoop) -> None:
    calls: list[str] = []
    deadlines = deadlines_on(clock, calls)
    # 1,000 requests over 10 s, each clearing both deadlines as it arrives and setting them when answered.
    for _ in range(1000):
        deadlines.clear(1)
        deadlines.clear(0)
        clock.advance(0.01)
        deadlines.set(1, 5.0)
        deadlines.set(0, 10.0)
    assert calls == []
    assert len(clock.timers) <= 4  # the first arming, and one per 5 s period that found nothing due
    # Then the connection goes quiet: keep-alive first, at 5 s after the last answer, then the head's.
    clock.advance(5.1)
    assert calls == ["keep-alive"]
    clock.advance(5.0)
    assert calls == ["keep-alive", "head"]


def test_a_deadline_moved_sooner_than_the_timer_arms_it_sooner(clock: HandTurnedLoop) -> None:
    calls: list[str] = []
    deadlines = deadlines_on(clock, calls)
    deadlines.set(0, 10.0)
    deadlines.set(1, 1.0)
    clock.advance(1.5)
    assert calls == ["keep-alive"]
    assert len(clock.armed()) == 1 and clock.armed()[0].at == pytest.approx(110.0)


def test_a_handler_that_sets_its_deadline_again_is_called_again_later(clock: HandTurnedLoop) -> None:
    calls: list[str] = []
    deadlines: Deadlines

    def head() -> None:
        calls.append("head")
        if len(calls) < 3:
            deadlines.set(0, 2.0)  # as the head timeout does while a held loop's bytes wait unread

    deadlines = Deadlines(cast(Any, clock), (head, lambda: None))
    deadlines.set(0, 2.0)
    clock.advance(2.1)
    assert calls == ["head"]
    clock.advance(2.0)
    assert calls == ["head", "head"]
    clock.advance(10.0)
    assert calls == ["head", "head", "head"]


def test_a_timer_a_moment_early_counts_as_due_and_is_not_armed_again(clock: HandTurnedLoop) -> None:
    calls: list[str] = []
    deadlines = deadlines_on(clock, calls)
    deadlines.set(0, 1.0)
    timer = clock.armed()[0]
    clock.now = timer.at - 0.0005  # the loop's clock resolution: it fires this early
    timer.at = -1
    timer.callback()
    assert calls == ["head"] and clock.armed() == []


def test_close_cancels_the_timer_and_every_deadline(clock: HandTurnedLoop) -> None:
    calls: list[str] = []
    deadlines = deadlines_on(clock, calls)
    deadlines.set(0, 1.0)
    deadlines.set(1, 2.0)
    deadlines.close()
    assert clock.armed() == []
    clock.advance(10.0)
    assert calls == []
