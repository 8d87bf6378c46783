"""uvicorn's httptools HTTP/1.1 protocol, with the limits it lacks against hostile clients.

uvicorn buffers a request's whole head before the app sees it, waits forever for a head that
never ends, keeps an answer nobody reads in memory forever, and accepts any number of
connections. Each connection here:

- counts the bytes of a head as they arrive and answers 431 once they pass `max_header_bytes`
  (the app's guard checks a head that arrived whole), so a header flood costs one read buffer;
- must send its head within `header_timeout_s` of opening or of its previous answer: 408 if a
  head had begun, a quiet close if nothing came (as a keep-alive timeout does);
- must not pause for `read_timeout_s` inside a body: 408 (the timer runs only while a body is
  incomplete, so a request that arrives in one piece, the common case, never arms it; and it
  does not count the time the server itself stopped reading because the app was behind);
- is dropped when an answer's unsent bytes make no progress for `send_timeout_s`, which frees them;
- past `max_connections` open ones, gets 503 `too_many_connections` and is closed;
- once the server drains (`close_connections`), answers with `Connection: close`, and is closed
  when idle: a client is never left with a request on a connection the process is about to close;
- writes an answer's head and its body (up to ONE_WRITE_BYTES) in one write: a process killed
  between two writes would leave a head without its body, which a proxy can no longer retry.

It also tells a request that its client left, through the callback the request left in its
scope under ON_DISCONNECT (app/web/http.py: unless_disconnected), so that no task per request
has to wait for the disconnect message.

Parser-level refusals (malformed request line, bad header bytes, broken chunked framing) get
the service's JSON error body instead of uvicorn's text/plain, with a request id of their own
(body and X-Request-Id), as every answer has. After an error answer the
connection lingers briefly, reading and discarding, so that a client still sending reads the
answer instead of a reset.

It relies on private members of uvicorn's protocol; app/web/uvicorn_members.py lists them, and
ffn-serve checks them before serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import httptools
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.errors import ServiceError
from app.request_context import new_request_id
from app.settings import Settings
from app.web.errors import (
    HeaderTooLarge,
    InvalidInput,
    RequestTimeout,
    TooManyConnections,
    error_body,
    error_response,
    kind_of,
)
from app.web.http import ON_DISCONNECT
from app.web.request_ids import RequestIds

log = logging.getLogger("ffn_serve")

LINGER_S = 2.0  # after an error answer: how long to read and discard before closing
# While draining, an idle connection is closed once quiet this long: a client that has just read
# an answer may be writing its next request, which a close at that moment would lose.
IDLE_CLOSE_S = 0.5
# Answers up to this size reach the socket in one write (a larger body is not copied to join its head).
ONE_WRITE_BYTES = 64 * 1024
CAP_WARNING_EVERY_S = 60.0  # one log line per minute at most while connections are refused


@dataclass(frozen=True)
class ConnectionLimits:
    """What one connection may cost: head size and time, answer send time, and how many are open."""

    max_header_bytes: int
    header_timeout_s: float
    read_timeout_s: float
    send_timeout_s: float
    max_connections: int

    @classmethod
    def from_settings(cls, settings: Settings) -> ConnectionLimits:
        return cls(
            settings.max_header_bytes,
            settings.header_timeout_s,
            settings.read_timeout_s,
            settings.send_timeout_s,
            settings.max_connections,
        )


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """The uvicorn.Config arguments that put this protocol, with the settings' limits, under the app."""
    limits = ConnectionLimits.from_settings(settings)
    protocol = type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})
    return {"http": protocol}


async def _refuse_connection(scope: Scope, receive: Receive, send: Send) -> None:
    await error_response(TooManyConnections("the server holds its maximum of open connections; retry shortly"))(
        scope, receive, send
    )


_too_many_connections = RequestIds(_refuse_connection)  # the app of a connection past the cap


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with a bounded head, head and send timeouts, and a connection cap."""

    limits: ClassVar[ConnectionLimits]
    closing: ClassVar[bool] = False  # the server drains: every connection closes after its answer
    _last_cap_warning: ClassVar[float] = 0.0

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
        self._reading_head = True  # between one message's end and the next one's headers
        self._head_begun = False
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._awaiting_body = False  # a request's head is in, its body is not yet complete
        self._body_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._unsent_at_check = 0
        self._lingering = False

    # ----- connection ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.app = _too_many_connections  # answered once its head arrives, then closed
            now = time.monotonic()
            if now - LimitedHttpToolsProtocol._last_cap_warning > CAP_WARNING_EVERY_S:
                LimitedHttpToolsProtocol._last_cap_warning = now
                log.warning(
                    "%d connections open: refusing new ones with 503 (max_connections)", len(self.connections) - 1
                )
        self._idle_since = self.loop.time()
        self._arm_head_timer()
        if self.closing:
            self._close_when_quiet()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and cycle.disconnected:
            hang_up: Callable[[], None] | None = cast(dict[str, Any], cycle.scope).get(ON_DISCONNECT)
            if hang_up is not None:
                hang_up()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # an error was answered; what the client still sends is dropped
        if self._reading_head:
            self._head_bytes += len(data)
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._refuse(InvalidInput(f"malformed HTTP request: {exc}"))
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        if self._reading_head and self._head_bytes > self.limits.max_header_bytes:
            self._refuse(HeaderTooLarge(f"request head exceeds {self.limits.max_header_bytes} bytes"))
        elif self._awaiting_body:  # part of a body came, the rest must follow in time
            self._arm_body_timer()

    def send_400_response(self, msg: str) -> None:
        self._refuse(InvalidInput(f"malformed HTTP request: {msg}"))

    # ----- parser callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_begun = True
        cast(dict[str, Any], self.scope)[ON_DISCONNECT] = None  # see http.py: unless_disconnected

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._awaiting_body = True
        self._cancel_head_timer()
        super().on_headers_complete()
        self.cycle.transport = OneWriteAnswers(self.transport, self.loop)  # type: ignore[assignment]
        if self.closing:
            self.cycle.keep_alive = False  # uvicorn says Connection: close and closes after the answer

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading_head, self._head_begun, self._head_bytes = True, False, 0
        self._awaiting_body = False
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def on_response_complete(self) -> None:
        idle = not self.pipeline  # otherwise a pipelined request, its head complete, starts now
        super().on_response_complete()
        if idle and not self.transport.is_closing():
            self._idle_since = self.loop.time()
            self._arm_head_timer()

    # ----- closing while the server drains -----------------------------------------------------

    def shutdown(self) -> None:
        """Close gracefully: the answer under way says `Connection: close`; an idle connection is
        closed once it has been quiet for IDLE_CLOSE_S (uvicorn's own closes it at once)."""
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False
        elif not (self._head_begun or self._head_bytes):
            self._close_when_quiet()
        # else a request's head is arriving: its answer will say Connection: close

    def _close_when_quiet(self) -> None:
        if self._quiet_timer is None:
            delay = max(0.0, self._idle_since + IDLE_CLOSE_S - self.loop.time())
            self._quiet_timer = self.loop.call_later(delay, self._close_if_idle)

    def _close_if_idle(self) -> None:
        self._quiet_timer = None
        busy = (self.cycle is not None and not self.cycle.response_complete) or self._head_begun or self._head_bytes
        if not busy and not self.transport.is_closing():
            self.transport.close()

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
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._head_begun or self._head_bytes:
            self._refuse(RequestTimeout(f"the request head did not arrive within {self.limits.header_timeout_s:g} s"))
        else:
            self.transport.close()  # an idle connection: closed quietly, as a keep-alive timeout does

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    # ----- the body timeout ------------------------------------------------------------------

    def _arm_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
        self._body_timer = self.loop.call_later(self.limits.read_timeout_s, self._body_timed_out)

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:
            # The server stopped reading (the app has not yet taken what came, as on a busy
            # machine): the pause is ours, not the client's. The timeout counts again from now.
            self._arm_body_timer()
            return
        # The app, still reading the body, sees the client gone; the client gets this answer.
        self._refuse(RequestTimeout(f"no part of the body arrived for {self.limits.read_timeout_s:g} s"))

    def _cancel_timers(self) -> None:
        self._cancel_head_timer()
        if self._quiet_timer is not None:
            self._quiet_timer.cancel()
            self._quiet_timer = None
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    # ----- answering an error from the protocol ----------------------------------------------

    def _refuse(self, error: ServiceError) -> None:
        """Answer `error` as the error table says, with the JSON error body, and close.

        A request whose body turns out malformed is answered here, its task told the client left.
        With another request's answer pending (a pipelined head went wrong), only close.
        """
        self._cancel_timers()
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started or self._reading_head:
                self.transport.abort()
                return
            cycle.disconnected = True  # the app's answer, if any, is dropped: this one goes instead
            cycle.message_event.set()
        kind = kind_of(error)
        request_id = new_request_id()
        body = error_body(error.message, kind.error_type, request_id)
        head = [httptools_impl.STATUS_LINE[kind.status]]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [
            b"content-type: application/json\r\n",
            b"x-request-id: " + request_id.encode("ascii") + b"\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
        ]
        self.transport.write(b"".join(head) + body)
        self._linger()

    def _linger(self) -> None:
        """Half-close after the answer, drop what still arrives, and close after LINGER_S at most."""
        self._lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self._close_after_linger)

    def _close_after_linger(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()


class OneWriteAnswers:
    """The transport as a request's cycle sees it: a write is held until the loop's next turn, and
    one that follows in the same turn goes out with it in one write.

    uvicorn writes an answer's head, then its body: two writes. A process killed between them (a
    SIGKILL, a crash) leaves its client a head without a body; behind a proxy that has passed the
    head on, the request can no longer be sent to another replica. In one write, the whole answer
    reaches the socket, whose data the kernel still sends after the process is gone, or none of
    it does, and the proxy retries. A body above ONE_WRITE_BYTES is written apart, not copied.
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
                self._loop.call_soon(self._flush)
            else:
                self._transport.write(data)
        elif len(data) <= ONE_WRITE_BYTES:
            self._transport.write(held + data)
        else:
            self._transport.write(held)
            self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def _flush(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            self._transport.write(held)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
