"""Raw HTTP/1.1 requests to a local server: bytes exactly as given, for what httpx would normalise."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping

from ffn_client.http1 import Response, build_request, read_response
from ffn_testing.ports import HOST


def http_request(
    method: str, path: str, headers: Mapping[str, str] | None = None, body: bytes = b"", *, close: bool = True
) -> bytes:
    """The bytes of a request to the local server, with Connection: close unless `close` is false.

    Keep the connection open (close=False) when the server may answer before reading the whole
    body: closing a socket with unread data makes the kernel reset it, and the reset can destroy
    the answer before the client reads it.
    """
    return build_request(
        method, path, {**({"Connection": "close"} if close else {}), **(headers or {})}, body, host=HOST
    )


async def raw_request(port: int, data: bytes | Iterable[bytes], *, timeout: float = 30.0) -> Response:
    """Send bytes exactly as given (one piece or several writes) on a new connection and read one answer.

    For requests httpx would normalise (dot segments, huge or duplicate headers, chunked
    framing) and for bursts: one connection per request is cheap for the server, and httpx's
    pool gets slow with hundreds of concurrent connections. A reset while sending (the server
    answered early) still reads the answer.
    """
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        async with asyncio.timeout(timeout):
            try:
                for piece in [data] if isinstance(data, bytes) else data:
                    writer.write(piece)
                    await writer.drain()
            except (ConnectionResetError, BrokenPipeError):
                pass
            return await read_response(reader)
    finally:
        writer.close()
