"""Control: commands that every serving process applies, such as a new log level or new weights.

A request to change the service arrives at one process, but with `workers > 1` every worker must
apply it. `broadcast(name, args)` runs the handler registered under `name` in every live serving
process (this one included) and returns one `Reply` per process; in a single process it is a plain
call. Between workers it travels through the supervisor (app/process/supervisor.py), which relays it to each
worker over that worker's pipe and collects the replies.

- Order: commands with the same key (their `sticky` key, else their name) are applied in the order
  they were broadcast, one at a time; commands with different keys do not wait for each other.
- Sticky commands are remembered by the supervisor under their key (the latest one per key) and
  replayed, in order, to every worker it starts later, before that worker takes any traffic: a
  replacement worker serves the same log level, regions and models as the others.
  A command that undoes a sticky one (`forget=True`: a region unregistered) is applied like any
  other, and the key is then forgotten, neither replayed: the supervisor remembers only keys in use.
- A worker applies what arrives before its handlers are registered once they are (`open()`, in the
  app's start-up), in arrival order.
- Numbered: a handler reads its command's number, `command_number.get()`: how many commands of
  that name were broadcast under that key, this one included (1, 2, 3...), given by the one place
  that orders them (the supervisor, or this process alone), so every worker reads the same
  number, a replayed command too (a model's version is its load's number).

- Deadlines: a broadcast is answered by its `timeout_s`, and sooner when the supervisor goes
  quiet: it answers every heartbeat a worker sends (ALIVE), so a worker that has sent it a beat or
  a broadcast and heard nothing back for SUPERVISOR_SILENCE_S stops waiting (Unanswered: 503 with
  Retry-After). The supervisor relays a broadcast only if it takes it up within RELAY_WITHIN_S of
  its sending (time.monotonic() is one clock for every process of a host), so one that queued
  while the supervisor was stopped, and whose sender may have stopped waiting, is dropped, not
  applied behind the sender's back. A stop that falls after the relay leaves the command applied
  where it arrived: the 503 then says it may not have been applied everywhere, and a sticky
  command still reaches every worker once the supervisor runs.
- A full pipe never blocks a worker: what a worker sends the supervisor and has not heard back
  from it about is counted, in bytes with the kernel's bookkeeping, against half the pipe's
  send buffer. Past that, heartbeats are skipped (those queued already say all a later one
  would) and a broadcast is refused at once (Unanswered): a supervisor stopped for minutes
  would otherwise leave the pipe full, and the next send would hold the worker's event loop,
  and every request on it, until the supervisor ran again.

Handlers run on the process's event loop: `async def handler(args) -> dict`. A ServiceError they
raise is the reply's error, for the caller to read; anything else is logged and reported as a bug.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from app.errors import ServiceError

log = logging.getLogger("ffn_serve.control")

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]

# Messages on a worker's pipe, as tuples: the first item says which.
READY = "ready"  # worker -> supervisor: warm, taking traffic
HEARTBEAT = "heartbeat"  # worker -> supervisor: its event loop runs (app/engine/loop_watch.py)
ALIVE = "alive"  # supervisor -> worker: the answer to its heartbeats, the supervisor's loop runs
BROADCAST = "broadcast"  # worker -> supervisor: (BROADCAST, id, name, args, sticky, timeout_s, forget, sent)
APPLY = "apply"  # supervisor -> worker: (APPLY, id or None, name, args, key, number)
APPLIED = "applied"  # worker -> supervisor: (APPLIED, id, Reply)
DONE = "done"  # supervisor -> the worker that broadcast: (DONE, id, [Reply, ...])

# The number of the command being applied (see "Numbered" above); set around each handler's call.
command_number: ContextVar[int] = ContextVar("command_number", default=0)
THE_ONE_PROCESS = 0  # the worker number of a service without workers
RELAY_MARGIN_S = 5.0  # the supervisor answers by a broadcast's timeout; this covers the relay itself
SUPERVISOR_SILENCE_S = 5.0  # a broadcast stops waiting once the supervisor has answered nothing this long
RELAY_WITHIN_S = 3.0  # the supervisor drops a broadcast it takes up later than this after its sending
# What the kernel charges a message on a pipe beyond its bytes (measured on Linux 6: 400 to 1,300
# bytes for messages of 20 bytes to 16 KiB; a heartbeat costs 770 in all).
PIPE_MESSAGE_OVERHEAD_BYTES = 1536


@dataclass(frozen=True)
class Reply:
    """What one process answered: its result, or why it failed."""

    worker: int
    ok: bool
    result: dict[str, Any] = field(default_factory=dict)
    error: str = ""


class Unanswered(ServiceError):
    """No process answered a broadcast in time."""


class Numbering:
    """Commands numbered 1, 2, 3... per name and key, where they are ordered (see command_number)."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], int] = {}

    def next(self, name: str, key: str) -> int:
        number = self._last.get((key, name), 0) + 1
        self._last[(key, name)] = number
        return number


class Control:
    """The handlers of this process, and broadcasts to every serving process."""

    def __init__(self, worker: int = THE_ONE_PROCESS, conn: Connection | None = None) -> None:
        """`conn`: this worker's pipe to the supervisor; None in a service without workers."""
        self.worker = worker
        self._conn = conn
        self._handlers: dict[str, Handler] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._early: deque[tuple[Any, ...]] = deque()  # arrived before open()
        self._early_lock = threading.Lock()
        self._pending: dict[int, asyncio.Future[list[Reply]]] = {}
        self._ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._numbering = Numbering()  # alone; with workers the supervisor numbers the commands
        # When this process first sent the supervisor something it answers (a beat, a broadcast)
        # after the last message it heard from it; None: it has heard from it since.
        self._unanswered_since: float | None = None
        # The bytes sent since (each message's, with the kernel's overhead), within half the pipe's
        # buffer: a send never blocks on a supervisor that reads nothing. Never held across a send.
        self._unanswered_bytes = 0
        self._unanswered_budget = 0 if conn is None else _send_buffer_bytes(conn) // 2
        self._budget_lock = threading.Lock()

    def register(self, name: str, handler: Handler) -> None:
        assert name not in self._handlers, f"two handlers for control command {name!r}; this is a bug."
        self._handlers[name] = handler

    async def open(self) -> None:
        """Start applying commands on this loop: first, in order, those that arrived before."""
        loop = asyncio.get_running_loop()
        while True:
            with self._early_lock:  # what arrives meanwhile queues behind, until the queue is empty
                if not self._early:
                    self._loop = loop
                    return
                message = self._early.popleft()
            await self._on_message(message)

    async def broadcast(
        self,
        name: str,
        args: dict[str, Any],
        *,
        sticky: str | None = None,
        forget: bool = False,
        timeout_s: float = 60.0,
    ) -> list[Reply]:
        """Apply `name` in every serving process; one Reply each, this process's among them.

        `sticky`: a key under which the command is remembered and replayed to workers started later.
        `forget`: with `sticky`, the command undoes the key's earlier one: once applied, nothing
        under the key is replayed any more.
        """
        assert sticky is not None or not forget, "forget names the sticky key it clears; this is a bug."
        if self._conn is None:
            key = sticky or name
            return [await self._apply(name, args, key, self._numbering.next(name, key))]
        request_id = next(self._ids)
        answer: asyncio.Future[list[Reply]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = answer
        sent = time.monotonic()
        deadline = sent + timeout_s + RELAY_MARGIN_S
        try:
            if not self._send_answerable((BROADCAST, request_id, name, args, sticky, timeout_s, forget, sent)):
                raise Unanswered(
                    f"the supervisor process has read nothing this worker sent it for {self._quiet_for():.1f} s "
                    f"(it is stopped or starved of CPU): {name} was not sent"
                )
            while not answer.done():
                now = time.monotonic()
                if now >= deadline:
                    raise Unanswered(f"no answer from the workers within {timeout_s:g} s")
                quiet = self._unanswered_since
                quiet_since = None if quiet is None else max(quiet, sent)  # only what was sent with or after it
                if quiet_since is not None and now - quiet_since >= SUPERVISOR_SILENCE_S:
                    raise Unanswered(
                        f"the supervisor process has answered nothing for {now - quiet_since:.1f} s (it is stopped "
                        f"or starved of CPU): {name} may not have been applied in every worker"
                    )
                wake = min(deadline, (quiet_since or now) + SUPERVISOR_SILENCE_S)
                await asyncio.wait([answer], timeout=max(0.0, wake - now))
            return answer.result()
        finally:
            self._pending.pop(request_id, None)

    # ----- the worker's side of the pipe -----------------------------------------------------

    def serve_pipe(self, on_close: Callable[[], None] | None = None) -> None:
        """Read the supervisor's messages in a thread; when the pipe closes, call `on_close`.

        By default that is SIGTERM to this process: the supervisor is gone, so drain and exit.
        """
        assert self._conn is not None, "serve_pipe without a pipe; this is a bug."
        closed = on_close or (lambda: os.kill(os.getpid(), signal.SIGTERM))
        threading.Thread(target=self._read, args=(self._conn, closed), name="control", daemon=True).start()

    def send_ready(self) -> None:
        if self._conn is not None:
            self._send((READY,))

    def heartbeat(self) -> None:
        """From the event loop: it runs. The supervisor replaces a worker whose heartbeats stop."""
        if self._conn is not None:
            self._send_answerable((HEARTBEAT,))

    def _read(self, conn: Connection, closed: Callable[[], None]) -> None:
        try:
            while True:
                message = conn.recv()
                with self._budget_lock:  # the supervisor runs: it has read all this process sent before
                    self._unanswered_since, self._unanswered_bytes = None, 0
                if message[0] == ALIVE:
                    continue
                with self._early_lock:
                    loop = self._loop
                    if loop is None:
                        self._early.append(message)
                        continue
                loop.call_soon_threadsafe(self._received, message)
        except (EOFError, OSError):
            pass
        closed()

    def _received(self, message: tuple[Any, ...]) -> None:
        task = asyncio.get_running_loop().create_task(self._on_message(message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_message(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == APPLY:
            _, request_id, name, args, key, number = message
            reply = await self._apply(name, args, key, number)
            if request_id is not None:
                self._send((APPLIED, request_id, reply))
        elif kind == DONE:
            _, request_id, replies = message
            answer = self._pending.get(request_id)
            if answer is not None and not answer.done():
                answer.set_result(replies)
        else:
            log.error("unknown control message %r; this is a bug", kind)

    def _send_answerable(self, message: tuple[Any, ...]) -> bool:
        """Send something the supervisor answers: from now on, hearing nothing back is its silence.
        False, and nothing sent, when what it has not answered yet would pass the pipe's budget."""
        data = bytes(ForkingPickler.dumps(message))  # what Connection.send would write
        cost = len(data) + PIPE_MESSAGE_OVERHEAD_BYTES
        with self._budget_lock:
            if self._unanswered_bytes + cost > self._unanswered_budget:
                return False
            self._unanswered_bytes += cost
            if self._unanswered_since is None:
                self._unanswered_since = time.monotonic()
        self._send_bytes(data)
        return True

    def _quiet_for(self) -> float:
        """How long the supervisor has answered nothing this process sent it."""
        since = self._unanswered_since
        return 0.0 if since is None else time.monotonic() - since

    def _send(self, message: tuple[Any, ...]) -> None:
        self._send_bytes(bytes(ForkingPickler.dumps(message)))

    def _send_bytes(self, data: bytes) -> None:
        assert self._conn is not None
        try:
            with self._send_lock:
                self._conn.send_bytes(data)  # read by the supervisor's recv(), as if sent by send()
        except OSError:  # the supervisor is gone; the reader thread stops this worker
            pass

    # ----- applying ----------------------------------------------------------------------------

    async def _apply(self, name: str, args: dict[str, Any], key: str, number: int) -> Reply:
        """Run the handler, after every earlier command of the same key, with command_number set."""
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:  # asyncio's locks are fair: first come, first applied
            handler = self._handlers.get(name)
            if handler is None:
                return Reply(self.worker, ok=False, error=f"no handler for control command {name!r}")
            numbered = command_number.set(number)
            try:
                return Reply(self.worker, ok=True, result=await handler(args))
            except ServiceError as exc:
                return Reply(self.worker, ok=False, error=exc.message)
            except Exception:
                log.exception("control command %s failed; this is a bug", name)
                return Reply(self.worker, ok=False, error="internal error")
            finally:
                command_number.reset(numbered)


def _send_buffer_bytes(conn: Connection) -> int:
    """The kernel's send buffer for this end of the pipe (a socket pair): past it, a send blocks."""
    fd = os.dup(conn.fileno())
    try:
        sock = socket.socket(fileno=fd)
    except OSError:  # a one-way pipe (os.pipe) is no socket; it holds 64 KiB
        os.close(fd)
        return 64 * 1024
    with sock:
        return sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
