"""app/web/protocol.py on its own: uvicorn's HTTP/1.1 protocol with a bounded, timed head, a body
timeout, a send timeout and a connection cap.

The protocol serves a few-line ASGI app in this process: on a real loopback socket (asyncio's
create_server, as uvicorn runs it) or fed by hand through a fake transport where the test must
choose how the bytes are cut. Timeouts are short, and each test waits for the answer or for the
server's own state (its open connections), never for a fixed time; a request's bytes are sent
before the server accepts its connection. A slow machine only makes a test take longer.
"""

from __future__ import annotations

import asyncio
import logging
import socket
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
from app.settings import Settings
from app.web import uvicorn_members
from app.web.protocol import ConnectionLimits, LimitedHttpToolsProtocol, uvicorn_options
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
class EchoApp:
    """Answers 200 with {"path", "body_bytes"} once the whole body is in; records disconnects it sees.

    A request to /big is answered with `big_bytes` bytes instead, for the send timeout; one to
    /slow... after SLOW_S, longer than any short timeout here.
    """

    big_bytes: int = 8 << 20
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    reading: asyncio.Event = field(default_factory=asyncio.Event)  # cleared: the app has not read the body yet

    def __post_init__(self) -> None:
        self.reading.set()

    async def __call__(
        self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]], send: Any
    ) -> None:
        assert scope["type"] == "http"
        await self.reading.wait()
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnected.set()
                return
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
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
    return type("TestProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})


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
        yield Served(server.sockets[0].getsockname()[1], state, app)
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


async def test_past_max_connections_a_new_connection_gets_503_then_is_served_once_one_closes() -> None:
    limits = ConnectionLimits(1024, header_timeout_s=LONG, read_timeout_s=LONG, send_timeout_s=LONG, max_connections=2)
    async with serving(limits) as served:
        idle = [await served.connect() for _ in range(2)]
        await served.until_connections(2)
        reader, writer = await served.connect(request("GET", "/over"))
        json_error(await answer(reader), 503, "too_many_connections")
        writer.close()
        _, first = idle.pop()
        first.close()
        await served.until_connections(1)
        reader, writer = await served.connect(request("GET", "/again"))
        r = await answer(reader)
        assert r.status == 200 and r.json() == {"path": "/again", "body_bytes": 0}
        writer.close()
        for _, other in idle:
            other.close()


def test_uvicorn_options_carry_the_settings_limits() -> None:
    settings = Settings(
        max_header_bytes=2048, header_timeout_s=1.5, read_timeout_s=2.5, send_timeout_s=3.5, max_connections=7
    )
    protocol = uvicorn_options(settings)["http"]
    assert issubclass(protocol, LimitedHttpToolsProtocol)
    assert protocol.limits == ConnectionLimits(2048, 1.5, 2.5, 3.5, 7)


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
            lambda mp: mp.delattr(httptools_impl.HttpToolsProtocol, "_unsupported_upgrade_warning"),
            "HttpToolsProtocol._unsupported_upgrade_warning",
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
    assert "uvicorn[standard]" in err, "the message names the range to install"
