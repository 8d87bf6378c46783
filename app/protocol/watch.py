"""Watch: many waits of one fixed length on one timer, so that a wait costs an append and a flag.

A gRPC message must arrive within `read_timeout_s` of its room, and an answer be taken within
`send_timeout_s` of its return. As a timer each (asyncio.wait's timeout, a call_later), every call
armed and cancelled two: with uvloop some 2.3 µs a pair, and asyncio.wait's own bookkeeping on top.
Waits of one length end due in the order they start, so they queue in that order, and one timer,
armed for the oldest wait still running, serves them all. Ending a wait marks its ticket; ended
tickets leave the queue from its head (as waits start, and when the timer fires), and the queue is
compacted when ended ones behind a long wait outnumber the live ones, so that it holds about as
many tickets as waits are running.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

# A timer may fire up to the loop's clock resolution early (uvloop's: a millisecond): a wait due
# that soon is late, so that the timer is not armed again for a moment's wait.
EARLY_S = 0.002
COMPACT_AT = 64  # tickets queued before the queue is looked at for ended ones behind its head


class Ticket:
    """One wait: `end()` it when what it waited for came; else its `on_late` is called once, when it is due."""

    __slots__ = ("due", "ended", "on_late")

    def __init__(self, due: float, on_late: Callable[[], None]) -> None:
        self.due = due
        self.on_late = on_late
        self.ended = False

    def end(self) -> None:
        self.ended = True


class Watch:
    """Waits of `length_s` each, on one timer of the running loop."""

    def __init__(self, length_s: float) -> None:
        self.length_s = length_s
        self._queue: deque[Ticket] = deque()  # in the order they are due
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        """Tickets queued (ended ones not yet dropped included)."""
        return len(self._queue)

    def start(self, on_late: Callable[[], None]) -> Ticket:
        """A wait from now: `on_late()` in `length_s` unless the ticket is ended first."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a first wait, or a new loop (a test's): the old one's timer is gone
            self._loop, self._timer = loop, None
        ticket = Ticket(loop.time() + self.length_s, on_late)
        queue = self._queue
        while queue and queue[0].ended:
            queue.popleft()
        if len(queue) >= COMPACT_AT and not len(queue) & (len(queue) - 1):  # at 64, 128, 256, ...: rarely
            live = [waiting for waiting in queue if not waiting.ended]
            if 2 * len(live) < len(queue):
                self._queue = queue = deque(live)
        queue.append(ticket)
        if self._timer is None:
            self._timer = loop.call_at(queue[0].due, self._fire)
        return ticket

    def _fire(self) -> None:
        self._timer = None
        loop = self._loop
        if loop is None:
            return
        now = loop.time() + EARLY_S
        queue = self._queue
        while queue:
            head = queue[0]
            if head.ended:
                queue.popleft()
            elif head.due <= now:
                queue.popleft()
                head.ended = True
                head.on_late()
            else:
                break
        if queue and self._timer is None:
            self._timer = loop.call_at(queue[0].due, self._fire)
