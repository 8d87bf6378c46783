"""Relay: the supervisor's part of app/control.py, passing broadcasts between worker processes.

A worker's BROADCAST goes to every worker that has a pipe (ready or still starting, the sender
too); each answers APPLIED; once all have, or have exited, or the broadcast's time is up, the
sender gets DONE with one Reply per worker. Sticky commands are kept, the latest per key, and
replayed in order to every worker started afterwards, before it takes traffic; a command that
forgets its key (a region unregistered) drops it, so only keys in use are kept. Every command is
numbered here (app/control.py: command_number), the one place that orders them, and kept with its number.
A broadcast taken up more than RELAY_WITHIN_S after it was sent (the supervisor was stopped or
starved meanwhile, and its sender may have stopped waiting: app/control.py) is dropped: nobody
applies it, nothing is kept or numbered, and its sender gets DONE with every worker's refusal
saying why.

Pure bookkeeping over the workers' pipes: no processes, no clock of its own (the supervisor's
loop passes `now` and asks `next_deadline()`), so it is tested with plain pipes.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Protocol

from app.control import APPLIED, APPLY, BROADCAST, DONE, RELAY_WITHIN_S, Numbering, Reply


class Worker(Protocol):
    """A worker position as the relay sees it: its number and its pipe (None once it has exited)."""

    @property
    def index(self) -> int: ...

    @property
    def conn(self) -> Connection | None: ...


@dataclass(eq=False)
class Broadcast:
    """A command one worker broadcast, on its way through every worker: who must answer, who has."""

    origin: Worker
    request_id: int  # the origin's own number for it
    waiting: set[int]  # worker numbers yet to answer
    deadline: float  # time.monotonic()
    replies: dict[int, Reply] = field(default_factory=dict)


class Relay:
    def __init__(self) -> None:
        # key -> the latest (name, args, number), oldest first
        self._sticky: dict[str, tuple[str, dict[str, Any], int]] = {}
        self._broadcasts: dict[int, Broadcast] = {}
        self._ids = itertools.count(1)
        self._workers: dict[int, Worker] = {}
        self._accepts: dict[int, frozenset[str] | None] = {}  # by worker number: the commands it applies; None: all
        self._refuses: dict[int, frozenset[str]] = {}  # by worker number: the commands it never applies
        self._numbering = Numbering()

    def started(
        self, worker: Worker, accepts: frozenset[str] | None = None, refuses: frozenset[str] = frozenset()
    ) -> None:
        """A worker (re)started: replay the sticky commands to it, in order. `accepts`: the only commands it
        applies (an engine process of shared_engine: the log settings and model loads); None: every one
        but those it `refuses` (a front of engine processes: the model loads, which it has no models for)."""
        self._workers[worker.index] = worker
        self._accepts[worker.index] = accepts
        self._refuses[worker.index] = refuses
        for key, (name, args, number) in self._sticky.items():
            if self._takes(worker, name):
                _send(worker, (APPLY, None, name, args, key, number))

    def received(self, worker: Worker, message: tuple[Any, ...]) -> None:
        """A control message from `worker`'s pipe."""
        if message[0] == BROADCAST:
            _, request_id, name, args, sticky, timeout_s, forget, sent = message
            if time.monotonic() - sent > RELAY_WITHIN_S:
                self._drop(worker, request_id, time.monotonic() - sent)
            else:
                self._broadcast(worker, request_id, name, args, sticky, timeout_s, forget)
        elif message[0] == APPLIED:
            _, broadcast_id, reply = message
            self._answered(worker, broadcast_id, reply)

    def exited(self, worker: Worker) -> None:
        """A worker is gone: it answers nothing more; its own broadcasts still reach the others."""
        self._workers.pop(worker.index, None)
        self._accepts.pop(worker.index, None)
        self._refuses.pop(worker.index, None)
        for broadcast_id, broadcast in list(self._broadcasts.items()):
            if worker.index in broadcast.waiting:
                self._give_up(broadcast_id, broadcast, [worker.index], f"worker {worker.index} exited")

    def tell(self, name: str, args: dict[str, Any]) -> int:
        """The supervisor's own command, sent to every live worker that takes it, unanswered; how many it reached."""
        number = self._numbering.next(name, name)
        targets = [worker for worker in self._workers.values() if worker.conn is not None and self._takes(worker, name)]
        for worker in targets:
            _send(worker, (APPLY, None, name, args, name, number))
        return len(targets)

    def next_deadline(self) -> float | None:
        return min((b.deadline for b in self._broadcasts.values()), default=None)

    def expire(self, now: float) -> None:
        """Answer, for the workers that have not, every broadcast whose time is up."""
        for broadcast_id, broadcast in list(self._broadcasts.items()):
            if broadcast.deadline <= now:
                self._give_up(broadcast_id, broadcast, list(broadcast.waiting), "no answer in time")

    def _broadcast(
        self,
        origin: Worker,
        request_id: int,
        name: str,
        args: dict[str, Any],
        sticky: str | None,
        timeout_s: float,
        forget: bool = False,
    ) -> None:
        key = sticky or name
        number = self._numbering.next(name, key)
        if sticky is not None:
            self._sticky.pop(key, None)  # re-inserted last: replayed after what it may depend on
            if not forget:
                self._sticky[key] = (name, args, number)
        broadcast_id = next(self._ids)
        targets = [worker for worker in self._workers.values() if worker.conn is not None and self._takes(worker, name)]
        broadcast = Broadcast(origin, request_id, {w.index for w in targets}, time.monotonic() + timeout_s)
        self._broadcasts[broadcast_id] = broadcast
        for worker in targets:
            _send(worker, (APPLY, broadcast_id, name, args, key, number))
        self._finish_if_answered(broadcast_id, broadcast)

    def _takes(self, worker: Worker, name: str) -> bool:
        accepts = self._accepts.get(worker.index)
        return (accepts is None or name in accepts) and name not in self._refuses.get(worker.index, ())

    def _drop(self, origin: Worker, request_id: int, late_s: float) -> None:
        why = (
            f"not applied: the supervisor took it up {late_s:.1f} s after it was sent (more than {RELAY_WITHIN_S:g} s: "
            "it was stopped or starved of CPU), when its sender may have stopped waiting"
        )
        indexes = sorted(worker.index for worker in self._workers.values() if worker.conn is not None)
        replies = [Reply(index, ok=False, error=why) for index in indexes]
        _send(origin, (DONE, request_id, replies))

    def _answered(self, worker: Worker, broadcast_id: int, reply: Reply) -> None:
        broadcast = self._broadcasts.get(broadcast_id)
        if broadcast is None or worker.index not in broadcast.waiting:
            return  # answered after its time was up
        broadcast.waiting.discard(worker.index)
        broadcast.replies[worker.index] = reply
        self._finish_if_answered(broadcast_id, broadcast)

    def _give_up(self, broadcast_id: int, broadcast: Broadcast, indexes: list[int], why: str) -> None:
        for index in indexes:
            broadcast.waiting.discard(index)
            broadcast.replies[index] = Reply(index, ok=False, error=why)
        self._finish_if_answered(broadcast_id, broadcast)

    def _finish_if_answered(self, broadcast_id: int, broadcast: Broadcast) -> None:
        if broadcast.waiting:
            return
        del self._broadcasts[broadcast_id]
        replies = [broadcast.replies[index] for index in sorted(broadcast.replies)]
        if broadcast.origin.conn is not None:
            _send(broadcast.origin, (DONE, broadcast.request_id, replies))


def _send(worker: Worker, message: tuple[Any, ...]) -> None:
    if worker.conn is None:
        return
    try:
        worker.conn.send(message)
    except OSError:  # the worker is exiting; the supervisor hears of it from its sentinel
        pass
