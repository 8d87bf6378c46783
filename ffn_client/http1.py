"""HTTP/1.1 framing, written once: a request's bytes, a message head, a response off a stream.

The load tester's raw sender, the test helpers' raw requests and the stub server all frame
HTTP/1.1 by hand (to control every byte, and because httpx costs 40x the CPU per request);
this module is the one place that knows how.

    writer.write(build_request("POST", "/v1/models/demo/transform", headers, body, host="127.0.0.1"))
    response = await read_response(reader)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass

# Answers that never have a body, whatever their headers say (RFC 9112, section 6.3).
_BODILESS = frozenset({204, 304})
_METHODS_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})


class ConnectionClosed(ConnectionError):
    """The peer closed the connection before sending a whole response head."""


@dataclass(frozen=True, slots=True)
class Response:
    """One answer: status, headers (lower-case names; a repeated header keeps its last value), body."""

    status: int
    headers: dict[str, str]
    body: bytes
    keep_alive: bool  # whether another request may follow on the same connection

    def json(self) -> object:
        return json.loads(self.body)


def build_request(
    method: str, target: str, headers: Mapping[str, str] | None = None, body: bytes = b"", *, host: str
) -> bytes:
    """The bytes of one request: request line, Host, `headers` as given, Content-Length, body.

    Content-Length is added for a body (or a POST, PUT or PATCH without one) unless `headers`
    already frame the body (Content-Length or Transfer-Encoding): a test may send a wrong one.
    """
    headers = dict(headers or {})
    given = {name.lower() for name in headers}
    lines = [f"{method} {target} HTTP/1.1"]
    if "host" not in given:
        lines.append(f"Host: {host}")
    lines += [f"{name}: {value}" for name, value in headers.items()]
    if (body or method in _METHODS_WITH_BODY) and not given & {"content-length", "transfer-encoding"}:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def parse_head(head: bytes | bytearray) -> tuple[str, dict[str, str]]:
    """A message head (up to, with or without, the blank line): its first line and its headers.

    Header names come back lower-case; a repeated header keeps its last value.
    """
    start_line, *lines = bytes(head).decode("latin-1").rstrip("\r\n").split("\r\n")
    headers: dict[str, str] = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return start_line, headers


def parse_status(start_line: str) -> int:
    """The status code of a status line ("HTTP/1.1 200 OK"); ValueError if it is not one."""
    version, _, rest = start_line.partition(" ")
    if not version.startswith("HTTP/"):
        raise ValueError(f"not an HTTP status line: {start_line[:100]!r}")
    return int(rest.partition(" ")[0])


async def read_response(reader: asyncio.StreamReader) -> Response:
    """Read one whole answer: head, then a chunked, Content-Length or read-to-close body.

    Raises ConnectionClosed when the stream ends before the head does, and
    asyncio.IncompleteReadError when it ends inside the body.
    """
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        raise ConnectionClosed(f"connection closed before an answer: {exc.partial[:200]!r}") from None
    start_line, headers = parse_head(head)
    status = parse_status(start_line)
    keep_alive = "close" not in headers.get("connection", "").lower()
    if status in _BODILESS or 100 <= status < 200:
        body = b""
    elif "chunked" in headers.get("transfer-encoding", "").lower():
        body = await _read_chunked(reader)
    elif "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    else:  # no framing: the body runs to the end of the connection
        body, keep_alive = await reader.read(), False
    return Response(status, headers, body, keep_alive)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    """A chunked body: hex size lines (extensions after ';' ignored), data, then trailers."""
    chunks = []
    while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
        chunks.append((await reader.readexactly(size + 2))[:-2])
    while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, dropped
        pass
    return b"".join(chunks)
