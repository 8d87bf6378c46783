"""A minimal HTTP/1.1 server on raw asyncio that answers without doing any work.

Two uses: the load tester's own ceiling (how many requests/s it can generate when the server
costs nothing), and a scriptable peer for tests (say, 429 twice, then 200).

    python3 -m ffn_client.stub_server --port 9000      # echoes request bodies like /transform

Not a general web server: no chunked bodies, no pipelining guarantees beyond in-order answers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, cast

from ffn_client.http1 import parse_head


@dataclass(frozen=True, slots=True)
class StubRequest:
    """One parsed request; header names are lower-case."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass(frozen=True, slots=True)
class StubAnswer:
    """What to send back."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    close: bool = False  # hang up after answering, unannounced (as an idle timeout does)

    def to_bytes(self) -> bytes:
        lines = [f"HTTP/1.1 {self.status} {HTTPStatus(self.status).phrase}", f"content-length: {len(self.body)}"]
        lines += [f"{name}: {value}" for name, value in self.headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + self.body


Responder = Callable[[StubRequest], StubAnswer]

_MODELS = StubAnswer(
    headers={"content-type": "application/json"},
    body=b'{"models":[{"name":"demo","d_model":512,"d_ff":2048,"activation":"relu","gated":false}]}',
)


def echo(request: StubRequest) -> StubAnswer:
    """Answers like /transform would, for free: POST bodies come back as they went, GETs get 200."""
    if request.method != "POST":
        return _MODELS if request.path == "/v1/models" else StubAnswer(body=b"{}")
    headers = {"content-type": request.headers.get("content-type", "application/octet-stream")}
    for name in ("x-shape", "x-dtype", "inference-header-content-length"):
        if name in request.headers:
            headers[name] = request.headers[name]
    return StubAnswer(headers=headers, body=request.body)


class _Connection(asyncio.Protocol):
    """Parses requests off one keep-alive connection and writes each answer in order."""

    def __init__(self, respond: Responder) -> None:
        self._respond = respond
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # create_server hands over a stream transport; uvloop's do not subclass asyncio.Transport.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while (end := self._buffer.find(b"\r\n\r\n")) >= 0:
            request_line, headers = parse_head(self._buffer[:end])
            length = int(headers.get("content-length", "0"))
            if len(self._buffer) < end + 4 + length:
                return  # wait for the rest of the body
            body = bytes(self._buffer[end + 4 : end + 4 + length])
            del self._buffer[: end + 4 + length]
            method, path, _version = request_line.split(" ", 2)
            answer = self._respond(StubRequest(method, path, headers, body))
            assert self._transport is not None, "data before connection_made. This is a bug."
            self._transport.write(answer.to_bytes())
            if answer.close:
                self._transport.close()
                return


class StubServer:
    """`respond` called for every request on 127.0.0.1:`port` (0 = a free port)."""

    def __init__(self, respond: Responder = echo, host: str = "127.0.0.1", port: int = 0) -> None:
        self.respond = respond
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(lambda r: self.respond(r)), self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def serve_forever(self) -> None:
        await self.start()
        assert self._server is not None
        await self._server.serve_forever()

    @contextlib.contextmanager
    def in_thread(self) -> Iterator[StubServer]:
        """Serve from a background thread with its own event loop while the block runs."""
        loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.run_until_complete(self.start())
            started.set()
            loop.run_forever()

        thread = threading.Thread(target=run, name="stub-server", daemon=True)
        thread.start()
        started.wait(10)
        try:
            yield self
        finally:
            asyncio.run_coroutine_threadsafe(self.stop(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m ffn_client.stub_server", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    args = parser.parse_args(argv)
    server = StubServer(host=args.host, port=args.port)
    print(f"stub server on http://{args.host}:{args.port} (echo)", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        _fastest_run()(server.serve_forever())
    return 0


def _fastest_run() -> Callable[[Coroutine[Any, Any, None]], None]:
    """uvloop's run where it is installed (the stub must not be the bottleneck), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    run: Callable[[Coroutine[Any, Any, None]], None] = uvloop.run
    return run


if __name__ == "__main__":
    raise SystemExit(main())
