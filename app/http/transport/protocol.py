"""uvicorn's httptools HTTP/1.1 protocol, with budgets that bound what one connection can cost.

uvicorn feeds whatever a client sends to its parser at once: a head it has not finished, every
trailer (appended to the request's headers), and every pipelined request behind the one being
answered. Here the protocol feeds the parser itself, one slice at a time, so that it decides what
is parsed and when. Each connection:

- counts every byte of a message that is not body data (request line, headers, chunk-size lines
  and extensions, trailers) against one budget per message: `max_header_bytes`, plus 1/64 of the
  body bytes so far (room for the framing of a body sent in chunks of 512 bytes or more); past it,
  431. A head is never parsed beyond its budget. Trailers are counted, then dropped (RFC 9110
  §6.5.1 lets a recipient discard them), never added to the request's headers;
- has at most MAX_UNANSWERED requests parsed and not yet answered (pipelined): past that, what it
  sent stays unparsed, and reading stays paused, until answers have gone out; and once an answer
  has gone out, the next pipelined request starts (and what waited is parsed) on the connection's
  turn, one connection a turn of the event loop across the process (app/http/transport/budgets.py), so
  that pipelining connections, however many, cannot fill every turn of the loop;
- must send its head within `header_timeout_s` of opening or of its previous answer: 408 if a
  head had begun, a quiet close if nothing came (as a keep-alive timeout does). That deadline and
  uvicorn's keep-alive one, which every request restarts, share one timer per connection
  (app/http/transport/budgets.py: Deadlines): a request moves two floats, not two timers;
- must not pause for `read_timeout_s` inside a body, and must send the body within
  `read_timeout_s` plus one second per `min_body_rate` bytes of it (the body's clock stops while
  the server holds reading paused): 408. A trickle holds a connection only as long as its bytes
  pay for; the timers run only while a body is incomplete, so a request that arrives in one piece,
  the common case, never arms them;
- is dropped when an answer's unsent bytes make no progress for `send_timeout_s`, which frees them;
- counts against the process's connection cap (app/http/transport/budgets.py): past `max_connections`
  open ones, the connection idle longest is closed to make room, or else the new one gets 503
  `too_many_connections`; at most half the cap may be connections still sending their request;
- once the server drains (`close_connections`), answers with `Connection: close`, and is closed
  when idle: a client is never left with a request on a connection the process is about to close;
- is idle only with no byte waiting unread in its socket: after the event loop was held (a long
  parse, a stopped worker asked to drain as it resumes), the idle timers (uvicorn's keep-alive,
  the head timeout, the drain's quiet close) come due before the loop has read what clients sent
  meanwhile, and would close those connections under their requests;
- writes an answer's head and its body in one write (a vectored one: the body is not copied to
  join its head): a process killed between two writes would leave a head without its body, which
  a proxy can no longer retry.

A request the lean path serves (lean.py) gets a Content-Length body of BODY_PAST_PARSER_BYTES or
more from the protocol, not from the parser, which would copy every slice: views of the reads
that are nearly all body, copies of the rest; a fresh parser then reads the connection's next
message.

It also tells a request that its client left, through the callback the request left in its
scope under ON_DISCONNECT (app/http/endpoints.py: unless_disconnected), so that no task per request
has to wait for the disconnect message.

An upgrade request (WebSocket, h2c) is answered as a plain HTTP request and the connection closed
after it: the service speaks HTTP/1.1 only (uvicorn runs with ws="none"). Parser-level refusals
(malformed request line, bad header bytes, broken chunked framing) get the service's JSON error
body instead of uvicorn's text/plain, with a request id of their own (body and X-Request-Id), as
every answer has. A request line must end in HTTP/1.1 or HTTP/1.0: llhttp also takes a line with
no version (HTTP/0.9's `GET /path`), HTTP/2.0 and RTSP/1.0, which uvicorn would answer as
HTTP/1.1; here such a line is refused as soon as it is whole, before the parser reads it: 400
without a version (or with another protocol's), 505 with another HTTP version. A request the protocol refuses in the read that parsed its head (a 503 at the
cap, a body over a budget) never enters the app: a refusal costs the protocol's answer alone,
which matters when a client reconnects the moment it is refused. After an error answer the
connection lingers briefly, reading and discarding up to LINGER_BYTES, so that a client still
sending reads the answer instead of a reset; past those, reading stops (a flood costs the server
nothing more).

It relies on private members of uvicorn's protocol; app/http/transport/uvicorn_members.py lists them, and
ffn-serve checks them before serving.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import re
import struct
import termios
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import httptools
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.config.settings import Settings
from app.errors import ServiceError
from app.http.errors import error_body
from app.http.transport.budgets import ConnectionBudget, Deadlines, PipelineTurns
from app.http.transport.direct_body import DIRECT_BODY_BYTES, DirectBody
from app.http.transport.lean import LeanDoor, LeanRequest
from app.observe.identity import new_request_id
from app.protocol.errors import (
    HeaderTooLarge,
    HttpVersionNotSupported,
    InvalidInput,
    RequestTimeout,
    TooManyConnections,
    kind_of,
)

log = logging.getLogger("ffn_serve")

# A scope key set (to None) by this protocol: the app stores a callback under it, which is called,
# with no argument, when the connection is lost before the answer is complete (unless_disconnected).
ON_DISCONNECT = "ffn.on_disconnect"
LINGER_S = 2.0  # after an error answer: how long to read and discard before closing
LINGER_BYTES = 1024 * 1024  # ... and how much at most: then reading stops until the close
# While draining, an idle connection is closed once quiet this long from the drain's start: a client
# that has just read an answer may be writing its next request, which a close at that moment would
# lose; and a loop that was held (a long parse, a stopped process asked to drain as it resumes) has
# not yet read what arrived meanwhile, however long ago the last answer went out.
IDLE_CLOSE_S = 0.5
# A first write up to this size (a head) is held for the body that follows it in the same turn;
# a larger one is no head, and goes straight through.
ONE_WRITE_BYTES = 64 * 1024
# A lean request's Content-Length body of at least this many bytes is taken without the parser
# (_take_lean_body), which would copy it; a smaller one is fed to the parser, whose copy costs
# less than the fresh parser the next message would then need (bench.alternating: one client's
# one-row requests were 4 % slower with every body taken past the parser).
BODY_PAST_PARSER_BYTES = 64 * 1024
VIEW_SLACK = 8  # a body slice is taken as a view of its read when the read's other bytes are at most 1/8 of it
CAP_WARNING_EVERY_S = 60.0  # one log line per minute at most while connections are refused
MAX_UNANSWERED = 4  # requests parsed and not yet answered on one connection (hyper: one at a time)
FRAMING_SHARE = 64  # a message's non-body bytes may pass max_header_bytes by this fraction of its body
HEAD_END = b"\r\n\r\n"  # ends every request head, and every chunked body (llhttp takes CRLF only)
SERVED_VERSIONS = (b" HTTP/1.1", b" HTTP/1.0")  # how a request line this service answers ends
CR, CRLF = ord("\r"), b"\r\n"
LINE_END_BYTES = 10  # a request line's last bytes kept to read its version: " HTTP/1.1" and its CR
HTTP_VERSION = re.compile(rb" HTTP/(\d\.\d)$")
# The connection's deadlines (app/http/transport/budgets.py: Deadlines), on one timer: reset by every request.
HEAD_DUE = 0  # its next head is whole by then (header_timeout_s): else 408, or a quiet close if nothing came
KEEP_ALIVE_DUE = 1  # idle past then, it is closed (uvicorn's timeout_keep_alive, as uvicorn's own timer did)


@dataclass(frozen=True)
class ConnectionLimits:
    """What one connection may cost: head size and time, body rate, answer send time, and how many are open."""

    max_header_bytes: int
    header_timeout_s: float
    read_timeout_s: float
    send_timeout_s: float
    max_connections: int
    min_body_rate: int = 0  # bytes/s a body must average past read_timeout_s; 0: the pause bound alone

    @classmethod
    def from_settings(cls, settings: Settings) -> ConnectionLimits:
        return cls(
            settings.max_header_bytes,
            settings.header_timeout_s,
            settings.read_timeout_s,
            settings.send_timeout_s,
            settings.max_connections,
            settings.min_body_rate,
        )


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """The uvicorn.Config arguments that put this protocol, with the settings' limits, under the app."""
    limits = ConnectionLimits.from_settings(settings)
    budget: ConnectionBudget[LimitedHttpToolsProtocol] = ConnectionBudget(limits.max_connections)
    protocol = type(
        "LimitedHttpToolsProtocol",
        (LimitedHttpToolsProtocol,),
        {"limits": limits, "budget": budget, "turns": PipelineTurns()},
    )
    return {"http": protocol, "ws": "none"}


REFUSED = "ffn.refused"  # set in a request's scope when the protocol answered it itself


def _unless_refused(app: ASGIApp) -> ASGIApp:
    """`app`, skipped for a request the protocol refused before its task began (see _refuse)."""

    async def unless_refused(scope: Scope, receive: Receive, send: Send) -> None:
        if not scope.get(REFUSED):
            await app(scope, receive, send)

    return unless_refused


class HeldFlowControl(FlowControl):
    """uvicorn's flow control, which reading the protocol holds paused stays paused under, and which keeps time.

    uvicorn resumes reading at every answer and every body read; while the protocol holds bytes it
    has not parsed (`held`), those resumes wait. The time reading spent paused is kept, so that a
    body's clock stops while the server, not the client, is the one not reading.
    """

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__(transport)
        self.held = False
        self.resumed_at = 0.0
        self._paused_since = 0.0
        self._paused_total = 0.0

    def pause_reading(self) -> None:
        if not self.read_paused:
            self._paused_since = time.monotonic()
        super().pause_reading()

    def resume_reading(self) -> None:
        if self.held or not self.read_paused:
            return
        self.resumed_at = time.monotonic()
        self._paused_total += self.resumed_at - self._paused_since
        super().resume_reading()

    def paused_s(self) -> float:
        """Seconds reading has been paused on this connection, the current pause included."""
        current = time.monotonic() - self._paused_since if self.read_paused else 0.0
        return self._paused_total + current


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol that feeds its parser in slices, within the connection's budgets."""

    limits: ClassVar[ConnectionLimits]
    budget: ClassVar[ConnectionBudget[LimitedHttpToolsProtocol]]
    turns: ClassVar[PipelineTurns]  # the process's pipelined requests, one started a turn of the loop
    closing: ClassVar[bool] = False  # the server drains: every connection closes after its answer
    _last_cap_warning: ClassVar[float] = 0.0
    flow: HeldFlowControl

    @classmethod
    def close_connections(cls, connections: Iterable[Any]) -> None:
        """From now on, answer every request with `Connection: close` and close idle connections (`shutdown`)."""
        cls.closing = True
        for connection in list(connections):
            connection.shutdown()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._idle_since = 0.0  # when the connection opened or last finished an answer
        self._quiet_timer: asyncio.TimerHandle | None = None
        # Read but not fed, from _unparsed_at on: held while MAX_UNANSWERED are unanswered. An
        # offset, not a slice, so that feeding a few requests of a large read copies nothing.
        self._unparsed: bytes | bytearray = b""
        self._unparsed_at = 0
        self._tail = b""  # the last bytes fed, when a head's end may have begun in them
        self._line_end = b""  # the last LINE_END_BYTES of the message's request line, fed so far
        self._line_done = False  # the request line's LF has been fed
        self._unanswered = 0  # requests whose head was parsed and whose answer has not gone out
        self._head_begun = False
        self._in_body = False  # a request's head is in, its body is not yet complete
        self._body_left: int | None = None  # Content-Length bytes still to come; None when chunked
        self._overhead = 0  # this message's bytes that are not body data, so far
        self._body_bytes = 0  # this message's body bytes, so far
        self._slice_body = 0  # body bytes in the slice being fed
        self._completed = False  # a message ended in the slice being fed
        self._body_started = 0.0  # time.monotonic() at the end of its head
        self._body_paused_base = 0.0  # flow.paused_s() then
        self._last_progress = 0.0
        self._deadlines = Deadlines(self.loop, (self._head_timed_out, self.timeout_keep_alive_handler))
        self._body_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._unsent_at_check = 0
        self._discarding = False  # an error was answered, or an upgrade asked for: input is dropped
        self._completion_deferred = False  # uvicorn's end of an answer waits for this connection's turn
        self._admitted = True  # within the connection cap (connection_made)
        self._discarded = 0
        self._lean_door: LeanDoor | None = None  # the app's lean path (app/http/transport/lean.py), if it has one
        self._lean: LeanRequest | None = None  # the request the lean path serves on this connection, until answered
        self._lean_ready: LeanRequest | None = None  # ... whose body the read just completed
        self._body_past_parser = False  # the lean request's body is taken without the parser (_take_lean_body)
        self._direct: DirectBody | None = None  # ... and its rest read straight into its buffer (_read_body_directly)

    # ----- connection ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = HeldFlowControl(transport)
        self._lean_door = getattr(self.config.loaded_app, "lean_door", None)
        self.app = _unless_refused(self.app)
        self._admitted, victim = self.budget.opened(self)
        if victim is not None:
            # Room for this one: the connection idle longest (it loses nothing a retry cannot give
            # back), or else the slowest head still arriving (it has sent no whole request).
            victim.transport.close()
        if not self._admitted:  # answered 503 once its head arrives (_account), then closed
            self._warn_cap(
                f"{self.budget.open} connections open, none idle and no head arriving: refusing new ones with 503"
            )
        self._idle_since = self.loop.time()
        self._arm_head_timer()
        if self.closing:
            self._close_when_quiet()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        self.turns.withdraw(self)
        self._drop_unparsed()
        self.budget.closed(self)
        self._direct = None
        if self._lean is not None:  # the client left before its answer: its rows are withdrawn
            self._lean.abandon()
            self._lean = self._lean_ready = None
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and cycle.disconnected:
            hang_up: Callable[[], None] | None = cast(dict[str, Any], cycle.scope).get(ON_DISCONNECT)
            if hang_up is not None:
                hang_up()

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            self._discarded += len(data)
            if self._discarded > LINGER_BYTES:
                self.flow.held = True
                self.flow.pause_reading()
            return
        self._unset_keepalive_if_required()
        if self._in_body:
            self._last_progress = time.monotonic()
        if self._holding():
            self._unparsed, self._unparsed_at = self._unparsed[self._unparsed_at :] + data, 0
        else:
            self._unparsed, self._unparsed_at = data, 0
        self._feed()
        self._account()
        if self._body_past_parser and (self._body_left or 0) >= DIRECT_BODY_BYTES and self._direct is None:
            self._read_body_directly()

    def send_400_response(self, msg: str) -> None:
        self._refuse(InvalidInput(f"malformed HTTP request: {msg}"))

    # ----- feeding the parser ----------------------------------------------------------------

    def _feed(self) -> None:
        """Feed what was read, slice by slice, as far as the budgets allow; keep the rest, reading paused."""
        data = self._unparsed
        fed = self._feed_slices(data, self._unparsed_at)
        if self._discarding or self.transport.is_closing():
            self._drop_unparsed()
            return
        if fed < len(data):
            self._unparsed_at = fed
        else:
            self._drop_unparsed()
        if self._holding():
            self.flow.held = True
            self.flow.pause_reading()
        elif self.flow.held:
            self.flow.held = False
            self.flow.resume_reading()
        if self._in_body and self._body_timer is None:
            self._body_timer = self.loop.call_later(self.limits.read_timeout_s, self._check_body)
        if self._lean_ready is not None:
            ready, self._lean_ready = self._lean_ready, None
            ready.complete()

    def _holding(self) -> bool:
        """Whether bytes read are held unparsed."""
        return self._unparsed_at < len(self._unparsed)

    def _drop_unparsed(self) -> None:
        self._unparsed, self._unparsed_at = b"", 0

    def _feed_slices(self, data: bytes | bytearray, start: int = 0) -> int:
        """Feed `data` from `start` in slices that each end where a message may end; the offset fed up to.

        A message ends only at the end of a head (CRLF CRLF), at the end of a Content-Length body,
        or at the end of a chunked body (CRLF CRLF again): cut there, a slice holds at most one
        message's end, so its bytes are counted against the right message, and a head that would
        pass MAX_UNANSWERED unanswered requests is never fed.
        """
        view = memoryview(data)
        offset = start
        try:
            while offset < len(data):
                end, at_head_end = self._slice_end(data, offset)
                if end < 0:  # refused before a byte past the budget is parsed
                    self._refuse(HeaderTooLarge(f"request head exceeds {self.limits.max_header_bytes} bytes"))
                    return offset
                if end <= offset:
                    break  # held until answers go out
                self._slice_body, self._completed = 0, False
                if not (self._in_body or self._line_done) and (refusal := self._line_refusal(data, offset, end)):
                    self._refuse(refusal)  # before llhttp, which takes no version, 2.0 and RTSP/1.0
                    return offset
                if self._body_left and self._body_past_parser and self.cycle is self._lean:
                    self._take_lean_body(data, offset, end)  # the parser never sees it
                    self._tail = b""  # a Content-Length body's bytes end no head
                    if not self._count(end - offset) or self.transport.is_closing():
                        return end
                    offset = end
                    continue
                try:
                    self.parser.feed_data(view[offset:end])
                except httptools.HttpParserUpgrade:
                    self._answer_upgrade_plainly()
                    return end
                except httptools.HttpParserError as exc:
                    self._refuse(InvalidInput(f"malformed HTTP request: {exc}"))
                    return end
                if at_head_end or self._completed:
                    self._tail = b""
                else:
                    self._tail = (self._tail + bytes(view[max(offset, end - 3) : end]))[-3:]
                if not self._count(end - offset) or self.transport.is_closing():
                    return end
                offset = end
        finally:
            view.release()
        return offset

    def _line_refusal(self, data: bytes | bytearray, offset: int, end: int) -> ServiceError | None:
        """Why the request line read so far, with data[offset:end], cannot be answered; None if it can, or is not whole.

        The common case first: the whole line in this slice, no empty lines before it, ending in a
        served version; checked in place, nothing kept. Otherwise its end is kept across slices.
        """
        if not self._line_end and data[offset] not in CRLF:
            newline = data.find(b"\n", offset, end)
            if newline != -1:
                stop = newline - 1 if data[newline - 1] == CR else newline
                if data.endswith(SERVED_VERSIONS, offset, stop):
                    self._line_done = True
                    return None
        self._keep_line_end(data, offset, end)
        return self._version_refusal() if self._line_done else None

    def _keep_line_end(self, data: bytes | bytearray, offset: int, end: int) -> None:
        """Keep the last bytes of the request line in data[offset:end], a head's slice, for its version.

        The line may arrive a byte at a time: only its last LINE_END_BYTES are kept, so a slice
        costs the same whatever the line's length. Empty lines before a request line (which llhttp
        skips) are skipped here too.
        """
        if not self._line_end:
            while offset < end and data[offset] in b"\r\n":
                offset += 1
        newline = data.find(b"\n", offset, end)
        stop = end if newline == -1 else newline
        self._line_end = (self._line_end + bytes(data[max(offset, stop - LINE_END_BYTES) : stop]))[-LINE_END_BYTES:]
        self._line_done = newline != -1

    def _version_refusal(self) -> ServiceError | None:
        """Why a whole request line cannot be answered: it does not end in HTTP/1.1 or HTTP/1.0; None if it does."""
        line_end = self._line_end.removesuffix(b"\r")
        if line_end.endswith(SERVED_VERSIONS):
            return None
        version = HTTP_VERSION.search(line_end)
        if version is not None:
            return HttpVersionNotSupported(
                f"HTTP/{version[1].decode()} is not served here: send HTTP/1.1 (or HTTP/1.0); "
                "gRPC's HTTP/2 has its own port"
            )
        return InvalidInput("malformed HTTP request: the request line must end in HTTP/1.1 or HTTP/1.0")

    def _slice_end(self, data: bytes | bytearray, offset: int) -> tuple[int, bool]:
        """Where the slice from `offset` ends, and whether that is just past a CRLF CRLF.

        `offset`: hold what is left until answers go out; -1: a head over its budget.
        """
        size = len(data)
        if self._in_body:
            if self._body_left is not None:  # exactly the rest of a Content-Length body
                return min(size, offset + self._body_left), False
            end = self._after_head_end(data, offset, size)  # a chunked body ends at one
            return (end, True) if end != -1 else (size, False)
        # A head: refused before it is parsed past its budget; none fed while MAX_UNANSWERED wait.
        room = self.limits.max_header_bytes - self._overhead
        end = self._after_head_end(data, offset, min(size, offset + room))
        if end == -1:
            return (size, False) if size - offset <= room else (-1, False)
        if self._unanswered >= MAX_UNANSWERED:
            return offset, False
        return end, True

    def _after_head_end(self, data: bytes | bytearray, offset: int, stop: int) -> int:
        """Just past the first CRLF CRLF that ends in data[offset:stop], one begun in the bytes fed before included; -1 if none."""
        if self._tail:
            joined = self._tail + bytes(data[offset : offset + 3])
            at = joined.find(HEAD_END)
            if at != -1 and offset + at + 4 - len(self._tail) <= stop:
                return offset + at + 4 - len(self._tail)
        at = data.find(HEAD_END, offset, stop)
        return -1 if at == -1 else at + 4

    def _count(self, fed: int) -> bool:
        """Count a slice's bytes against its message's budget; False once refused."""
        self._body_bytes += self._slice_body
        self._overhead += fed - self._slice_body
        budget = self.limits.max_header_bytes + self._body_bytes // FRAMING_SHARE
        if self._overhead > budget:
            if self._body_bytes or self._in_body or self._completed:
                message = (
                    f"the request's head, chunk framing and trailers exceed {budget} bytes "
                    f"(max_header_bytes {self.limits.max_header_bytes}, plus 1/{FRAMING_SHARE} of the body)"
                )
            else:
                message = f"request head exceeds {self.limits.max_header_bytes} bytes"
            self._refuse(HeaderTooLarge(message))
            return False
        if self._completed:
            self._overhead = self._body_bytes = 0
        return True

    def _account(self) -> None:
        """After a read: is this connection still sending a request, waiting for answers, or idle?"""
        if self.transport.is_closing() or self._discarding:
            return
        if not self._admitted:
            if self._unanswered:  # its head is in: the answer can go now, and nothing more is read
                self._refuse(TooManyConnections("the server holds its maximum of open connections; retry shortly"))
            return
        if self._overhead or self._in_body:
            # A head in progress behind requests not yet answered is never one to close: those are whole.
            in_head = not self._in_body and not self._unanswered
            admitted, victim = self.budget.still_receiving(self, in_head=in_head)
            if victim is not None:  # the slowest head still arriving makes room for this request
                victim.transport.close()
            if not admitted:
                self._warn_cap(
                    f"{self.budget.receiving} connections still sending their requests: refusing more with 503"
                )
                self._refuse(TooManyConnections("too many connections are still sending their requests; retry shortly"))
        elif self._unanswered or self._holding():
            self.budget.busy(self)
        else:
            self.budget.idle(self)

    def take_turn(self) -> None:
        """This connection's turn (app/http/transport/budgets.py): start its next pipelined request, parse what waited."""
        if self.transport.is_closing():
            return
        if self._completion_deferred:
            self._completion_deferred = False
            self._answer_ended()  # pops the next pipelined request and starts its task
            if self.transport.is_closing():
                return
        self._feed_held()

    def _feed_held(self) -> None:
        if self._holding() and self.parser is not None and not self._discarding and not self.transport.is_closing():
            self._feed()
            self._account()

    def _should_upgrade(self) -> bool:
        # Never: uvicorn would hand the connection to a WebSocket implementation when one is
        # installed and `ws` is not "none" (a test's or an embedder's config); here an upgrade
        # is always answered as plain HTTP (`_answer_upgrade_plainly`).
        return False

    def _answer_upgrade_plainly(self) -> None:
        """An Upgrade (WebSocket, h2c, CONNECT): answered as plain HTTP, then closed; what follows its head is dropped."""
        if self.cycle is not None:
            self.cycle.keep_alive = False
        self._discarding = True
        self.flow.held = True
        self.flow.pause_reading()

    # ----- parser callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        # uvicorn's, less its ASGI scope: a request the lean path serves needs none, and the scope
        # (a dict, and a copy of the app's state) is built only for one that goes to the app.
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self.scope = None  # type: ignore[assignment]
        self._head_begun = True

    def _begin_scope(self) -> None:
        """The request's ASGI scope, as uvicorn's on_message_begin makes it (on_headers_complete fills in the rest)."""
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": "1.1",
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,
            "root_path": self.root_path,
            "headers": self.headers,
            "state": self.app_state.copy(),
            ON_DISCONNECT: None,  # see app/http/endpoints.py: unless_disconnected
        }
        self.scope = cast(Any, scope)

    def on_header(self, name: bytes, value: bytes) -> None:
        # uvicorn's, inlined (it runs for every header line): trailers are dropped.
        if self._in_body:
            return  # a trailer field: counted in the message's budget, never one of its headers
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        lean = None
        door = self._lean_door
        if (
            door is not None
            and (match := door.paths.fullmatch(self.url)) is not None
            and self._admitted
            and (self.cycle is None or self.cycle.response_complete)
        ):
            lean = door.admit(self, match)  # None: the request goes the full way, through the app
        if lean is None:
            self._begin_scope()
            super().on_headers_complete()
            self.cycle.transport = OneWriteAnswers(self.transport, self.loop)  # type: ignore[assignment]
            if self.closing:
                self.cycle.keep_alive = False  # uvicorn says Connection: close and closes after the answer
        else:
            self.cycle = self._lean = lean  # type: ignore[assignment]
        self._unanswered += 1
        self._in_body = True
        self._body_left = self._content_length()
        # A large body of a lean request skips the parser (_take_lean_body); a small one is not worth a new parser.
        self._body_past_parser = lean is not None and (self._body_left or 0) >= BODY_PAST_PARSER_BYTES
        self._body_started = self._last_progress = time.monotonic()
        self._body_paused_base = self.flow.paused_s()

    def on_body(self, body: bytes) -> None:
        self._slice_body += len(body)
        if self._body_left is not None:
            self._body_left -= len(body)
        if self._lean is not None and self.cycle is self._lean:
            self._lean.body(body)
        else:
            super().on_body(body)

    def _take_lean_body(self, data: bytes | bytearray, offset: int, end: int) -> None:
        """A lean request's Content-Length body, data[offset:end], handed to it without the parser.

        httptools would copy every body slice into a bytes object of its own (and the request join
        them again); here a slice that is nearly all of its read is handed over as a view of it, no
        copy, and one in a read with more other bytes (a head, the next request) is copied: a view
        keeps alive at most 1/VIEW_SLACK more than the body's own bytes, which the process's held
        bytes count. Once the body is whole the message is complete, and a fresh parser, which has
        seen no body to wait for, reads the connection's next message.
        """
        size = end - offset
        if VIEW_SLACK * (len(data) - size) <= size and isinstance(data, bytes):
            chunk: bytes | memoryview = data if offset == 0 and end == len(data) else memoryview(data)[offset:end]
        else:
            chunk = bytes(data[offset:end])
        self.on_body(chunk)  # type: ignore[arg-type]
        if self._body_left == 0:
            self.on_message_complete()
            self.parser = httptools.HttpRequestParser(self)

    # ----- a large lean body, read straight into its buffer (app/http/transport/direct_body.py) ---

    def _read_body_directly(self) -> None:
        """After a read that left a lean body's rest of DIRECT_BODY_BYTES or more: read that rest into its buffer."""
        lean = self._lean_body_arriving()
        if lean is None or self._holding():
            return
        received = lean.body_so_far()
        left = self._body_left or 0
        self._direct = DirectBody(self, received, sum(len(chunk) for chunk in received) + left)
        self.transport.set_protocol(self._direct)

    def reads_directly(self, reader: DirectBody) -> bool:
        return reader is self._direct and bool(self._body_left) and self._lean_body_arriving() is not None

    def _lean_body_arriving(self) -> LeanRequest | None:
        """The lean request whose body this connection is reading, unless it was refused, or the connection is going."""
        lean = self._lean
        if lean is None or self.cycle is not lean or self._discarding or self.transport.is_closing():
            return None
        return lean

    def take_transport_back(self, reader: DirectBody) -> None:
        if reader is self._direct:
            self._direct = None
        if self.transport.get_protocol() is reader:
            self.transport.set_protocol(self)

    def body_read(self, reader: DirectBody, nbytes: int) -> None:
        """`nbytes` more of the lean body in `reader`: the budgets and clocks of a body slice fed, then its end."""
        self._unset_keepalive_if_required()
        self._last_progress = time.monotonic()
        self._slice_body, self._completed = nbytes, False
        self._body_left = (self._body_left or 0) - nbytes
        if self._body_left == 0:
            self.take_transport_back(reader)
            assert self._lean is not None, "reads_directly said the lean request is there; this is a bug."
            self._lean.body(reader.take_body())
            self.on_message_complete()
            self.parser = httptools.HttpRequestParser(self)
        if not self._count(nbytes) or self.transport.is_closing():
            return
        if self._lean_ready is not None:
            # Once this read's callback has returned: the loop holds the buffer until then, and a body
            # its decoder copies (JSON, .npy, V2, KServe V1) lets it go before the parse (LeanRequest.complete).
            ready, self._lean_ready = self._lean_ready, None
            self.loop.call_soon(ready.complete)
        self._account()

    def on_message_complete(self) -> None:
        if self._lean is not None and self.cycle is self._lean:
            self._lean_ready = self._lean  # served once the parser has returned (_feed), not inside its callback
        else:
            super().on_message_complete()
        self._completed = True
        self._line_end, self._line_done = b"", False
        self._head_begun = self._in_body = False
        self._body_left = None
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def on_response_complete(self) -> None:
        if self._lean is not None and self._lean.response_complete:
            self._lean = None
        self._unanswered -= 1
        self._completed = False
        if self.pipeline and not self.transport.is_closing():
            # A pipelined request, parsed, waits: it starts on this connection's turn, where
            # uvicorn's own end of this answer (which starts it) runs.
            self._completion_deferred = True
            self.turns.ask(self, self.loop)
            return
        self._answer_ended()
        if self.transport.is_closing():
            return
        if self._holding():
            self.turns.ask(self, self.loop)  # room for another request: what waited is parsed on its turn
        else:
            self._idle_since = self.loop.time()
            self._arm_head_timer()
            if not (self._unanswered or self._overhead or self._in_body):
                self.budget.idle(self)

    def _content_length(self) -> int | None:
        """The body's length as the parser reads it (one Content-Length of digits); None if chunked."""
        for name, value in self.headers:
            if name == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return None
        return None if any(name == b"transfer-encoding" for name, _ in self.headers) else 0

    # ----- closing while the server drains -----------------------------------------------------

    def shutdown(self) -> None:
        """Close gracefully: the last answer under way says `Connection: close`; an idle connection
        is closed once it has been quiet for IDLE_CLOSE_S (uvicorn's own closes it at once)."""
        if self.cycle is not None and not self.cycle.response_complete:
            # `cycle` is the newest request parsed: those pipelined before it are answered first.
            self.cycle.keep_alive = False
        elif not self._receiving_request():
            self._close_when_quiet()
        # else a request's head is arriving: its answer will say Connection: close

    def _receiving_request(self) -> bool:
        return self._head_begun or bool(self._overhead) or self._in_body or self._holding()

    def _close_when_quiet(self) -> None:
        if self._quiet_timer is None:
            self._quiet_timer = self.loop.call_later(IDLE_CLOSE_S, self._close_if_idle)

    def _close_if_idle(self) -> None:
        self._quiet_timer = None
        answering = self.cycle is not None and not self.cycle.response_complete
        if answering or self._unanswered or self._receiving_request() or self.transport.is_closing():
            return
        if self._unread_bytes():
            self._close_when_quiet()  # a request the held loop has not read yet: look again once it has
        else:
            self.transport.close()

    def _answer_ended(self) -> None:
        """uvicorn's on_response_complete, its keep-alive timer a deadline on the connection's one timer."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self._deadlines.clear(KEEP_ALIVE_DUE)
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        else:
            self._deadlines.set(KEEP_ALIVE_DUE, self.timeout_keep_alive)

    def _unset_keepalive_if_required(self) -> None:
        # uvicorn's, called as bytes arrive and as the connection goes: here the deadline is cleared.
        self._deadlines.clear(KEEP_ALIVE_DUE)

    def timeout_keep_alive_handler(self) -> None:
        """uvicorn's keep-alive close, unless a request waits unread (the loop was held): reading it
        clears this deadline, and the head's still bounds the connection."""
        if not self._unread_bytes():
            super().timeout_keep_alive_handler()

    def _unread_bytes(self) -> int:
        """Bytes the client sent that the event loop has not read yet (FIONREAD on the socket)."""
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return 0
        try:
            unread: int = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, bytes(4)))[0]
        except (OSError, ValueError):  # closed meanwhile
            return 0
        return unread

    # ----- flow control: the send timeout ----------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is not None:
            self._send_timer.cancel()
        self._unsent_at_check = self.transport.get_write_buffer_size()
        self._send_timer = self.loop.call_later(self.limits.send_timeout_s, self._send_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_stalled(self) -> None:
        """The answer's unsent bytes stayed above the high-water mark: drop them unless the client read some."""
        unsent = self.transport.get_write_buffer_size()
        if unsent < self._unsent_at_check:  # slow, but reading: give it another period
            self._unsent_at_check = unsent
            self._send_timer = self.loop.call_later(self.limits.send_timeout_s, self._send_stalled)
            return
        self._send_timer = None
        log.info("dropping a connection that read none of %d answer bytes in %g s", unsent, self.limits.send_timeout_s)
        self.transport.abort()  # frees the unsent bytes; the request's task sees a disconnect

    # ----- the head timeout ------------------------------------------------------------------

    def _arm_head_timer(self) -> None:
        self._deadlines.set(HEAD_DUE, self.limits.header_timeout_s)

    def _head_timed_out(self) -> None:
        if self.transport.is_closing():
            return
        if self._head_begun or self._overhead:
            self._refuse(RequestTimeout(f"the request head did not arrive within {self.limits.header_timeout_s:g} s"))
        elif self._unread_bytes():
            self._arm_head_timer()  # a request the held loop has not read yet: its head gets a period of its own
        else:
            self.transport.close()  # an idle connection: closed quietly, as a keep-alive timeout does

    def _cancel_head_timer(self) -> None:
        self._deadlines.clear(HEAD_DUE)

    # ----- the body's pause bound and deadline -----------------------------------------------

    def _check_body(self) -> None:
        """408 if the body paused for read_timeout_s, or came slower than its deadline allows; else look again later."""
        self._body_timer = None
        if not self._in_body or self.transport.is_closing():
            return
        limits = self.limits
        now = time.monotonic()
        if self.flow.read_paused:  # the server is not reading: the client cannot be late
            self._body_timer = self.loop.call_later(limits.read_timeout_s, self._check_body)
            return
        pause = now - max(self._last_progress, self.flow.resumed_at)
        if pause >= limits.read_timeout_s:
            # The app, still reading the body, sees the client gone; the client gets this answer.
            self._refuse(RequestTimeout(f"no part of the body arrived for {limits.read_timeout_s:g} s"))
            return
        sending = now - self._body_started - (self.flow.paused_s() - self._body_paused_base)
        allowed = limits.read_timeout_s + (self._body_bytes / limits.min_body_rate if limits.min_body_rate else sending)
        if sending >= allowed:
            self._refuse(
                RequestTimeout(
                    f"the body came slower than min_body_rate ({limits.min_body_rate} bytes/s): "
                    f"{self._body_bytes} bytes in {sending:.0f} s"
                )
            )
            return
        self._body_timer = self.loop.call_later(
            max(0.01, min(limits.read_timeout_s - pause, allowed - sending)), self._check_body
        )

    def _cancel_timers(self) -> None:
        self._deadlines.close()
        for timer in (self._quiet_timer, self._body_timer, self._send_timer):
            if timer is not None:
                timer.cancel()
        self._quiet_timer = self._body_timer = self._send_timer = None

    # ----- answering an error from the protocol ----------------------------------------------

    def _refuse(self, error: ServiceError) -> None:
        """Answer `error` as the error table says, with the JSON error body, and close.

        A request whose body turns out malformed is answered here, its task told the client left.
        With an earlier request's answer pending (a pipelined head went wrong), only close.
        """
        self._cancel_timers()
        self._drop_unparsed()
        self.budget.busy(self)
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # This request's own head is parsed (its body incomplete, or just completed) or not yet.
            own = self._in_body or self._completed
            earlier_pending = self._unanswered > (1 if own else 0)
            if cycle.response_started or earlier_pending:
                self.transport.abort()
                return
            cycle.disconnected = True  # the app's answer, if any, is dropped: this one goes instead
            cycle.message_event.set()
            if isinstance(cycle, LeanRequest):
                cycle.abandon()
                self._lean = self._lean_ready = None
            # A task not yet begun (the head was parsed in this very read) never enters the app:
            # a refusal costs the protocol's answer, not the app's whole stack.
            cast(dict[str, Any], cycle.scope)[REFUSED] = True
        if cycle is not None and isinstance(cycle.transport, OneWriteAnswers):
            cycle.transport.flush()  # an earlier answer's last write, held for this turn, goes first
        kind = kind_of(error)
        request_id = new_request_id()
        body = error_body(error.message, kind.error_type, request_id)
        head = [httptools_impl.STATUS_LINE[kind.status]]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [f"{name}: {value}\r\n".encode("latin-1") for name, value in kind.headers(error).items()]
        head += [
            b"content-type: application/json\r\n",
            b"x-request-id: " + request_id.encode("ascii") + b"\r\n",
            b"content-length: %d\r\n" % len(body),
        ]
        if not any(name.lower() == "connection" for name in kind.headers(error)):
            head.append(b"connection: close\r\n")
        self.transport.write(b"".join(head) + b"\r\n" + body)
        self._linger()

    def _linger(self) -> None:
        """Half-close after the answer, drop what still arrives, and close after LINGER_S at most."""
        self._discarding = True
        self.budget.idle(self)  # its answer is written: the first to close if a new connection needs room
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self._close_after_linger)

    def _close_after_linger(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def _warn_cap(self, message: str) -> None:
        now = time.monotonic()
        if now - LimitedHttpToolsProtocol._last_cap_warning > CAP_WARNING_EVERY_S:
            LimitedHttpToolsProtocol._last_cap_warning = now
            log.warning("%s (max_connections %d)", message, self.limits.max_connections)


class OneWriteAnswers:
    """The transport as a request's cycle sees it: a write is held until the loop's next turn, and
    one that follows in the same turn goes out with it in one write.

    uvicorn writes an answer's head, then its body: two writes. A process killed between them (a
    SIGKILL, a crash) leaves its client a head without a body; behind a proxy that has passed the
    head on, the request can no longer be sent to another replica. In one write, the whole answer
    reaches the socket, whose data the kernel still sends after the process is gone, or none of
    it does, and the proxy retries. The two go out as one vectored write (`writelines`: uvloop's
    one writev), so that a body of any size joins its head without being copied.
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        held, self._held = self._held, None
        if held is None:
            if len(data) <= ONE_WRITE_BYTES:
                self._held = data
                self._loop.call_soon(self.flush)
            else:
                self._transport.write(data)
        else:
            self._transport.writelines((held, data))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def flush(self) -> None:
        """Write what is held now (the loop's next turn does it otherwise)."""
        if self._held is not None:
            held, self._held = self._held, None
            self._transport.write(held)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
