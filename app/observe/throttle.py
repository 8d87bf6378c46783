"""How often a repeated event is logged: a client can repeat it as fast as it likes, the log must not follow."""

from __future__ import annotations

import time


class Throttle:
    """The first event is logged at once, then at most one line per `every_s`, with the count since the last line."""

    def __init__(self, every_s: float = 60.0) -> None:
        self._every_s = every_s
        self._next_line = 0.0
        self._since = 0

    def due(self) -> int:
        """Count one event; how many the line to log now reports (those since the last line), or 0: no line now."""
        self._since += 1
        now = time.monotonic()
        if now < self._next_line:
            return 0
        count, self._since, self._next_line = self._since, 0, now + self._every_s
        return count
