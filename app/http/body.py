"""Request plumbing of the HTTP door: bounded body reads against the held-bytes budget, and client hang-ups."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import ClientDisconnect, Request

from app import request_context
from app.protocol.admission import Hold
from app.protocol.errors import ClientDisconnected, PayloadTooLarge
from app.protocol.fields import header_int

T = TypeVar("T")

TIMEOUT_HEADER = "x-timeout-ms"
# A scope key set (to None) by a protocol that calls the callback stored under it, with no
# argument, when the connection is lost before the answer is complete (app/http/transport/protocol.py).
ON_DISCONNECT = "ffn.on_disconnect"


async def read_body(request: Request, limit: int, hold: Hold | None = None) -> bytes:
    """The whole body, refused with 413 as soon as it passes `limit`.

    Content-Length is checked, and taken from the process's budget of held bytes (`hold`, 429
    when spent), before reading; a chunked body is counted and taken as it streams in. (The
    control routes' small bodies, bounded by their own limit, pass no `hold`.) A client that
    hangs up is a 499, not a failure of ours; one that stalls mid-body is answered 408 by the
    protocol (app/http/transport/protocol.py), which this read then sees as a hang-up. A body that came in
    one piece (every small one) is that piece itself, not a copy; a larger one is joined once at
    the end. Binary tensors are viewed in it without a copy, read-only.
    """
    declared = header_int(request.headers.get("content-length"), "Content-Length")
    if declared is not None and declared > limit:
        raise PayloadTooLarge(f"body of {declared} bytes exceeds the limit of {limit} bytes")
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
