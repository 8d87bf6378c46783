"""Pipelined requests take turns: one a turn of the event loop, across the whole process.

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
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Protocol


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
