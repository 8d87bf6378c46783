"""Room for a ModelInfer or ModelStreamInfer message, taken from `max_held_bytes` before grpc core receives it.

grpc core receives a unary call's message whole before the servicer sees a byte of it, and a
message's size is not in its headers: so a budget checked on the message itself (wire.py) is
checked after its memory is spent. 48 concurrent 31 MiB calls against one process with a 256 MiB
budget grew it by 1.4 to 1.9 GB while all but one were refused (issue 40).

So ModelInfer is served as a stream-unary method, which grpc gives its handler before any message
is read, and the handler reads the one message only once it has a room: the largest message the
door admits (`max_body_bytes`, grpc's `max_receive_message_length`), taken from the process's
budget of held bytes. Once the message has arrived the room is traded for its real size, which
wire.py holds until the call is answered. A call that gets no room is refused RESOURCE_EXHAUSTED
with a retry hint, its message never read. Until its handler reads, grpc core holds at most the
stream's flow-control window of a message (server.py keeps it at HTTP/2's 64 KiB). So what grpc
core holds ahead of admission counts against the budget, as the HTTP door counts a body's declared
length before reading it.

Rooms take at most half the budget (one at least), so that messages on their way, or clients that
start messages and stall, never hold what the calls being answered and the HTTP door need. A call
that finds every room taken waits for one in turn (Rooms); a message must arrive whole within
`read_timeout_s` of its room (grpc core shows no progress before the whole; the HTTP door bounds a
body's pauses by the same setting), else DEADLINE_EXCEEDED and its room goes to the next call.

The cost: a message holds a whole room while it arrives, whatever its size, so clients that open
calls and stall hold rooms until `read_timeout_s`, and calls behind them wait or are refused with
the retry hint; the HTTP door, which reads Content-Length first, counts only what a body declares.
A small message holds its room for microseconds.

ModelStreamInfer reads each of its messages with `receive` and rooms of its own (stream.py, up to
half the budget as well: STREAM_ROOMS_SHARE): a read pending on a stream lets grpc core take a whole
message in as well. There the cost is larger: a stream waiting for its next message holds a room
while it waits, so at most as many streams as there are stream rooms wait for a message at once (the
others wait their turn, their next message held back at 64 KiB). A stream may wait as long as it
likes, but once quiet (QUIET_S) it gives its room up to a call that finds none, and ends UNAVAILABLE.
Apart from ModelInfer's rooms, quiet streams never hold up unary calls.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from app.engine.linger import Arrivals
from app.grpc.malformed import Malformed
from app.protocol.admission import HeldBytes, Hold, Watch
from app.protocol.errors import InvalidInput, QuietStreamClosed, RequestTimeout, TooManyBytesHeld

# HTTP/2's initial flow-control window, which grpc core keeps for a stream that has no read pending
# while BDP probing is off (server.py): what a waiting call's message may have put in memory.
STREAM_WINDOW = 65535

Unary = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


# ModelInfer's rooms may take up to half the budget, and ModelStreamInfer's, apart, as much (server.py):
# a stream waiting for its next message holds a room while it waits, so streams left open and quiet
# must not take the rooms that unary calls need. Both full, the rooms hold the whole budget: a flood
# of large messages is refused until some arrive, as the budget asks.
INFER_ROOMS_SHARE = 2
STREAM_ROOMS_SHARE = 2
# A stream waiting this long for its next message is quiet: when a call finds no room, the stream
# quiet longest gives its room up (its stream ends UNAVAILABLE; a client starts a new one), as the
# HTTP door closes the connection idle longest. A stream whose messages keep coming is never quiet;
# nor, since grpc shows no message before it is whole, is one whose message takes less than this
# to arrive (a 31 MiB message takes well under a second over a LAN).
QUIET_S = 5.0
LOOK_AGAIN_S = 0.5  # how often a call waiting for a room looks for a reader that has become quiet


class Reader:
    """A holder of a room that waits for a message that may never come (a stream between its messages)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, quiet_s: float) -> None:
        self._loop = loop
        self._quiet_at = loop.time() + quiet_s
        self.asked: asyncio.Future[None] = loop.create_future()  # done: give the room up

    def quiet(self) -> bool:
        return self._loop.time() >= self._quiet_at

    def ask(self) -> None:
        if not self.asked.done():
            self.asked.set_result(None)


class Rooms:
    """Rooms of `largest` bytes for messages on their way, taken from `held`: at most 1/`share` of it, one at least.

    A call that finds every room taken waits for one, first come first served, up to `read_timeout_s`
    (a small message holds its room for microseconds: calls arriving together must not refuse each
    other); at most `max_waiting` calls wait, each held back by HTTP/2 flow control at 64 KiB of its
    message (half the rooms' share of the budget in all). A message must then arrive whole within
    `read_timeout_s`.
    """

    def __init__(self, held: HeldBytes, largest: int, read_timeout_s: float, share: int = INFER_ROOMS_SHARE) -> None:
        self._held = held
        self.largest = largest
        self.read_timeout_s = read_timeout_s
        self.read_watch = Watch(read_timeout_s)  # each message's read_timeout_s, on one timer
        self.limit = max(1, held.limit // share // largest)
        # A reader is quiet after QUIET_S, or sooner where calls wait less for a room (read_timeout_s).
        self.quiet_s = min(QUIET_S, read_timeout_s / 2)
        self.max_waiting = max(self.limit, held.limit // (2 * share) // STREAM_WINDOW)
        self.taken = 0  # rooms held, and rooms handed to a waiter that has not woken yet
        self._waiting: deque[asyncio.Future[None]] = deque()
        # Readers that give their room up when asked (a stream waiting for its next message), in the
        # order they began to wait, and those asked that have not given it back yet.
        self._readers: dict[Reader, None] = {}
        self._asked: set[Reader] = set()

    async def take(self) -> Hold:
        """A room, or TooManyBytesHeld (RESOURCE_EXHAUSTED, retry shortly): too many waiting, none free in
        time, or the calls being answered holding the budget."""
        if self.taken < self.limit and not self._waiting:
            self.taken += 1
        elif len(self._waiting) >= self.max_waiting:
            raise TooManyBytesHeld(
                f"{self.taken} gRPC infer messages are arriving, each with room for {self.largest} bytes "
                f"(max_body_bytes) of max_held_bytes ({self._held.limit}), and {len(self._waiting)} wait; retry shortly"
            )
        else:
            self._ask_quietest(len(self._waiting) + 1)
            await self._turn()
        room = Hold(self._held)
        try:
            room.grow(self.largest)
        except TooManyBytesHeld:
            self._pass_on()
            raise
        return room

    def give(self, room: Hold, reader: Reader | None = None) -> None:
        """The room back (from `reader`, if it held it as one): to the call waiting longest, else free."""
        if reader is not None:
            self._readers.pop(reader, None)
            self._asked.discard(reader)
        room.resize(0)
        self._pass_on()

    def reader(self) -> Reader:
        """A room's holder that gives it up when asked, once quiet (`give` it back with the room)."""
        reader = Reader(asyncio.get_running_loop(), self.quiet_s)
        self._readers[reader] = None
        return reader

    def _ask_quietest(self, waiters: int) -> None:
        """`waiters` calls wait for a room: the reader quiet longest gives its own up, unless as many were asked."""
        if len(self._asked) >= waiters:
            return
        for reader in self._readers:  # the oldest first: it began to wait before the others
            if not reader.quiet():
                return
            if reader not in self._asked:
                self._asked.add(reader)
                reader.ask()
                return

    async def _turn(self) -> None:
        loop = asyncio.get_running_loop()
        turn = loop.create_future()
        self._waiting.append(turn)
        give_up = loop.time() + self.read_timeout_s
        try:
            # Looked at again every LOOK_AGAIN_S: a reader busy when this call came may be quiet by then.
            while not turn.done():
                left = give_up - loop.time()
                if left <= 0:
                    raise TimeoutError
                try:
                    async with asyncio.timeout(min(LOOK_AGAIN_S, left)):
                        await asyncio.shield(turn)
                except TimeoutError:
                    self._ask_quietest(len(self._waiting))
        except BaseException as exc:
            if not turn.done():
                turn.cancel()
            if turn.done() and not turn.cancelled():  # handed a room as it gave up: hand it on
                self._pass_on()
            elif turn in self._waiting:  # else a room given back meanwhile passed it by, cancelled
                self._waiting.remove(turn)
            if isinstance(exc, TimeoutError):
                raise TooManyBytesHeld(
                    f"no room for a gRPC infer message within {self.read_timeout_s:g} s: {self.taken} messages "
                    f"of up to {self.largest} bytes (max_body_bytes) are arriving; retry shortly"
                ) from None
            raise

    def _pass_on(self) -> None:
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)  # still counted in `taken`: the room is the waiter's now
                return
        self.taken -= 1


async def receive(
    read: Callable[[], Awaitable[bytes | None]],
    parse: Callable[[bytes], Any],
    rooms: Rooms,
    method: str,
    arrivals: Arrivals | None = None,
    *,
    may_be_quiet: bool = False,
) -> Any:
    """One message of a `method` call, read (`read()`: its raw bytes, None if the client sends no more) only
    with a room from `rooms`, then parsed by `parse` (which holds its real size); None for no more.

    TooManyBytesHeld: no room (RESOURCE_EXHAUSTED, retry shortly), the message left unread. RequestTimeout
    (DEADLINE_EXCEEDED): no whole message within the rooms' `read_timeout_s`; the read is left to end with the call.
    The room is given back on every way out (cancelled, timed out, the read failing).

    `may_be_quiet`: the message may never come (a stream's next): no time bound, but once quiet (the
    rooms' `quiet_s`) the room is given up when a call finds none, and QuietStreamClosed (UNAVAILABLE,
    retry) raised.

    `arrivals`: the process's batchers (app/engine/linger.py), told the message is on its way from the
    moment it holds a room (calls that stall their message are as few as the rooms) until it is read,
    for a caller that queues its rows in the step that parses it (nothing awaiting between the parse
    and the batcher's queue), so that no batch forms in the gap.
    """
    room = await rooms.take()
    reader = rooms.reader() if may_be_quiet else None
    with arrivals.announced() if arrivals is not None else contextlib.nullcontext():
        pending = asyncio.ensure_future(read())
        try:
            await _read_or_given_up(pending, rooms, reader)
        finally:
            # Before `parse` holds the message's own size, with no await between: the trade never fails.
            rooms.give(room, reader)
            if not pending.done():  # it ends with the call, which grpc core ends once answered or cancelled
                pending.add_done_callback(_retrieved)
    if not pending.done():
        if reader is not None:
            raise QuietStreamClosed(
                f"this {method} call waited {rooms.quiet_s:g} s or more for its next message and gave its room "
                "to another call; start a new stream"
            )
        raise RequestTimeout(
            f"the {method} message did not arrive whole within {rooms.read_timeout_s:g} s (read_timeout_s)"
        )
    data = pending.result()
    return None if data is None else parse(data)


def read_with_room(
    unary: Unary, parse: Callable[[bytes], Any], rooms: Rooms, arrivals: Arrivals | None = None
) -> Callable[..., Awaitable[Any]]:
    """A stream-unary behaviour that reads one message (raw bytes) only with a room from `rooms` (`receive`).

    The message, once read, is parsed by `parse` (which holds its real size) and answered by
    `unary`; a call refused, `unary` answers a Malformed: no room (TooManyBytesHeld, its
    RESOURCE_EXHAUSTED and retry hint), no whole message within the rooms' `read_timeout_s` (RequestTimeout,
    DEADLINE_EXCEEDED), or none at all (INVALID_ARGUMENT).

    `arrivals`: told the call is on its way until its message is read (`receive`).
    """

    async def behaviour(messages: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
        try:
            message = await receive(lambda: anext(aiter(messages), None), parse, rooms, "ModelInfer", arrivals)
        except (TooManyBytesHeld, RequestTimeout) as exc:
            return await unary(Malformed(exc), context)
        if message is None:
            message = Malformed(InvalidInput("a ModelInfer call carries one request message; got none"))
        return await unary(message, context)

    return behaviour


async def _read_or_given_up(pending: asyncio.Future[Any], rooms: Rooms, reader: Reader | None) -> None:
    """Wait until `pending` (the read) is done, or it is too late for it: the rooms' read_timeout_s has passed
    (on their one timer), or, for a `reader`, it was asked for its room. Never cancels the read."""
    woken = asyncio.get_running_loop().create_future()

    def wake(_: object = None) -> None:
        if not woken.done():
            woken.set_result(None)

    pending.add_done_callback(wake)
    ticket = rooms.read_watch.start(wake) if reader is None else None
    if reader is not None:
        reader.asked.add_done_callback(wake)
    try:
        await woken
    finally:
        pending.remove_done_callback(wake)
        if ticket is not None:
            ticket.end()
        if reader is not None:
            reader.asked.remove_done_callback(wake)


def _retrieved(read: asyncio.Future[Any]) -> None:
    """A read left behind ends when its call does, in an error of grpc's that nobody needs: taken, so never logged."""
    if not read.cancelled():
        read.exception()
