"""The budgets of one serving process across its connections, and each connection's timeouts: bookkeeping, no sockets.

**ConnectionBudget.** The connection cap of one serving process, kept so that slow or silent clients cannot fill it.

Every open connection counts against `max_connections`. Of those, two kinds cost a client nothing
to hold, and are bounded here besides:

- idle ones (nothing unanswered, no byte of a next request yet): at the cap, a new connection
  closes the one idle longest instead of being refused (as a keep-alive timeout would, only sooner);
- receiving ones (a request begun whose head or body has not all arrived, when a read ends):
  at most half the cap. A request that arrives in one read, the common case, never counts.

Slow heads make room; complete requests never do. Among the receiving connections, those whose
head is still incomplete are kept in the order their heads began: when a connection needs a
receiving place and none is left, or a new connection finds the cap reached and none idle, the
connection whose head began longest ago and is still not whole (the one whose head has made the
least progress) is closed for it. A head that trickles in a line every second or two is that one;
a client's head arrives in microseconds. Only when no head is incomplete (every receiving
connection is sending a body, which `min_body_rate` bounds) is the newcomer refused with 503.

What is left holding the cap is work the server itself does (a request in the queue, an answer
being sent), which the queue, the deadlines and the send timeout bound. Pure bookkeeping: no
sockets, no clock; `tests/test_protocol.py` drives it with fake connections.

**PipelineTurns.** Pipelined requests take turns: one a turn of the event loop, across the whole process.

A client that pipelines (HTTP/1.1: it sends its next request before reading the answer to the
last) hands the server a backlog it never waits on. Served as soon as each answer goes out, every
pipelining connection adds a request's work to every turn of the event loop; with a few dozen of
them each turn lasts tens of milliseconds, and every other request, which needs several turns
(its read, its task, its batch, its answer), waits that long at each. So a pipelined request,
once the answer before it has gone out, asks for a turn here instead of starting at once
(app/http/transport/protocol.py), and the turns are handed out one a loop iteration, in the order asked:
however many connections pipeline, together they add at most one request's start to each turn.

Clients that wait for their answers (every ordinary client) never take a turn here. A pipelining
client still gets every answer, in order; when nothing else is going on, at the loop's pace.
Pure bookkeeping and one loop callback; `tests/test_protocol.py` drives it with fake connections
and real ones.

**Deadlines.** A connection's timeouts on one timer, so that a request moves them without touching a timer.

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
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

from app.protocol.admission import TIMER_EARLY_S

Connection = TypeVar("Connection")


class ConnectionBudget(Generic[Connection]):
    """Which of a process's open connections are idle and which are still receiving a request."""

    def __init__(self, max_connections: int) -> None:
        self.max_connections = max_connections
        self.max_receiving = max(1, max_connections // 2)
        self._open: set[Connection] = set()
        self._idle: OrderedDict[Connection, None] = OrderedDict()  # oldest first
        self._receiving: set[Connection] = set()
        self._heads: OrderedDict[Connection, None] = OrderedDict()  # receiving, head incomplete: oldest head first

    @property
    def open(self) -> int:
        return len(self._open)

    @property
    def receiving(self) -> int:
        return len(self._receiving)

    def opened(self, connection: Connection) -> tuple[bool, Connection | None]:
        """A new connection: (admitted, the connection to close to make room for it, if any): the one idle
        longest, else the oldest incomplete head; with neither, it is not admitted."""
        victim = None
        if len(self._open) >= self.max_connections:
            if self._idle:
                victim, _ = self._idle.popitem(last=False)
            elif self._heads:
                victim, _ = self._heads.popitem(last=False)
            else:
                return False, None
            self._forget(victim)
        self._open.add(connection)
        self._idle[connection] = None
        return True, victim

    def idle(self, connection: Connection) -> None:
        """Nothing unanswered and no byte of a next request: the first to go when room is needed."""
        if connection in self._open:
            self._receiving.discard(connection)
            self._heads.pop(connection, None)
            self._idle[connection] = None
            self._idle.move_to_end(connection)

    def busy(self, connection: Connection) -> None:
        """A request is in the server's hands (queued, computed, or its answer being sent)."""
        self._idle.pop(connection, None)
        self._receiving.discard(connection)
        self._heads.pop(connection, None)

    def still_receiving(self, connection: Connection, *, in_head: bool) -> tuple[bool, Connection | None]:
        """A read ended inside a request (`in_head`: its head is not whole yet): (whether it may wait for the
        rest, the connection to close to make room for it, if any: the oldest incomplete head)."""
        self._idle.pop(connection, None)
        if connection in self._receiving:
            if not in_head:
                self._heads.pop(connection, None)  # its head is whole now: never the one closed for room
            return True, None
        victim = None
        if len(self._receiving) >= self.max_receiving:
            victim = next((head for head in self._heads if head is not connection), None)
            if victim is None:
                return False, None
            self._forget(victim)
        self._receiving.add(connection)
        if in_head:
            self._heads[connection] = None
        return True, victim

    def closed(self, connection: Connection) -> None:
        self._forget(connection)

    def _forget(self, connection: Connection) -> None:
        self._open.discard(connection)
        self._idle.pop(connection, None)
        self._receiving.discard(connection)
        self._heads.pop(connection, None)


class TakesTurns(Protocol):
    def take_turn(self) -> None:
        """Start the next pipelined request (and parse what was held behind it)."""


class PipelineTurns:
    """The connections waiting to start a pipelined request, first asked first served, one a loop turn."""

    def __init__(self) -> None:
        self._waiting: OrderedDict[TakesTurns, None] = OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False

    def __len__(self) -> int:
        return len(self._waiting)

    def ask(self, connection: TakesTurns, loop: asyncio.AbstractEventLoop) -> None:
        """Queue `connection` for a turn (once, however often it asks before its turn comes)."""
        self._waiting[connection] = None
        self._loop = loop
        self._schedule()

    def withdraw(self, connection: TakesTurns) -> None:
        """A connection that closed, or no longer has a pipelined request to start."""
        self._waiting.pop(connection, None)

    def _schedule(self) -> None:
        # call_soon from within a callback runs in the loop's next iteration, after what that
        # iteration already holds: one turn per iteration.
        if not self._scheduled and self._waiting and self._loop is not None:
            self._scheduled = True
            self._loop.call_soon(self._turn)

    def _turn(self) -> None:
        self._scheduled = False
        if self._waiting:
            connection, _ = self._waiting.popitem(last=False)
            try:
                connection.take_turn()
            finally:
                self._schedule()


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
        now = self._loop.time() + TIMER_EARLY_S  # a deadline that close is due
        for which, due in enumerate(self._due):
            if due <= now and self._due[which] == due:  # an earlier handler may have moved or cleared it
                self._due[which] = math.inf
                self._handlers[which]()
        earliest = min(self._due)
        if earliest < self._timer_at:  # a handler may have armed the timer already
            self._arm(earliest)
