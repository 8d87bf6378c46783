"""LoopWatch: a tick on the event loop that measures how late it runs, and beats for the supervisor.

A serving process's event loop can be held: a huge JSON body parsed, a bug that blocks, a
debugger, a SIGSTOP. While it is held nothing is answered, readiness included; once it runs
again, a tick that was due meanwhile runs late by about as long. The watch keeps the worst
lateness of the last LAG_MEMORY_S seconds, which readiness reports past `max_loop_lag_s` (so a
probe answered just after the loop was held still hears of it), and calls `beat` on every tick:
in a worker, a heartbeat to the supervisor, which replaces a worker whose beats stop
(app/process/supervisor.py). A tick comes every min(0.5 s, max_loop_lag_s / 2), so a hold longer than
the bound always spans one. The tick is a timer callback, not a task: a timer that fell due
while the loop was held runs in the loop's very next turn, before any request that turn reads.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

MAX_TICK_S = 0.5
LAG_MEMORY_S = 5.0  # readiness remembers a held loop this long after it ran again


class LoopWatch:
    def __init__(self, max_lag_s: float, beat: Callable[[], None] | None = None) -> None:
        self.max_lag_s = max_lag_s
        self.tick_s = min(MAX_TICK_S, max_lag_s / 2)
        self._beat = beat
        self._lags: deque[tuple[float, float]] = deque()  # (when, how late), over the bound only
        self._due = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Tick on the running loop until stop()."""
        self._due = time.monotonic() + self.tick_s
        self._timer = asyncio.get_running_loop().call_later(self.tick_s, self._tick)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._due > self.max_lag_s:
            self._lags.append((now, now - self._due))
        self._due = now + self.tick_s
        self._timer = asyncio.get_running_loop().call_later(self.tick_s, self._tick)
        if self._beat is not None:
            self._beat()

    def lagging(self) -> str | None:
        """Why readiness should say no (the loop was held past the bound lately), or None."""
        now = time.monotonic()
        while self._lags and now - self._lags[0][0] > LAG_MEMORY_S:
            self._lags.popleft()
        if not self._lags:
            return None
        worst = max(lag for _, lag in self._lags)
        return (
            f"the event loop was held for {worst:.2f} s in the last {LAG_MEMORY_S:g} s "
            f"(more than max_loop_lag_s, {self.max_lag_s:g} s)"
        )
