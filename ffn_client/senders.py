"""How the load tester puts prebuilt requests on the wire: a lean HTTP/1.1 pool, or httpx.

Both answer `send(prepared) -> status`, a negative status for no answer (see `report.NO_ANSWER`),
and read the whole answer body. Each keeps, in `causes`, the first reason seen for every failing
status (the server's error message, or the exception of a failed connect), for the report. The raw sender is the default: it costs about 45 µs of CPU per
request, httpx 1-2 ms, and more as connections grow (its pool rescans every connection on each
request; ~9 ms at 64), which would make the tester, not the server, the bottleneck on a small
machine. `--engine httpx` keeps httpx available as a cross-check. docs/load-testing.md has the
measurements.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

import httpx

from ffn_client.errors import error_from_response
from ffn_client.http1 import build_request, read_response
from ffn_client.report import CONNECT_ERROR, TIMEOUT, TRANSPORT_ERROR

RequestT = TypeVar("RequestT")


class Sender(Protocol[RequestT]):
    """What the load generator needs of an engine; the prepared request's type is the engine's own."""

    causes: dict[int, str]  # status (negative: no answer) -> the first reason seen for it

    def prepare(self, path: str, body: bytes, headers: dict[str, str]) -> RequestT: ...

    async def send(self, request: RequestT) -> int: ...

    async def aclose(self) -> None: ...


class HttpxSender:
    """One httpx.AsyncClient whose pool holds `connections`; a prepared request is an httpx.Request."""

    def __init__(
        self, url: str, connections: int, timeout: float, headers: dict[str, str], verify: ssl.SSLContext | bool = True
    ) -> None:
        """`verify`: for an https URL, the context (CA, client certificate) from ffn_client.tls."""
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        self._http = httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout, headers=headers, verify=verify)
        self._timeout = timeout
        self.causes: dict[int, str] = {}

    def prepare(self, path: str, body: bytes, headers: dict[str, str]) -> httpx.Request:
        return self._http.build_request("POST", path, content=body, headers=headers)

    async def send(self, request: httpx.Request) -> int:
        try:
            response = await self._http.send(request)
        except httpx.TimeoutException:
            return note_failure(self.causes, TIMEOUT, f"no whole answer within --timeout {self._timeout:g} s")
        except httpx.ConnectError as exc:
            return note_failure(self.causes, CONNECT_ERROR, exc)
        except httpx.TransportError as exc:
            return note_failure(self.causes, TRANSPORT_ERROR, exc)
        if response.status_code != 200 and response.status_code not in self.causes:
            note_failure(
                self.causes,
                response.status_code,
                str(error_from_response(response.status_code, response.headers, response.content)),
            )
        return response.status_code

    async def aclose(self) -> None:
        await self._http.aclose()


class RawSender:
    """Keep-alive HTTP/1.1 over asyncio streams, at most `connections` in use; a prepared request is bytes."""

    def __init__(
        self, url: str, connections: int, timeout: float, headers: dict[str, str], verify: ssl.SSLContext | bool = True
    ) -> None:
        """`verify`: for an https URL, the context (CA, client certificate) from ffn_client.tls; True, the system's CAs."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"URL must be http(s)://host[:port][/prefix], got {url!r}")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        if parts.scheme != "https":
            self._ssl: ssl.SSLContext | None = None
        elif isinstance(verify, ssl.SSLContext):
            self._ssl = verify
        elif verify:
            self._ssl = ssl.create_default_context()
        else:
            raise ValueError("an https URL is verified: give a CA (--cacert) rather than turning verification off")
        self._prefix = parts.path.rstrip("/")
        self._authority = parts.netloc.rsplit("@", 1)[-1]
        self._headers = headers
        self._timeout = timeout
        self._slots = asyncio.Semaphore(connections)
        self._idle: deque[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = deque()
        self.causes: dict[int, str] = {}

    def prepare(self, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        return build_request("POST", self._prefix + path, {**self._headers, **headers}, body, host=self._authority)

    async def send(self, request: bytes) -> int:
        try:
            async with asyncio.timeout(self._timeout), self._slots:  # waiting for a slot counts too
                return await self._send(request)
        except TimeoutError:
            return note_failure(self.causes, TIMEOUT, f"no whole answer within --timeout {self._timeout:g} s")

    def _idle_connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """The most recently used open connection; ones the server has closed meanwhile are dropped."""
        while self._idle:
            reader, writer = self._idle.pop()
            if not (reader.at_eof() or writer.is_closing()):
                return reader, writer
            writer.close()
        return None

    async def _send(self, request: bytes) -> int:
        for attempt in range(2):
            connection = self._idle_connection() if attempt == 0 else None
            reused = connection is not None
            if connection is None:
                try:
                    connection = await asyncio.open_connection(self._host, self._port, ssl=self._ssl)
                except OSError as exc:
                    return note_failure(self.causes, CONNECT_ERROR, exc)
            reader, writer = connection
            try:
                writer.write(request)
                response = await read_response(reader)
            except ConnectionError as exc:  # ConnectionClosed included
                writer.close()
                if reused:  # the server closed this kept-alive connection (its idle timeout): retry on a fresh one
                    continue
                return note_failure(self.causes, TRANSPORT_ERROR, exc)
            except (OSError, EOFError, ValueError, asyncio.LimitOverrunError) as exc:
                writer.close()
                return note_failure(self.causes, TRANSPORT_ERROR, exc)
            except BaseException:  # cancelled mid-answer (timeout): its state is unknown
                writer.close()
                raise
            if response.keep_alive:
                self._idle.append((reader, writer))
            else:
                writer.close()
            if response.status != 200 and response.status not in self.causes:
                note_failure(
                    self.causes,
                    response.status,
                    str(error_from_response(response.status, response.headers, response.body)),
                )
            return response.status
        raise AssertionError("both attempts returned or continued. This is a bug.")

    async def aclose(self) -> None:
        while self._idle:
            _, writer = self._idle.pop()
            writer.close()


def note_failure(causes: dict[int, str], status: int, cause: BaseException | str) -> int:
    """Keep the first cause seen for `status` (an exception is named with its type); return `status`."""
    if status not in causes:
        causes[status] = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}".rstrip(": ")
    return status


# Each engine is built as engine(url, connections, timeout, headers).
ENGINES: dict[str, Callable[[str, int, float, dict[str, str], ssl.SSLContext | bool], Sender[Any]]] = {
    "raw": RawSender,
    "httpx": HttpxSender,
}
