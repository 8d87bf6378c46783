"""Deadlines: a connection's timeouts on one timer, so that a request moves them without touching a timer.

A keep-alive connection has two timeouts that restart with every request: the keep-alive close
(idle this long after an answer) and the head timeout (a head whole this long after an answer).
As a timer each, every request armed two and cancelled two: some 2.3 µs a pair with uvloop, about
5 µs of a request's CPU on this project's machine. Here a deadline is a float: setting it or
clearing it is an assignment, and one timer per connection is armed for the earliest deadline.
A deadline moved later leaves the timer where it is; when the timer fires before anything is due,
it is armed again for the earliest deadline still set. So a connection busy with requests wakes
once per period (seconds), not twice per request.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence

# A timer may fire up to the loop's clock resolution early (asyncio's, uvloop's: a millisecond);
# a deadline that close is due, so that the timer is not armed again for a moment's wait.
EARLY_S = 0.002


class Deadlines:
    """Numbered deadlines on one timer; each calls its handler once, when it passes, unless cleared first."""

    def __init__(self, loop: asyncio.AbstractEventLoop, handlers: Sequence[Callable[[], None]]) -> None:
        self._loop = loop
        self._handlers = tuple(handlers)
        self._due: list[float] = [math.inf] * len(self._handlers)  # loop.time(); inf: not set
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def set(self, which: int, delay_s: float) -> None:
        """Deadline `which` is `delay_s` from now (replacing where it was)."""
        due = self._loop.time() + delay_s
        self._due[which] = due
        if due < self._timer_at:
            self._arm(due)

    def clear(self, which: int) -> None:
        """Deadline `which` is not set: its handler is not called (the timer, if armed, fires and finds nothing due)."""
        self._due[which] = math.inf

    def is_set(self, which: int) -> bool:
        return self._due[which] != math.inf

    def close(self) -> None:
        """No deadline any more, and no timer: the connection is gone."""
        self._due = [math.inf] * len(self._handlers)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = math.inf

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = self._loop.call_at(at, self._fire)

    def _fire(self) -> None:
        self._timer, self._timer_at = None, math.inf
        now = self._loop.time() + EARLY_S
        for which, due in enumerate(self._due):
            if due <= now and self._due[which] == due:  # an earlier handler may have moved or cleared it
                self._due[which] = math.inf
                self._handlers[which]()
        earliest = min(self._due)
        if earliest < self._timer_at:  # a handler may have armed the timer already
            self._arm(earliest)
