"""The echo baseline: an ASGI app that answers each POST with its own body, served like the service.

    python -m uvicorn bench.gpu.echo:app --workers 4 --port 8001     # what bench.gpu runs

The same HTTP stack as ffn-serve (uvicorn, uvloop, httptools, N worker processes on one
socket) and no model: the transport ceiling the service's bytes/s are read against. It reads
the body in full, as the service does, and answers with the request's content type and the
X-Shape / X-Dtype headers echoed, so a binary tensor request gets an answer of the same size and
kind. Any GET answers 200 (the launcher's readiness probe).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]

ECHOED_HEADERS = (b"content-type", b"x-shape", b"x-dtype")


async def app(
    scope: Scope, receive: Callable[[], Awaitable[Message]], send: Callable[[Message], Awaitable[None]]
) -> None:
    """POST: the body back; GET: an empty 200; lifespan: accepted."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    headers = [(name, value) for name, value in scope["headers"] if name in ECHOED_HEADERS]
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})
