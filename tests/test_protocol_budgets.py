"""The connection's budgets, at the protocol level (app/web/protocol.py, app/web/connections.py; issue 20).

Our protocol runs on a loopback socket in the test's loop (tests/protocol_server.py) under an app
the test steers, so each test sees what the parser delivered and when, and can hold answers back.
Every wait is on an event (an answer, a close, the protocol holding its input) with a wide bound;
nothing asserts how long anything took.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import pytest

from app.web.connections import ConnectionBudget
from app.web.protocol import MAX_UNANSWERED
from ffn_client.http1 import Response, read_response
from tests.protocol_server import HOST, ProtocolServer, protocol_server

HEAD_BUDGET = 2048


async def until(condition: Callable[[], bool], what: str, limit: float = 30.0) -> None:
    """Wait until `condition()` holds; fail naming `what` after `limit` seconds (a bound, not a measure)."""
    async with asyncio.timeout(limit):
        while not condition():
            await asyncio.sleep(0.01)


async def connect(server: ProtocolServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(HOST, server.port)


async def answer(reader: asyncio.StreamReader, limit: float = 30.0) -> Response:
    return await asyncio.wait_for(read_response(reader), limit)


async def closed_by_server(reader: asyncio.StreamReader, limit: float = 30.0) -> bytes:
    """What the server still sends until it closes the connection (a reset counts as closed)."""
    data = b""
    try:
        async with asyncio.timeout(limit):
            while chunk := await reader.read(65536):
                data += chunk
    except ConnectionResetError:
        pass
    return data


def json_error(r: Response, status: int, error_type: str) -> str:
    assert r.status == status, f"expected {status}, got {r.status}: {r.body[:300]!r}"
    body = r.json()
    assert isinstance(body, dict) and set(body) == {"error", "error_type"} and body["error_type"] == error_type, body
    return str(body["error"])


def get(path: str) -> bytes:
    return b"GET %s HTTP/1.1\r\nHost: t\r\n\r\n" % path.encode()


def post(path: str, body: bytes) -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body)


def chunked(path: str, chunks: list[bytes], trailers: bytes = b"", extension: bytes = b"") -> bytes:
    framed = b"".join(b"%x%s\r\n%s\r\n" % (len(c), extension, c) for c in chunks)
    return b"POST %s HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n%s0\r\n%s\r\n" % (
        path.encode(),
        framed,
        trailers,
    )


# ----- every byte that is not body data counts, in slices that end where messages may end --------


@pytest.mark.parametrize("seed", range(6))
async def test_requests_split_at_any_byte_are_each_answered_in_order(seed: int) -> None:
    """CRLF CRLF inside bodies, chunked trailers and extensions, heads whose end straddles two reads."""
    stream = [
        (get("/a"), b""),
        (post("/b", b"x\r\n\r\ny" * 50), b"x\r\n\r\ny" * 50),
        (chunked("/c", [b"ab\r\n\r\ncd", b"e" * 700], b"X-Trailer: 1\r\n", b";ext=1"), b"ab\r\n\r\ncd" + b"e" * 700),
        (get("/d"), b""),
        (chunked("/e", [b"\r\n\r\n"]), b"\r\n\r\n"),
        (post("/f", b""), b""),
    ]
    data = b"".join(request for request, _ in stream)
    pieces = random.Random(seed)
    async with protocol_server(max_header_bytes=HEAD_BUDGET) as server:
        reader, writer = await connect(server)
        offset = 0
        while offset < len(data):
            size = pieces.choice([1, 2, 3, 4, 5, 17, 64, 1000])
            writer.write(data[offset : offset + size])
            await writer.drain()
            offset += size
            if pieces.random() < 0.3:
                await asyncio.sleep(0.002)  # a read of its own
        for (request, body), path in zip(stream, "abcdef", strict=True):
            r = await answer(reader)
            assert r.status == 200, r.body
            assert r.json() == {"path": f"/{path}", "body": len(body)}, request[:40]
        assert [seen.body for seen in server.app.seen] == [body for _, body in stream]
        writer.close()


async def test_a_head_of_exactly_the_budget_is_served_and_one_byte_more_is_431() -> None:
    async with protocol_server(max_header_bytes=HEAD_BUDGET) as server:
        start = b"GET /x HTTP/1.1\r\nX-Pad: "
        fitting = start + b"a" * (HEAD_BUDGET - len(start) - 4) + b"\r\n\r\n"
        assert len(fitting) == HEAD_BUDGET
        reader, writer = await connect(server)
        writer.write(fitting)
        assert (await answer(reader)).status == 200
        writer.write(fitting.replace(b"X-Pad: ", b"X-Pad: a"))
        json_error(await answer(reader), 431, "header_too_large")
        writer.close()


async def test_trailers_count_against_the_budget_and_never_become_headers() -> None:
    async with protocol_server(max_header_bytes=HEAD_BUDGET) as server:
        reader, writer = await connect(server)
        writer.write(chunked("/t", [b"abc"], b"X-Trailer: sneaky\r\nContent-Type: text/evil\r\n"))
        r = await answer(reader)
        assert r.status == 200 and r.json() == {"path": "/t", "body": 3}
        names = {name for name, _ in server.app.seen[0].headers}
        assert b"x-trailer" not in names and b"content-type" not in names
        # A flood of trailers: before, every one was appended to the request's headers (2.7 GB in 13 s).
        writer.write(b"POST /t HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n")
        for i in range(1000):
            writer.write(b"X-Trailer-%04d: %s\r\n" % (i, b"v" * 100))
        json_error(await answer(reader), 431, "header_too_large")
        assert await closed_by_server(reader) == b""
        assert len(server.app.seen) == 1  # the flooded request never reached the app whole
        writer.close()


async def test_endless_chunk_extensions_are_cut_off() -> None:
    async with protocol_server(max_header_bytes=HEAD_BUDGET) as server:
        reader, writer = await connect(server)
        writer.write(b"POST /x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n1;ext=")
        try:
            for _ in range(1000):  # 1 MB of one chunk extension that never ends
                writer.write(b"a" * 1000)
                await writer.drain()
        except ConnectionResetError:
            pass
        assert "chunk framing and trailers" in json_error(await answer(reader), 431, "header_too_large")
        writer.close()


async def test_chunk_framing_is_allowed_one_64th_of_the_body() -> None:
    async with protocol_server(max_header_bytes=HEAD_BUDGET) as server:
        # 600 chunks of 512 bytes: 4,200 bytes of framing, within 2,048 + 307,200 / 64.
        reader, writer = await connect(server)
        writer.write(chunked("/ok", [b"z" * 512] * 600))
        assert (await answer(reader)).json() == {"path": "/ok", "body": 600 * 512}
        # 2,000 chunks of one byte: 12,000 bytes of framing for 2,000 of data.
        writer.write(chunked("/tiny", [b"z"] * 2000))
        json_error(await answer(reader), 431, "header_too_large")
        writer.close()


# ----- pipelining: a few requests at a time are parsed ----------------------------------------------


async def test_a_pipelined_flood_is_parsed_a_few_requests_at_a_time_and_all_answered() -> None:
    async with protocol_server() as server:
        server.app.gate.clear()  # the first answer waits: everything behind it is pipelined
        reader, writer = await connect(server)
        writer.write(b"".join(get(f"/{i}") for i in range(500)))
        await until(lambda: bool(server.protocols) and server.protocols[0].flow.held, "the protocol holds its input")
        protocol = server.protocols[0]
        assert server.app.started == 1
        assert 1 + len(protocol.pipeline) == MAX_UNANSWERED  # parsed: the one running and those queued behind it
        server.app.gate.set()
        for i in range(500):
            r = await answer(reader)
            assert r.json() == {"path": f"/{i}", "body": 0}
        assert [seen.path for seen in server.app.seen] == [f"/{i}" for i in range(500)]
        writer.close()


async def test_a_held_body_is_not_timed_out_while_the_server_does_not_read_it() -> None:
    async with protocol_server(read_timeout_s=0.3, min_body_rate=1000) as server:
        server.app.gate.clear()
        reader, writer = await connect(server)
        big = b"q" * 300_000  # pipelined behind a held answer: reading pauses once 64 KiB wait unread
        writer.write(get("/first") + post("/second", big))
        await until(lambda: bool(server.protocols) and server.protocols[0].flow.read_paused, "reading paused")
        await asyncio.sleep(1.5)  # five read timeouts, all of them the server's own doing
        server.app.gate.set()
        assert (await answer(reader)).json() == {"path": "/first", "body": 0}
        assert (await answer(reader)).json() == {"path": "/second", "body": len(big)}
        writer.close()


# ----- a body's deadline: its size at the minimum rate ---------------------------------------------


async def test_a_body_trickled_inside_the_pause_bound_still_meets_its_deadline() -> None:
    async with protocol_server(read_timeout_s=0.5, min_body_rate=1000) as server:
        reader, writer = await connect(server)
        writer.write(b"POST /slow HTTP/1.1\r\nHost: t\r\nContent-Length: 100000\r\n\r\n")
        response = asyncio.ensure_future(read_response(reader))
        sent = 0
        async with asyncio.timeout(60):  # before: never answered, one byte per 0.2 s held it forever
            while not response.done() and sent < 100_000:
                writer.write(b"x")
                sent += 1
                await asyncio.sleep(0.2)
            message = json_error(await response, 408, "request_timeout")
        assert "min_body_rate" in message
        assert server.app.seen == []
        writer.close()


async def test_a_body_sent_faster_than_the_rate_is_served() -> None:
    async with protocol_server(read_timeout_s=0.5, min_body_rate=1000) as server:
        reader, writer = await connect(server)
        writer.write(b"POST /fast HTTP/1.1\r\nHost: t\r\nContent-Length: 40000\r\n\r\n")
        for _ in range(20):  # 2,000 bytes every 0.1 s: 20 times the rate
            writer.write(b"y" * 2000)
            await writer.drain()
            await asyncio.sleep(0.1)
        assert (await answer(reader)).json() == {"path": "/fast", "body": 40000}
        writer.close()


# ----- the cap: idle connections make room, tricklers get half of it at most -----------------------


async def test_at_the_cap_the_connection_idle_longest_makes_room() -> None:
    async with protocol_server(max_connections=4) as server:
        idle = [await connect(server) for _ in range(4)]
        await until(lambda: server.budget.open == 4, "four connections open")
        reader, writer = await connect(server)
        writer.write(get("/new"))
        assert (await answer(reader)).status == 200
        assert await closed_by_server(idle[0][0]) == b""  # the oldest idle one, closed quietly
        for _, w in [*idle, (reader, writer)]:
            w.close()


async def test_at_the_cap_with_no_idle_connection_a_new_one_gets_503() -> None:
    async with protocol_server(max_connections=4) as server:
        server.app.gate.clear()
        busy = [await connect(server) for _ in range(4)]
        for _, writer in busy:
            writer.write(get("/busy"))
        await until(lambda: server.app.started == 4, "four requests in the app")
        reader, writer = await connect(server)
        writer.write(get("/late"))
        r = await answer(reader)
        json_error(r, 503, "too_many_connections")
        assert r.headers.get("retry-after") == "1" and r.headers.get("connection") == "close"
        server.app.gate.set()
        for busy_reader, _ in busy:
            assert (await answer(busy_reader)).status == 200
        for _, w in [*busy, (reader, writer)]:
            w.close()


async def test_connections_still_sending_their_request_hold_half_the_cap_at_most() -> None:
    async with protocol_server(max_connections=8) as server:
        tricklers = []
        for _ in range(4):  # half the cap: each has sent part of a head
            reader, writer = await connect(server)
            writer.write(b"GET /slow HTTP/1.1\r\nHost: t\r\n")
            tricklers.append((reader, writer))
        await until(lambda: server.budget.receiving == 4, "four connections receiving")
        reader, writer = await connect(server)
        writer.write(b"GET /slow HTTP/1.1\r\nHost: t\r\n")
        assert "still sending" in json_error(await answer(reader), 503, "too_many_connections")
        # A request that arrives whole is served beside them.
        good_reader, good_writer = await connect(server)
        good_writer.write(get("/good"))
        assert (await answer(good_reader)).json() == {"path": "/good", "body": 0}
        for _, w in [*tricklers, (reader, writer), (good_reader, good_writer)]:
            w.close()


def test_the_budget_evicts_the_idle_connection_idle_longest_and_counts_receivers() -> None:
    budget: ConnectionBudget[str] = ConnectionBudget(max_connections=3)
    assert budget.opened("a") == (True, None) and budget.opened("b") == (True, None)
    assert budget.opened("c") == (True, None)
    budget.busy("a")
    budget.idle("b")  # b is now the most recently idle; c the longest
    assert budget.opened("d") == (True, "c")
    assert budget.still_receiving("b") is True  # one receiver: max_receiving is 3 // 2 = 1
    assert budget.still_receiving("d") is False
    assert budget.opened("e") == (False, None)  # a busy, b receiving, d refused: none idle
    budget.closed("a")
    assert budget.opened("e") == (True, None)


# ----- upgrades are answered as plain HTTP -----------------------------------------------------------


async def test_a_websocket_upgrade_is_answered_as_plain_http_and_the_connection_closed() -> None:
    async with protocol_server() as server:
        reader, writer = await connect(server)
        writer.write(
            b"GET /ws HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
            b"\x81\x85\x37\xfa\x21\x3d\x7f\x9f\x4d\x51\x58"  # a WebSocket frame, as if upgraded
        )
        r = await answer(reader)
        assert r.status == 200 and r.json() == {"path": "/ws", "body": 0}
        assert r.headers.get("connection") == "close"
        assert await closed_by_server(reader) == b""
        writer.close()


async def test_after_an_error_answer_input_is_dropped() -> None:
    async with protocol_server(max_header_bytes=HEAD_BUDGET) as server:
        reader, writer = await connect(server)
        writer.write(b"GET / HTTP/1.1\r\nX: " + b"a" * 4 * HEAD_BUDGET + b"\r\n\r\n" + get("/after"))
        json_error(await answer(reader), 431, "header_too_large")
        assert await closed_by_server(reader) == b""
        assert server.app.seen == []
        writer.close()
