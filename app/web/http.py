"""Request plumbing shared by the protocols: media types, bounded body reads, deadlines, disconnects."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import ClientDisconnect, Request

from app import request_context
from app.web.errors import ClientDisconnected, InvalidInput, PayloadTooLarge, UnsupportedMediaType
from app.web.fields import header_int, header_number
from app.web.held import Hold

T = TypeVar("T")

TIMEOUT_HEADER = "x-timeout-ms"
# A scope key set (to None) by a protocol that calls the callback stored under it, with no
# argument, when the connection is lost before the answer is complete (app/web/protocol.py).
ON_DISCONNECT = "ffn.on_disconnect"


def media_type(content_type: str | None) -> str | None:
    """The media type of a Content-Type header, lower-case and without parameters; None if absent."""
    if not content_type:
        return None
    return content_type.split(";", 1)[0].strip().lower()


def refuse_content_encoding(content_encoding: str | None) -> None:
    """Bodies are read uncompressed: any Content-Encoding but identity is 415."""
    if content_encoding and content_encoding.strip().lower() not in ("", "identity"):
        raise UnsupportedMediaType(
            f"Content-Encoding {content_encoding[:64]!r} is not supported; send the body uncompressed"
        )


async def read_body(request: Request, limit: int, hold: Hold | None = None) -> bytes:
    """The whole body, refused with 413 as soon as it passes `limit`.

    Content-Length is checked, and taken from the process's budget of held bytes (`hold`, 429
    when spent), before reading; a chunked body is counted and taken as it streams in. (The
    control routes' small bodies, bounded by their own limit, pass no `hold`.) A client that
    hangs up is a 499, not a failure of ours; one that stalls mid-body is answered 408 by the
    protocol (app/web/protocol.py), which this read then sees as a hang-up. A body that came in
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


def deadline_from(timeout_ms: str | float | None, default_ms: float) -> float:
    """Absolute loop-time deadline from a per-request timeout in ms (the X-Timeout-Ms header, or a number)."""
    if timeout_ms is None:
        ms = default_ms
    else:
        parsed = header_number(timeout_ms, "X-Timeout-Ms") if isinstance(timeout_ms, str) else timeout_ms
        assert parsed is not None, "header_number returns a number for a string; this is a bug."
        ms = parsed
        if not 0 < ms <= 3_600_000:
            raise InvalidInput(f"timeout must be in (0, 3600000] milliseconds, got {ms:g}")
    return asyncio.get_running_loop().time() + ms / 1000.0


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, but cancel it if the client disconnects first (its queued rows are dropped).

    Call only after the body has been read: the next ASGI message is then http.disconnect. Under
    our protocol (app/web/protocol.py), which calls the scope's ON_DISCONNECT callback when the
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
