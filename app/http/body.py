"""Request plumbing of the HTTP door: bounded body reads against the held-bytes budget (compressed ones
inflated within it), compressed answers, and client hang-ups."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import ClientDisconnect, Request

from app import request_context
from app.protocol.admission import Hold
from app.protocol.content_coding import STEP, Coding, Inflater, compress
from app.protocol.errors import ClientDisconnected, PayloadTooLarge
from app.protocol.fields import header_int

T = TypeVar("T")
AnswerBody = TypeVar("AnswerBody", bytes, bytes | memoryview)  # compressed, it is bytes: either way the same type

TIMEOUT_HEADER = "x-timeout-ms"
# A scope key set (to None) by a protocol that calls the callback stored under it, with no
# argument, when the connection is lost before the answer is complete (app/http/transport/protocol.py).
ON_DISCONNECT = "ffn.on_disconnect"
COMPRESS_IN_THREAD = 1 << 20  # answers this large are compressed off the event loop (zlib releases the GIL)


async def read_body(
    request: Request, limit: int, hold: Hold | None = None, coding: Coding | None = None
) -> bytes | bytearray:
    """The whole body, refused with 413 as soon as it passes `limit`; inflated first when `coding` says so.

    Content-Length is checked, and taken from the process's budget of held bytes (`hold`, 429
    when spent), before reading; a chunked body is counted and taken as it streams in. (The
    control routes' small bodies, bounded by their own limit, pass no `hold`.) A client that
    hangs up is a 499, not a failure of ours; one that stalls mid-body is answered 408 by the
    protocol (app/http/transport/protocol.py), which this read then sees as a hang-up. A body that came in
    one piece (every small one) is that piece itself, not a copy; a larger one is joined once at
    the end. Binary tensors are viewed in it without a copy, read-only.

    A compressed body (`coding`, from Content-Encoding) is inflated as it streams in, and its
    inflated bytes are what `limit` and `hold` count (app/protocol/content_coding.py: Inflater).
    """
    declared = header_int(request.headers.get("content-length"), "Content-Length")
    if declared is not None and declared > limit:
        raise PayloadTooLarge(f"body of {declared} bytes exceeds the limit of {limit} bytes")
    if coding is not None:
        return await _read_inflated(request, Inflater(coding, limit, hold))
    if declared is not None and hold is not None:
        hold.grow(declared)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"body exceeds the limit of {limit} bytes")
            if hold is not None and size > hold.size:
                hold.resize(size)
            if chunk:
                chunks.append(chunk)
    except ClientDisconnect:
        raise ClientDisconnected("the client closed the connection while sending its body") from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _read_inflated(request: Request, inflater: Inflater) -> bytearray:
    """A compressed body inflated as it arrives, each piece counted and held before it is kept."""
    body = bytearray()
    try:
        async for chunk in request.stream():
            for piece in inflater.feed(chunk):
                body += piece
                if len(piece) == STEP:  # a large body: let other requests run between its pieces
                    await asyncio.sleep(0)
    except ClientDisconnect:
        raise ClientDisconnected("the client closed the connection while sending its body") from None
    inflater.finish()
    return body


async def compressed(
    content: AnswerBody, headers: dict[str, str], coding: Coding | None
) -> tuple[AnswerBody, dict[str, str]]:
    """The answer in `coding` (from Accept-Encoding), with its Content-Encoding; as it is when `coding` is None."""
    if coding is None:
        return content, headers
    if len(content) < COMPRESS_IN_THREAD:
        body = compress(content, coding)
    else:
        body = await asyncio.to_thread(compress, content, coding)
    return body, {**headers, "content-encoding": coding, "vary": "Accept-Encoding"}


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, but cancel it if the client disconnects first (its queued rows are dropped).

    Call only after the body has been read: the next ASGI message is then http.disconnect. Under
    our protocol (app/http/transport/protocol.py), which calls the scope's ON_DISCONNECT callback when the
    connection is lost, that is one callback and no task; under any other server, a task watches
    for the disconnect message.
    """
    task = asyncio.current_task()
    assert task is not None, "unless_disconnected must run inside a task; this is a bug."
    scope = request.scope
    gone = False

    def hang_up() -> None:
        nonlocal gone
        gone = True
        task.cancel()

    async def watch() -> None:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            hang_up()

    watcher = None
    if ON_DISCONNECT in scope:
        scope[ON_DISCONNECT] = hang_up
    else:
        watcher = asyncio.ensure_future(watch())
    try:
        result = await work
        request_context.resumed()  # a traced request's encode stage starts here
        return result
    except asyncio.CancelledError:
        if gone:
            task.uncancel()
            raise ClientDisconnected("the client closed the connection before the answer was ready") from None
        raise
    finally:
        if watcher is None:
            scope[ON_DISCONNECT] = None
        else:
            watcher.cancel()
