"""app/http/endpoints.py's request plumbing on its own: body reads and client hang-ups, with hand-made ASGI messages."""

from __future__ import annotations

import asyncio
import warnings

import numpy as np
import pytest
from starlette.requests import Request

from app.http.endpoints import read_body, unless_disconnected
from app.http.transport.protocol import ON_DISCONNECT
from app.protocol.errors import ClientDisconnected, PayloadTooLarge
from app.protocol.native import decode_raw


def request_of(pieces: list[bytes], *, headers: list[tuple[bytes, bytes]] | None = None) -> Request:
    """A Request whose body arrives as `pieces`, one http.request message each; then nothing until cancelled."""
    messages = [
        {"type": "http.request", "body": piece, "more_body": i < len(pieces) - 1} for i, piece in enumerate(pieces)
    ]

    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()  # the client stays: no disconnect ever comes

    return Request({"type": "http", "method": "POST", "headers": headers or []}, receive)


async def test_a_body_in_one_piece_is_that_piece_not_a_copy():
    piece = b"x" * 1000
    body = await read_body(request_of([piece]), limit=4096)
    assert body is piece


async def test_a_body_in_pieces_is_joined_in_order():
    pieces = [b"abc", b"", b"defg", b"h"]
    assert await read_body(request_of(pieces), limit=4096) == b"abcdefgh"
    assert await read_body(request_of([b""]), limit=4096) == b""


async def test_a_body_passing_the_limit_is_413_as_it_streams():
    with pytest.raises(PayloadTooLarge, match="exceeds the limit of 5 bytes"):
        await read_body(request_of([b"abc", b"def"]), limit=5)


async def test_a_read_only_body_is_viewed_without_a_copy_and_without_a_warning():
    x = np.arange(6, dtype="<f4").reshape(2, 3)
    body = x.tobytes()
    with warnings.catch_warnings(record=True) as shown:  # with the filters as the service sets them
        decoded = decode_raw(body, "2,3", "float32", 3)
    assert not [w for w in shown if "not writable" in str(w.message)]
    np.testing.assert_array_equal(decoded.rows, x)
    assert decoded.rows.ctypes.data == np.frombuffer(body, dtype=np.uint8).ctypes.data  # the body's own memory


async def test_a_hang_up_reported_by_the_protocol_cancels_the_wait_with_499_and_no_task():
    """Our protocol sets ON_DISCONNECT in the scope and calls what the request leaves there when the client goes."""
    request = request_of([b""])
    request.scope[ON_DISCONNECT] = None
    never = asyncio.get_running_loop().create_future()
    tasks_before = len(asyncio.all_tasks())

    async def client_leaves() -> None:
        await asyncio.sleep(0)
        assert len(asyncio.all_tasks()) == tasks_before + 1  # this one only: no watcher task was made
        request.scope[ON_DISCONNECT]()  # what the protocol's connection_lost does

    leaving = asyncio.create_task(client_leaves())
    with pytest.raises(ClientDisconnected, match="before the answer was ready"):
        await unless_disconnected(request, never)
    await leaving
    assert never.cancelled()
    assert request.scope[ON_DISCONNECT] is None  # nothing left to call once the request is over


async def test_an_answer_before_any_hang_up_is_returned_and_the_callback_cleared():
    request = request_of([b""])
    request.scope[ON_DISCONNECT] = None
    ready = asyncio.get_running_loop().create_future()
    ready.set_result(42)
    assert await unless_disconnected(request, ready) == 42
    assert request.scope[ON_DISCONNECT] is None


async def test_under_another_server_a_disconnect_message_cancels_the_wait():
    """No ON_DISCONNECT in the scope (another ASGI server): the http.disconnect message is watched for."""
    gone = asyncio.Event()

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    request = Request({"type": "http", "method": "POST", "headers": []}, receive)
    never = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(gone.set)
    with pytest.raises(ClientDisconnected):
        await unless_disconnected(request, never)
    assert never.cancelled()
