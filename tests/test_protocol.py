"""app/http/transport/protocol.py on its own: uvicorn's HTTP/1.1 protocol fed in slices within each connection's
budgets (issue 20: every non-body byte of a message, pipelined requests, the body's rate, the
cap's idle and receiving connections), a bounded, timed head, a body timeout and a send timeout.

The protocol serves a few-line ASGI app in this process: on a real loopback socket (asyncio's
create_server, as uvicorn runs it) or fed by hand through a fake transport where the test must
choose how the bytes are cut. Timeouts are short, and each test waits for the answer or for the
server's own state (its open connections), never for a fixed time; a request's bytes are sent
before the server accepts its connection. A slow machine only makes a test take longer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import socket
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from uvicorn import Config
from uvicorn.protocols.http import httptools_impl
from uvicorn.server import ServerState

from app import cli
from app.config.settings import Settings
from app.http.transport import uvicorn_members
from app.http.transport.budgets import ConnectionBudget, PipelineTurns
from app.http.transport.protocol import MAX_UNANSWERED, ConnectionLimits, LimitedHttpToolsProtocol, uvicorn_options
from ffn_client.http1 import Response, build_request, read_response

HOST = "127.0.0.1"
BOUND_S = 30.0  # how long any answer may take on a loaded machine before the test fails
LONG = 60.0  # a timeout no test reaches
SHORT = 0.2  # a timeout a test waits out
SLOW_S = 0.5  # an app that takes longer than SHORT
LIMITS = ConnectionLimits(
    max_header_bytes=1024, header_timeout_s=LONG, read_timeout_s=LONG, send_timeout_s=LONG, max_connections=64
)

# ----- the app and the server --------------------------------------------------------------------


@dataclass
class Seen:
    path: str
    headers: list[tuple[bytes, bytes]]
    body: bytes


@dataclass
class EchoApp:
    """Answers 200 with {"path", "body_bytes"} once the whole body is in; records disconnects it sees.

    A request to /big is answered with `big_bytes` bytes instead, for the send timeout; one to
    /slow... after SLOW_S, longer than any short timeout here.
    """

    big_bytes: int = 8 << 20
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    reading: asyncio.Event = field(default_factory=asyncio.Event)  # cleared: the app has not read the body yet
    started: int = 0  # requests the app was called for
    seen: list[Seen] = field(default_factory=list)  # each request the app read whole, in order

    def __post_init__(self) -> None:
        self.reading.set()

    async def __call__(
        self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]], send: Any
    ) -> None:
        assert scope["type"] == "http"
        self.started += 1
        await self.reading.wait()
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnected.set()
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        size = len(body)
        self.seen.append(Seen(scope["path"], list(scope["headers"]), body))
        if scope["path"].startswith("/slow"):
            await asyncio.sleep(SLOW_S)
        if scope["path"] == "/big":
            body = b"x" * self.big_bytes
            content_type = b"application/octet-stream"
        else:
            body = orjson.dumps({"path": scope["path"], "body_bytes": size})
            content_type = b"application/json"
        headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def protocol_class(limits: ConnectionLimits) -> type[LimitedHttpToolsProtocol]:
    """The protocol with `limits`, and a connection cap of its own, as uvicorn_options makes it."""
    budget: ConnectionBudget[LimitedHttpToolsProtocol] = ConnectionBudget(limits.max_connections)
    return type(
        "TestProtocol", (LimitedHttpToolsProtocol,), {"limits": limits, "budget": budget, "turns": PipelineTurns()}
    )


def uvicorn_config(app: EchoApp) -> Config:
    # uvicorn's own keep-alive timeout stays out of the way: the head timeout is what closes an idle connection.
    config = Config(
        app, log_config=None, server_header=False, date_header=False, proxy_headers=False, timeout_keep_alive=600
    )
    config.load()
    return config


@dataclass
class Served:
    port: int
    state: ServerState
    app: EchoApp
    budget: ConnectionBudget[LimitedHttpToolsProtocol]

    def only_connection(self) -> LimitedHttpToolsProtocol:
        (protocol,) = self.state.connections
        assert isinstance(protocol, LimitedHttpToolsProtocol)
        return protocol

    async def connect(self, first: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection whose `first` bytes are sent before the server can accept it.

        The connect and send block (on loopback the kernel completes both at once), so the bytes
        are waiting when the server's timers start: however slow the machine, no short timeout
        can fire between the accept and their arrival (the event loop reads before it runs timers).
        """
        sock = socket.create_connection((HOST, self.port))
        sock.sendall(first)
        sock.setblocking(False)
        return await asyncio.open_connection(sock=sock)

    async def until_connections(self, count: int) -> None:
        """Wait until the server holds `count` open connections (it sees opens and closes a moment late)."""
        await until(lambda: len(self.state.connections) == count, f"{count} open connections")


@asynccontextmanager
async def serving(limits: ConnectionLimits = LIMITS, app: EchoApp | None = None) -> AsyncIterator[Served]:
    """The protocol with `limits` on a loopback port of this event loop, as uvicorn.Server runs it."""
    app = app or EchoApp()
    config, state = uvicorn_config(app), ServerState()
    loop = asyncio.get_running_loop()
    make = protocol_class(limits)
    server = await loop.create_server(
        lambda: make(config=config, server_state=state, app_state={}, _loop=loop), HOST, 0
    )
    try:
        yield Served(server.sockets[0].getsockname()[1], state, app, make.budget)
    finally:
        server.close()
        for connection in list(state.connections):
            connection.transport.abort()
        await server.wait_closed()


async def until(condition: Callable[[], bool], what: str, bound: float = BOUND_S) -> None:
    loop = asyncio.get_running_loop()
    give_up = loop.time() + bound
    while not condition():
        if loop.time() > give_up:
            raise AssertionError(f"not seen within {bound:g} s: {what}")
        await asyncio.sleep(0.01)


async def answer(reader: asyncio.StreamReader) -> Response:
    return await asyncio.wait_for(read_response(reader), BOUND_S)


async def until_closed(reader: asyncio.StreamReader) -> bytes:
    """What the server sends until it closes (a reset counts as closed)."""
    data = b""
    try:
        async with asyncio.timeout(BOUND_S):
            while chunk := await reader.read(65536):
                data += chunk
    except ConnectionResetError:
        pass
    return data


def json_error(r: Response, status: int, error_type: str) -> dict[str, Any]:
    assert r.status == status, (r.status, r.body[:300])
    assert r.headers["content-type"] == "application/json"
    assert r.headers["connection"] == "close"
    body = r.json()
    assert isinstance(body, dict) and set(body) == {"error", "error_type", "request_id"}
    assert body["error_type"] == error_type and body["request_id"] == r.headers["x-request-id"]
    return body


def request(method: str, path: str, body: bytes = b"", **headers: str) -> bytes:
    return build_request(method, path, {k.replace("_", "-"): v for k, v in headers.items()}, body, host="x")


# ----- a fake transport: the test decides how the bytes are cut --------------------------------


class FakeTransport(asyncio.Transport):
    """Records what the protocol writes; `wrote` is set on every write."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.wrote = asyncio.Event()
        self.eof_written = False
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closed, "written after close"
        self.written += data
        self.wrote.set()

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof_written = True

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    async def response(self) -> Response:
        """The first answer written, once it is whole."""
        while True:
            reader = asyncio.StreamReader()
            reader.feed_data(bytes(self.written))
            reader.feed_eof()
            try:
                return await read_response(reader)
            except (ConnectionError, asyncio.IncompleteReadError):
                self.wrote.clear()
                await asyncio.wait_for(self.wrote.wait(), BOUND_S)


@pytest.fixture
async def fed() -> AsyncIterator[tuple[LimitedHttpToolsProtocol, FakeTransport]]:
    """A protocol on a fake transport, with LIMITS; connection_lost when the test ends."""
    loop = asyncio.get_running_loop()
    protocol = protocol_class(LIMITS)(
        config=uvicorn_config(EchoApp()), server_state=ServerState(), app_state={}, _loop=loop
    )
    transport = FakeTransport()
    protocol.connection_made(transport)
    yield protocol, transport
    protocol.connection_lost(None)


# ----- the head: size counted as it arrives ------------------------------------------------------


async def test_a_head_fed_a_few_bytes_at_a_time_gets_431_once_past_max_header_bytes(fed) -> None:
    protocol, transport = fed
    head = b"GET /x HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (4 * LIMITS.max_header_bytes)  # never ends
    sent = 0
    while sent <= LIMITS.max_header_bytes:
        assert transport.written == b"", f"answered after {sent} bytes, within the limit"
        protocol.data_received(head[sent : sent + 5])
        sent += 5
    r = await transport.response()
    body = json_error(r, 431, "header_too_large")
    assert str(LIMITS.max_header_bytes) in body["error"]
    assert transport.eof_written, "the answer is followed by a half-close"
    answered = len(transport.written)
    protocol.data_received(head[sent : sent + 500])  # the client goes on: dropped, not parsed nor answered
    assert len(transport.written) == answered


async def test_a_head_within_the_limit_fed_a_few_bytes_at_a_time_is_served(fed) -> None:
    protocol, transport = fed
    head = request("GET", "/pieces", X_Pad="a" * (LIMITS.max_header_bytes - 100))
    assert len(head) <= LIMITS.max_header_bytes
    for at in range(0, len(head), 3):
        protocol.data_received(head[at : at + 3])
    r = await transport.response()
    assert r.status == 200 and r.json() == {"path": "/pieces", "body_bytes": 0}


async def test_a_head_over_the_limit_on_a_socket_gets_431_before_it_ends() -> None:
    async with serving() as served:
        reader, writer = await served.connect(b"GET / HTTP/1.1\r\nHost: x\r\n")
        pieces = (b"X-%04d: %s\r\n" % (i, b"a" * 20) for i in range(1000))  # 30 KB, the limit is 1 KB
        answered = asyncio.ensure_future(answer(reader))
        for piece in pieces:
            if answered.done():
                break
            try:
                writer.write(piece)
                await writer.drain()
            except ConnectionError:
                break
        json_error(await answered, 431, "header_too_large")
        assert await until_closed(reader) == b""
        writer.close()


async def test_a_malformed_head_gets_the_json_400() -> None:
    async with serving() as served:
        reader, writer = await served.connect(b"GET / HTTP/1.1\r\nHost: x\r\nNo colon here\r\n\r\n")
        body = json_error(await answer(reader), 400, "invalid_input")
        assert "malformed HTTP request" in body["error"]
        writer.close()


# ----- the head and body timeouts ----------------------------------------------------------------


async def test_a_head_that_stops_arriving_gets_408() -> None:
    limits = ConnectionLimits(1024, header_timeout_s=SHORT, read_timeout_s=LONG, send_timeout_s=LONG, max_connections=8)
    async with serving(limits) as served:
        reader, writer = await served.connect(b"GET / HTTP/1.1\r\nHost: x\r\n")  # ... and no end
        body = json_error(await answer(reader), 408, "request_timeout")
        assert "head" in body["error"]
        assert await until_closed(reader) == b""
        writer.close()


async def test_a_connection_that_never_speaks_is_closed_quietly() -> None:
    limits = ConnectionLimits(1024, header_timeout_s=SHORT, read_timeout_s=LONG, send_timeout_s=LONG, max_connections=8)
    async with serving(limits) as served:
        reader, writer = await served.connect()
        assert await until_closed(reader) == b""
        writer.close()


async def test_the_head_timeout_restarts_after_each_answer_on_a_kept_alive_connection() -> None:
    limits = ConnectionLimits(1024, header_timeout_s=SHORT, read_timeout_s=LONG, send_timeout_s=LONG, max_connections=8)
    async with serving(limits) as served:
        reader, writer = await served.connect(request("GET", "/first"))
        r = await answer(reader)
        assert r.status == 200 and r.keep_alive
        assert await until_closed(reader) == b"", "an idle kept-alive connection is closed, without an answer"
        writer.close()


async def test_a_body_that_stops_arriving_gets_408_and_the_app_sees_a_disconnect() -> None:
    limits = ConnectionLimits(1024, header_timeout_s=LONG, read_timeout_s=SHORT, send_timeout_s=LONG, max_connections=8)
    async with serving(limits) as served:
        reader, writer = await served.connect(
            request("POST", "/body", b"0123456789", Content_Length="100")
        )  # 90 bytes never come
        body = json_error(await answer(reader), 408, "request_timeout")
        assert "body" in body["error"]
        await asyncio.wait_for(served.app.disconnected.wait(), BOUND_S)
        writer.close()


async def test_the_body_timeout_does_not_count_while_the_server_stopped_reading() -> None:
    # uvicorn stops reading while the app is behind on the body (more than 64 KiB unread): on a
    # busy machine that pause can outlast the read timeout, and it is not the client's.
    limits = ConnectionLimits(1024, header_timeout_s=LONG, read_timeout_s=SHORT, send_timeout_s=LONG, max_connections=8)
    app = EchoApp()
    app.reading.clear()  # the app is busy elsewhere: it reads nothing yet
    loop = asyncio.get_running_loop()
    protocol = protocol_class(limits)(config=uvicorn_config(app), server_state=ServerState(), app_state={}, _loop=loop)
    transport = FakeTransport()
    protocol.connection_made(transport)
    try:
        protocol.data_received(request("POST", "/body", b"z" * (100 << 10), Content_Length=str(200 << 10)))
        assert protocol.flow.read_paused, "uvicorn stops reading past 64 KiB of unread body"
        await asyncio.sleep(3 * SHORT)  # three read timeouts pass while the server does not read
        assert transport.written == b"", "answered 408 for a pause the server made"
        app.reading.set()  # the app reads, so the server reads again; the client sends nothing more
        json_error(await transport.response(), 408, "request_timeout")
        await asyncio.wait_for(app.disconnected.wait(), BOUND_S)
    finally:
        protocol.connection_lost(None)


async def test_a_body_in_pieces_within_the_read_timeout_is_served() -> None:
    async with serving() as served:
        reader, writer = await served.connect(request("POST", "/body", b"", Content_Length="3000"))
        for _ in range(3):
            writer.write(b"z" * 1000)
            await writer.drain()
        r = await answer(reader)
        assert r.status == 200 and r.json() == {"path": "/body", "body_bytes": 3000}
        writer.close()


# ----- pipelining --------------------------------------------------------------------------------


async def test_pipelined_requests_are_answered_in_order_and_the_connection_stays_open() -> None:
    limits = ConnectionLimits(1024, header_timeout_s=SHORT, read_timeout_s=LONG, send_timeout_s=LONG, max_connections=8)
    async with serving(limits) as served:
        paths = ["/slow0", "/1", "/slow2", "/3"]
        reader, writer = await served.connect(b"".join(request("POST", p, b"b" * i) for i, p in enumerate(paths)))
        answers = [await answer(reader) for _ in paths]
        assert [r.json() for r in answers] == [{"path": p, "body_bytes": i} for i, p in enumerate(paths)]
        assert all(r.keep_alive for r in answers)
        # A pipelined request waits with its head complete, and the slow ones take longer than the
        # head timeout: it never cut them. Once idle, the connection gets that timeout again.
        assert await until_closed(reader) == b""
        writer.close()


# ----- the send timeout --------------------------------------------------------------------------


async def test_an_answer_nobody_reads_is_dropped_after_the_send_timeout(caplog) -> None:
    limits = ConnectionLimits(1024, header_timeout_s=LONG, read_timeout_s=LONG, send_timeout_s=SHORT, max_connections=8)
    async with serving(limits, EchoApp(big_bytes=32 << 20)) as served:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_connect(sock, (HOST, served.port))
            with caplog.at_level(logging.INFO, logger="ffn_serve"):
                await loop.sock_sendall(sock, request("GET", "/big"))
                await served.until_connections(1)
                await served.until_connections(0)  # never read: the server let go of it
            assert any("dropping a connection that read none" in r.getMessage() for r in caplog.records)
            received = 0
            try:
                while chunk := await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), BOUND_S):
                    received += len(chunk)
            except ConnectionResetError:
                pass
            assert received < 32 << 20, "the whole answer arrived: nothing was dropped"
        finally:
            sock.close()


# ----- the connection cap ------------------------------------------------------------------------


def limits_with(**changes: Any) -> ConnectionLimits:
    return dataclasses.replace(LIMITS, **changes)


async def test_at_the_cap_the_connection_idle_longest_makes_room() -> None:
    # Issue 20, class 5: silent connections held the cap until the head timeout; now a newcomer closes the oldest.
    async with serving(limits_with(max_connections=4)) as served:
        idle = [await served.connect() for _ in range(4)]
        await served.until_connections(4)
        reader, writer = await served.connect(request("GET", "/new"))
        r = await answer(reader)
        assert r.status == 200 and r.json() == {"path": "/new", "body_bytes": 0}
        assert await until_closed(idle[0][0]) == b""  # the oldest, closed quietly
        for _, other in [*idle, (reader, writer)]:
            other.close()


async def test_at_the_cap_with_no_idle_connection_a_new_one_gets_503_then_is_served_once_one_closes() -> None:
    app = EchoApp()
    app.reading.clear()  # every request waits in the app: its connection is busy, not idle
    async with serving(limits_with(max_connections=2), app) as served:
        busy = [await served.connect(request("GET", f"/busy{i}")) for i in range(2)]
        await until(lambda: app.started == 2, "two requests in the app")
        reader, writer = await served.connect(request("GET", "/over"))
        r = await answer(reader)
        json_error(r, 503, "too_many_connections")
        assert r.headers["retry-after"] == "1"
        writer.close()
        app.reading.set()
        for i, (busy_reader, busy_writer) in enumerate(busy):
            assert (await answer(busy_reader)).json() == {"path": f"/busy{i}", "body_bytes": 0}
            busy_writer.close()
        await served.until_connections(0)
        reader, writer = await served.connect(request("GET", "/again"))
        assert (await answer(reader)).json() == {"path": "/again", "body_bytes": 0}
        writer.close()
    assert app.started == 3 and [seen.path for seen in app.seen] == ["/busy0", "/busy1", "/again"]


async def test_connections_still_sending_their_request_hold_half_the_cap_at_most() -> None:
    # Issue 40, class 5: heads trickled in filled the receiving half, and a client whose request came
    # in two reads was refused 503. Now the slowest head (the oldest still incomplete) makes room.
    async with serving(limits_with(max_connections=8)) as served:
        tricklers = [await served.connect(b"GET /slow HTTP/1.1\r\nHost: x\r\n") for _ in range(4)]
        await until(lambda: served.budget.receiving == 4, "half the cap receiving")
        # A request whose head and body come in two reads: its head is whole, so it never makes room...
        reader, writer = await served.connect(request("POST", "/split", b"0123456789")[:-10])
        assert await until_closed(tricklers[0][0]) == b""  # ... the oldest trickled head does, closed
        assert served.budget.receiving == 4
        writer.write(b"0123456789")
        assert (await answer(reader)).json() == {"path": "/split", "body_bytes": 10}
        # A request that arrives whole is served beside them.
        good_reader, good_writer = await served.connect(request("GET", "/good"))
        assert (await answer(good_reader)).json() == {"path": "/good", "body_bytes": 0}
        # Tricklers take the place of the oldest trickler left, never of the answered clients.
        late = [await served.connect(b"GET /slow HTTP/1.1\r\nHost: x\r\n") for _ in range(2)]
        assert await until_closed(tricklers[1][0]) == b""
        assert served.budget.receiving == 4
        for _, other in [*tricklers, *late, (reader, writer), (good_reader, good_writer)]:
            other.close()


async def test_with_every_receiving_place_taken_by_a_body_a_newcomer_still_sending_gets_503() -> None:
    # Bodies are bounded by min_body_rate, not made to yield: only incomplete heads make room.
    async with serving(limits_with(max_connections=8)) as served:
        uploads = [await served.connect(request("POST", "/up", b"x" * 10, Content_Length="1000")) for _ in range(4)]
        await until(lambda: served.budget.receiving == 4, "half the cap receiving")
        reader, writer = await served.connect(b"GET /slow HTTP/1.1\r\nHost: x\r\n")
        assert "still sending" in json_error(await answer(reader), 503, "too_many_connections")["error"]
        for _, other in [*uploads, (reader, writer)]:
            other.close()


async def test_a_request_refused_while_its_body_is_coming_never_enters_the_app() -> None:
    # The refusal is the protocol's answer alone: before, the request's task still ran the app's
    # whole stack (for a client that reconnects the moment it is refused, most of the server's time).
    app = EchoApp()
    async with serving(limits_with(max_connections=8), app) as served:
        # Bodies hold every receiving place (heads would make room): the next one is refused.
        tricklers = [await served.connect(request("POST", "/up", b"x" * 10, Content_Length="1000")) for _ in range(4)]
        await until(lambda: served.budget.receiving == 4, "half the cap receiving")
        reader, writer = await served.connect(request("POST", "/refused", b"0123456789", Content_Length="1000"))
        assert "still sending" in json_error(await answer(reader), 503, "too_many_connections")["error"]
        good_reader, good_writer = await served.connect(request("GET", "/good"))
        assert (await answer(good_reader)).json() == {"path": "/good", "body_bytes": 0}
        assert [seen.path for seen in app.seen] == ["/good"]
        for _, other in [*tricklers, (reader, writer), (good_reader, good_writer)]:
            other.close()


def test_the_budget_closes_the_connection_idle_longest_and_counts_receivers() -> None:
    budget: ConnectionBudget[str] = ConnectionBudget(max_connections=3)
    assert [budget.opened(name) for name in "abc"] == [(True, None)] * 3
    budget.busy("a")
    budget.idle("b")  # b is now the most recently idle; c the longest
    assert budget.opened("d") == (True, "c")
    assert budget.still_receiving("b", in_head=False) == (True, None)  # one receiver: max_receiving is 3 // 2 = 1
    assert budget.still_receiving("d", in_head=False) == (False, None)  # b sends a body: it does not make room
    assert budget.opened("e") == (False, None)  # a busy, b receiving, d refused: none idle, no head arriving
    budget.closed("a")
    assert budget.opened("e") == (True, None)


def test_the_budget_closes_the_oldest_incomplete_head_for_room() -> None:
    budget: ConnectionBudget[str] = ConnectionBudget(max_connections=4)  # two may be receiving
    assert [budget.opened(name) for name in "abcd"] == [(True, None)] * 4
    assert budget.still_receiving("a", in_head=True) == (True, None)
    assert budget.still_receiving("b", in_head=True) == (True, None)
    assert budget.still_receiving("a", in_head=True) == (True, None)  # more of its head: still the oldest
    assert budget.still_receiving("c", in_head=False) == (True, "a")  # a whole head waits for its body
    assert budget.still_receiving("b", in_head=False) == (True, None)  # b's head is whole now
    assert budget.still_receiving("d", in_head=True) == (False, None)  # no head left to close: refused
    budget.busy("c")
    budget.busy("d")
    assert budget.opened("e") == (True, None)  # a is gone: room
    assert budget.still_receiving("e", in_head=True) == (True, None)
    assert budget.opened("f") == (True, "e")  # at the cap, none idle: the oldest incomplete head goes
    budget.busy("f")
    assert budget.opened("g") == (False, None)  # none idle, no head arriving


# ----- every byte that is not body data counts, in slices cut where messages may end (issue 20) -----


def get(path: str) -> bytes:
    return request("GET", path)


def chunked(path: str, chunks: list[bytes], trailers: bytes = b"", extension: bytes = b"") -> bytes:
    framed = b"".join(b"%x%s\r\n%s\r\n" % (len(c), extension, c) for c in chunks)
    head = b"POST %s HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" % path.encode()
    return head + framed + b"0\r\n" + trailers + b"\r\n"


@pytest.mark.parametrize("seed", range(6))
async def test_requests_split_at_any_byte_are_each_answered_in_order(seed: int) -> None:
    """CRLF CRLF inside bodies, chunked trailers and extensions, heads whose end straddles two reads."""
    stream = [
        (get("/a"), b""),
        (request("POST", "/b", b"x\r\n\r\ny" * 50), b"x\r\n\r\ny" * 50),
        (chunked("/c", [b"ab\r\n\r\ncd", b"e" * 700], b"X-Trailer: 1\r\n", b";ext=1"), b"ab\r\n\r\ncd" + b"e" * 700),
        (get("/d"), b""),
        (chunked("/e", [b"\r\n\r\n"]), b"\r\n\r\n"),
        (request("POST", "/f"), b""),
    ]
    data = b"".join(message for message, _ in stream)
    pieces = random.Random(seed)
    async with serving(limits_with(max_header_bytes=2048)) as served:
        reader, writer = await served.connect()
        offset = 0
        while offset < len(data):
            size = pieces.choice([1, 2, 3, 4, 5, 17, 64, 1000])
            writer.write(data[offset : offset + size])
            await writer.drain()
            offset += size
            if pieces.random() < 0.3:
                await asyncio.sleep(0.002)  # a read of its own
        for (_, body), path in zip(stream, "abcdef", strict=True):
            r = await answer(reader)
            assert r.status == 200 and r.json() == {"path": f"/{path}", "body_bytes": len(body)}, r.body
        assert [seen.body for seen in served.app.seen] == [body for _, body in stream]
        writer.close()


async def test_a_head_of_exactly_the_budget_is_served_and_one_byte_more_is_431() -> None:
    async with serving(limits_with(max_header_bytes=2048)) as served:
        start = b"GET /x HTTP/1.1\r\nX-Pad: "
        fitting = start + b"a" * (2048 - len(start) - 4) + b"\r\n\r\n"
        assert len(fitting) == 2048
        reader, writer = await served.connect(fitting)
        assert (await answer(reader)).status == 200
        writer.write(fitting.replace(b"X-Pad: ", b"X-Pad: a"))
        json_error(await answer(reader), 431, "header_too_large")
        writer.close()


async def test_trailers_count_against_the_budget_and_never_become_headers() -> None:
    async with serving(limits_with(max_header_bytes=2048)) as served:
        reader, writer = await served.connect(
            chunked("/t", [b"abc"], b"X-Trailer: sneaky\r\nContent-Type: text/evil\r\n")
        )
        assert (await answer(reader)).json() == {"path": "/t", "body_bytes": 3}
        names = {name for name, _ in served.app.seen[0].headers}
        assert b"x-trailer" not in names and b"content-type" not in names
        # A flood of trailers: before, every one was appended to the request's headers (2.7 GB in 13 s).
        writer.write(b"POST /t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n")
        for i in range(1000):
            writer.write(b"X-Trailer-%04d: %s\r\n" % (i, b"v" * 100))
        json_error(await answer(reader), 431, "header_too_large")
        assert await until_closed(reader) == b""
        assert len(served.app.seen) == 1  # the flooded request never reached the app whole
        writer.close()


async def test_endless_chunk_extensions_are_cut_off() -> None:
    async with serving(limits_with(max_header_bytes=2048)) as served:
        reader, writer = await served.connect(
            b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1;ext="
        )
        try:
            for _ in range(1000):  # 1 MB of one chunk extension that never ends
                writer.write(b"a" * 1000)
                await writer.drain()
        except ConnectionResetError:
            pass
        assert "chunk framing and trailers" in json_error(await answer(reader), 431, "header_too_large")["error"]
        writer.close()


async def test_chunk_framing_is_allowed_one_64th_of_the_body() -> None:
    async with serving(limits_with(max_header_bytes=2048)) as served:
        # 600 chunks of 512 bytes: 4,200 bytes of framing, within 2,048 + 307,200 / 64.
        reader, writer = await served.connect(chunked("/ok", [b"z" * 512] * 600))
        assert (await answer(reader)).json() == {"path": "/ok", "body_bytes": 600 * 512}
        # 2,000 chunks of one byte: 12,000 bytes of framing for 2,000 of data.
        writer.write(chunked("/tiny", [b"z"] * 2000))
        json_error(await answer(reader), 431, "header_too_large")
        writer.close()


async def test_after_an_error_answer_input_is_dropped() -> None:
    async with serving(limits_with(max_header_bytes=2048)) as served:
        reader, writer = await served.connect(b"GET / HTTP/1.1\r\nX: " + b"a" * 8192 + b"\r\n\r\n" + get("/after"))
        json_error(await answer(reader), 431, "header_too_large")
        assert await until_closed(reader) == b""
        assert served.app.seen == []
        writer.close()


# ----- pipelining: a few requests at a time are parsed ------------------------------------------


async def test_a_pipelined_flood_is_parsed_a_few_requests_at_a_time_and_all_answered() -> None:
    # Issue 20, class 2: before, every request of a read was parsed and queued (1 GB in 10 s).
    app = EchoApp()
    app.reading.clear()  # the first answer waits: everything behind it is pipelined
    async with serving(LIMITS, app) as served:
        reader, writer = await served.connect(b"".join(get(f"/{i}") for i in range(500)))
        await until(lambda: len(served.state.connections) == 1 and served.only_connection().flow.held, "held input")
        assert app.started == 1
        assert 1 + len(served.only_connection().pipeline) == MAX_UNANSWERED  # the one running and those behind
        app.reading.set()
        for i in range(500):
            assert (await answer(reader)).json() == {"path": f"/{i}", "body_bytes": 0}
        assert [seen.path for seen in app.seen] == [f"/{i}" for i in range(500)]
        writer.close()


@dataclass
class TickingApp(EchoApp):
    """EchoApp that notes, for each request it starts, which turn of the event loop it started in."""

    ticks: int = 0
    starts: list[tuple[int, str]] = field(default_factory=list)  # (loop turn, path)

    def tick(self) -> None:
        # call_soon from a callback runs in the loop's next iteration: one tick per iteration.
        self.ticks += 1
        asyncio.get_running_loop().call_soon(self.tick)

    async def __call__(
        self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]], send: Any
    ) -> None:
        self.starts.append((self.ticks, scope["path"]))
        await super().__call__(scope, receive, send)


async def test_pipelined_requests_of_many_connections_start_one_a_loop_turn_in_turn() -> None:
    # Issue 20, class 2 on many connections: each answer used to start the next pipelined request
    # at once, so 32 pipelining connections added 32 requests to every turn of the loop and the
    # good requests beside them waited 80 times their quiet p99 (bench.hostile pipelined-many).
    app = TickingApp()
    app.reading.clear()  # each connection's first request waits: everything behind it is pipelined
    connections, depth = 8, 10
    async with serving(LIMITS, app) as served:
        clients = [await served.connect(b"".join(get(f"/c{c}/{i}") for i in range(depth))) for c in range(connections)]
        await until(lambda: app.started == connections, "every connection's first request started")
        app.tick()
        app.reading.set()
        for c, (reader, _) in enumerate(clients):
            for i in range(depth):
                assert (await answer(reader)).json() == {"path": f"/c{c}/{i}", "body_bytes": 0}
        for _, writer in clients:
            writer.close()
    pipelined = [(tick, path) for tick, path in app.starts if not path.endswith("/0")]
    assert len(pipelined) == connections * (depth - 1)
    per_turn = Counter(tick for tick, _ in pipelined)
    assert max(per_turn.values()) == 1, per_turn  # one a turn of the loop, across all the connections
    first_round = {path.split("/")[1] for _, path in pipelined[:connections]}
    assert first_round == {f"c{c}" for c in range(connections)}  # in turn: every connection before any again


async def test_a_drain_answers_the_pipelined_requests_already_parsed_the_last_with_connection_close() -> None:
    # The drain's Connection: close goes on the newest request parsed (uvicorn's `cycle`): every
    # request already parsed, pipelined behind the one under way, is answered before the close.
    app = EchoApp()
    app.reading.clear()  # the first answer waits: the second is parsed and pipelined behind it
    async with serving(LIMITS, app) as served:
        reader, writer = await served.connect(get("/first") + get("/second"))
        await until(
            lambda: len(served.state.connections) == 1 and len(served.only_connection().pipeline) == 1,
            "the second request pipelined",
        )
        type(served.only_connection()).close_connections(served.state.connections)
        app.reading.set()
        first, second = await answer(reader), await answer(reader)
        assert first.json() == {"path": "/first", "body_bytes": 0}
        assert first.headers.get("connection") != "close"
        assert second.json() == {"path": "/second", "body_bytes": 0}
        assert second.headers.get("connection") == "close"
        assert await until_closed(reader) == b""
        writer.close()


async def test_a_held_body_is_not_timed_out_while_the_server_does_not_read_it() -> None:
    app = EchoApp()
    app.reading.clear()
    async with serving(limits_with(read_timeout_s=SHORT, min_body_rate=1000), app) as served:
        big = b"q" * 300_000  # pipelined behind a held answer: reading pauses once 64 KiB wait unread
        reader, writer = await served.connect()
        writer.write(get("/first") + request("POST", "/second", big))
        await until(lambda: len(served.state.connections) == 1 and served.only_connection().flow.read_paused, "paused")
        await asyncio.sleep(5 * SHORT)  # read timeouts pass, all of them the server's own doing
        app.reading.set()
        assert (await answer(reader)).json() == {"path": "/first", "body_bytes": 0}
        assert (await answer(reader)).json() == {"path": "/second", "body_bytes": len(big)}
        writer.close()


# ----- a body's deadline: its size at the minimum rate ----------------------------------------------


async def test_a_body_trickled_inside_the_pause_bound_still_meets_its_deadline() -> None:
    # Issue 20, class 5: before, a byte every 0.2 s inside a 0.5 s read timeout held the connection forever.
    async with serving(limits_with(read_timeout_s=0.5, min_body_rate=1000)) as served:
        reader, writer = await served.connect(request("POST", "/slow", b"", Content_Length="100000"))
        response = asyncio.ensure_future(read_response(reader))
        async with asyncio.timeout(BOUND_S):
            while not response.done():
                writer.write(b"x")
                await asyncio.sleep(0.2)
            assert "min_body_rate" in json_error(await response, 408, "request_timeout")["error"]
        assert served.app.seen == []
        writer.close()


async def test_a_body_sent_faster_than_the_rate_is_served() -> None:
    async with serving(limits_with(read_timeout_s=0.5, min_body_rate=1000)) as served:
        reader, writer = await served.connect(request("POST", "/fast", b"", Content_Length="40000"))
        for _ in range(20):  # 2,000 bytes every 0.1 s: 20 times the rate
            writer.write(b"y" * 2000)
            await writer.drain()
            await asyncio.sleep(0.1)
        assert (await answer(reader)).json() == {"path": "/fast", "body_bytes": 40000}
        writer.close()


# ----- upgrades are answered as plain HTTP ------------------------------------------------------------


async def test_a_websocket_upgrade_is_answered_as_plain_http_and_the_connection_closed() -> None:
    async with serving() as served:
        reader, writer = await served.connect(
            b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
            b"\x81\x85\x37\xfa\x21\x3d\x7f\x9f\x4d\x51\x58"  # a WebSocket frame, as if upgraded
        )
        r = await answer(reader)
        assert r.status == 200 and r.json() == {"path": "/ws", "body_bytes": 0}
        assert r.headers.get("connection") == "close"
        assert await until_closed(reader) == b""
        writer.close()


# ----- the request line's HTTP version ------------------------------------------------------------

# llhttp takes each of these and uvicorn answered it as HTTP/1.1 200 (issue 28 class 9).
UNSERVED_LINES = {
    "no-version": (b"GET /v2/health/live\r\n\r\n", 400, "invalid_input"),
    "http-2.0": (b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", 505, "http_version_not_supported"),
    "http-0.9": (b"GET / HTTP/0.9\r\nHost: x\r\n\r\n", 505, "http_version_not_supported"),
    "rtsp-1.0": (b"GET / RTSP/1.0\r\nHost: x\r\n\r\n", 400, "invalid_input"),
    # llhttp refuses these itself: 505 here for an HTTP version, as for 2.0; 400 for the rest
    "http-1.2": (b"GET / HTTP/1.2\r\nHost: x\r\n\r\n", 505, "http_version_not_supported"),
    "http-3.0": (b"GET / HTTP/3.0\r\nHost: x\r\n\r\n", 505, "http_version_not_supported"),
    "lower-case": (b"GET / http/1.1\r\nHost: x\r\n\r\n", 400, "invalid_input"),
    "h2-preface": (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505, "http_version_not_supported"),
}


@pytest.mark.parametrize(("data", "status", "error_type"), UNSERVED_LINES.values(), ids=UNSERVED_LINES.keys())
async def test_a_request_line_without_http_1_1_or_1_0_is_refused_and_never_reaches_the_app(
    data: bytes, status: int, error_type: str
) -> None:
    async with serving() as served:
        reader, writer = await served.connect(data)
        body = json_error(await answer(reader), status, error_type)
        assert "HTTP/1.1" in body["error"]
        assert await until_closed(reader) == b""
        assert served.app.started == 0
        writer.close()


@pytest.mark.parametrize("version", [b"HTTP/1.1", b"HTTP/1.0"])
async def test_http_1_1_and_1_0_request_lines_are_served_even_trickled_a_byte_at_a_time(fed, version: bytes) -> None:
    protocol, transport = fed
    head = b"\r\nGET /" + b"v" * 100 + b" " + version + b"\r\nHost: x\r\n\r\n"  # an empty line first, as llhttp allows
    for at in range(len(head)):
        protocol.data_received(head[at : at + 1])
    r = await transport.response()
    assert r.status == 200 and r.json() == {"path": "/" + "v" * 100, "body_bytes": 0}


async def test_a_version_split_across_reads_is_read_whole(fed) -> None:
    protocol, transport = fed
    for piece in (b"GET /x HT", b"TP/2", b".0\r", b"\nHost: x\r\n\r\n"):
        protocol.data_received(piece)
    json_error(await transport.response(), 505, "http_version_not_supported")


async def test_each_kept_alive_request_line_is_checked() -> None:
    async with serving() as served:
        reader, writer = await served.connect(request("GET", "/first"))
        assert (await answer(reader)).json() == {"path": "/first", "body_bytes": 0}
        writer.write(b"GET /second HTTP/2.0\r\n\r\n")
        json_error(await answer(reader), 505, "http_version_not_supported")
        assert [seen.path for seen in served.app.seen] == ["/first"]
        writer.close()
        # uvicorn closes after an HTTP/1.0 answer: one on a connection of its own
        reader, writer = await served.connect(b"GET /third HTTP/1.0\r\n\r\n")
        assert (await answer(reader)).json() == {"path": "/third", "body_bytes": 0}
        writer.close()


def test_uvicorn_options_carry_the_settings_limits() -> None:
    settings = Settings(
        max_header_bytes=2048,
        header_timeout_s=1.5,
        read_timeout_s=2.5,
        send_timeout_s=3.5,
        max_connections=7,
        min_body_rate=1000,
    )
    protocol = uvicorn_options(settings)["http"]
    assert issubclass(protocol, LimitedHttpToolsProtocol)
    assert protocol.limits == ConnectionLimits(2048, 1.5, 2.5, 3.5, 7, 1000)
    assert protocol.budget.max_connections == 7 and protocol.budget.max_receiving == 3


# ----- the uvicorn it runs on --------------------------------------------------------------------


def test_the_installed_uvicorn_has_every_member_the_protocol_uses() -> None:
    assert uvicorn_members.missing() == []
    assert uvicorn_members.mismatch() is None


def _drop_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    real_init = httptools_impl.HttpToolsProtocol.__init__

    def init_without_pipeline(self: Any, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        del self.pipeline

    monkeypatch.setattr(httptools_impl.HttpToolsProtocol, "__init__", init_without_pipeline)


@pytest.mark.parametrize(
    ("remove", "member"),
    [
        (
            lambda mp: mp.delattr(httptools_impl.HttpToolsProtocol, "_unset_keepalive_if_required"),
            "HttpToolsProtocol._unset_keepalive_if_required",
        ),
        (lambda mp: mp.delattr(httptools_impl, "STATUS_LINE"), "httptools_impl.STATUS_LINE"),
        (_drop_pipeline, "HttpToolsProtocol.pipeline"),
    ],
    ids=["method", "module", "instance"],
)
def test_a_uvicorn_without_a_member_stops_the_start_with_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], remove: Any, member: str
) -> None:
    remove(monkeypatch)
    assert uvicorn_members.missing() == [member]
    from importlib.metadata import version

    with socket.socket() as taken:  # were the check to pass, serve() would stop at this port, exit 3
        taken.bind((HOST, 0))
        taken.listen()
        assert cli.serve(Settings(host=HOST, port=taken.getsockname()[1])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ffn-serve: ")
    assert f"uvicorn {version('uvicorn')} lacks {member}" in err
    assert "install uvicorn" in err and "<0.55" in err, "the message names the range to install"
