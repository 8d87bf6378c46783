"""ffn_client.http1, the one HTTP/1.1 framing: request bytes, heads, responses off a stream."""

from __future__ import annotations

import asyncio

import pytest

from ffn_client.http1 import ConnectionClosed, build_request, parse_head, parse_status, read_response
from ffn_client.senders import RawSender


def test_request_bytes_add_host_and_content_length() -> None:
    raw = build_request(
        "POST", "/v1/models/demo/transform", {"Content-Type": "application/json"}, b"{}", host="127.0.0.1:8000"
    )
    assert raw == (
        b"POST /v1/models/demo/transform HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
        b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    )
    assert build_request("GET", "/v2/health/ready", host="h") == b"GET /v2/health/ready HTTP/1.1\r\nHost: h\r\n\r\n"
    assert build_request("POST", "/", host="h").endswith(b"Content-Length: 0\r\n\r\n")  # a POST says it has no body


def test_request_bytes_keep_the_callers_framing_and_host() -> None:
    """A test may frame a body itself (chunked, or a length that lies): nothing is added or fixed."""
    chunked = build_request("POST", "/", {"Transfer-Encoding": "chunked"}, b"2\r\n{}\r\n0\r\n\r\n", host="h")
    assert b"Content-Length" not in chunked
    lying = build_request("POST", "/", {"content-length": "99"}, b"{}", host="h")
    assert lying.count(b"ength:") == 1 and b"content-length: 99\r\n" in lying
    assert build_request("GET", "/", {"Host": "other"}, host="h") == b"GET / HTTP/1.1\r\nHost: other\r\n\r\n"


def test_head_names_are_lower_case_and_the_last_repeat_wins() -> None:
    start, headers = parse_head(b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 1\r\nX-A:  one \r\nx-a: two\r\n\r\n")
    assert start == "HTTP/1.1 429 Too Many Requests"
    assert headers == {"retry-after": "1", "x-a": "two"}
    assert parse_head(bytearray(b"GET /x HTTP/1.1\r\nHost: h")) == ("GET /x HTTP/1.1", {"host": "h"})
    assert parse_status(start) == 429
    with pytest.raises(ValueError):
        parse_status("GET / HTTP/1.1")


async def read(answer: bytes, *, eof: bool = True):
    reader = asyncio.StreamReader()
    reader.feed_data(answer)
    if eof:
        reader.feed_eof()
    return await read_response(reader)


async def test_content_length_body_leaves_the_next_answer_on_the_stream() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nabcHTTP/1.1 204 No Content\r\n\r\n")
    first = await read_response(reader)
    assert (first.status, first.body, first.keep_alive) == (200, b"abc", True)
    second = await read_response(reader)
    assert (second.status, second.body, second.keep_alive) == (204, b"", True)


async def test_chunked_body_with_extensions_and_trailers() -> None:
    r = await read(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nabcd\r\n3;x=y\r\nefg\r\n0\r\nX-Trailer: t\r\n\r\n",
        eof=False,
    )
    assert (r.status, r.body, r.keep_alive) == (200, b"abcdefg", True)


async def test_connection_close_and_unframed_bodies_end_the_connection() -> None:
    r = await read(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}")
    assert (r.status, r.json(), r.keep_alive) == (503, {}, False)
    r = await read(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nto the end")
    assert (r.body, r.keep_alive) == (b"to the end", False)


async def test_a_stream_that_ends_early() -> None:
    with pytest.raises(ConnectionClosed):
        await read(b"")
    with pytest.raises(ConnectionClosed):
        await read(b"HTTP/1.1 200 OK\r\ncontent-")
    with pytest.raises(asyncio.IncompleteReadError):
        await read(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort")


async def test_raw_sender_reads_chunked_answers_and_reconnects_after_connection_close() -> None:
    """Over real sockets: a chunked 200 keeps the connection, a 503 with Connection: close ends it."""
    answers = [
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4\r\nabcd\r\n0\r\n\r\n",
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
    ]
    connections: list[int] = []  # requests read on each connection, in connection order

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(0)
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            body = await reader.readexactly(int(parse_head(head)[1]["content-length"]))
            assert body == b"ping"
            answer = answers[sum(connections)]
            connections[-1] += 1
            writer.write(answer)
            await writer.drain()
            if b"connection: close" in answer:
                break
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sender = RawSender(f"http://127.0.0.1:{port}", connections=1, timeout=10.0, headers={})
    request = sender.prepare("/x", b"ping", {})
    try:
        assert [await sender.send(request) for _ in answers] == [200, 503, 200]
    finally:
        await sender.aclose()
        server.close()
        await server.wait_closed()
    assert connections == [2, 1]  # the first connection carried two requests, then a new one was opened
