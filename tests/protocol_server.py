"""Our HTTP protocol (app/web/protocol.py) on a loopback socket in the test's own loop, under an app the test steers.

    async with protocol_server(max_header_bytes=2048) as server:
        reader, writer = await asyncio.open_connection(HOST, server.port)
        server.app.gate.clear()  # answers wait until the test sets it again

The app reads each request's whole body, waits for `gate`, records (method, path, headers,
body) and answers 200 with JSON naming what it got: the tests see what the parser delivered
and when, and the protocol instances (`server.protocols`) are there to inspect.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvicorn
from uvicorn.server import ServerState

from app.settings import Settings
from app.web.connections import ConnectionBudget
from app.web.protocol import LimitedHttpToolsProtocol, uvicorn_options

HOST = "127.0.0.1"


@dataclass
class Seen:
    method: str
    path: str
    headers: list[tuple[bytes, bytes]]
    body: bytes


@dataclass
class RecordingApp:
    """An ASGI app that reads the whole body, waits for `gate`, and answers what it read."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)
    started: int = 0  # requests whose app call began
    seen: list[Seen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.gate.set()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http", scope["type"]
        self.started += 1
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        await self.gate.wait()
        self.seen.append(Seen(scope["method"], scope["path"], list(scope["headers"]), body))
        payload = orjson.dumps({"path": scope["path"], "body": len(body)})
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


@dataclass
class ProtocolServer:
    port: int
    app: RecordingApp
    protocols: list[LimitedHttpToolsProtocol]
    budget: ConnectionBudget[LimitedHttpToolsProtocol]


@asynccontextmanager
async def protocol_server(**settings: Any) -> AsyncIterator[ProtocolServer]:
    """Serve a RecordingApp with our protocol and `settings` (Settings fields) on a free loopback port."""
    app = RecordingApp()
    options = uvicorn_options(Settings(**settings))
    config = uvicorn.Config(app, log_config=None, lifespan="off", proxy_headers=False, server_header=False, **options)
    config.load()
    state = ServerState()
    protocols: list[LimitedHttpToolsProtocol] = []

    def create() -> LimitedHttpToolsProtocol:
        protocol = config.http_protocol_class(config=config, server_state=state, app_state={})
        protocols.append(protocol)
        return protocol

    server = await asyncio.get_running_loop().create_server(create, HOST, 0)
    try:
        budget = getattr(options["http"], "budget", None)  # None before issue 20, for a run against an older checkout
        yield ProtocolServer(server.sockets[0].getsockname()[1], app, protocols, budget)  # type: ignore[arg-type]
    finally:
        app.gate.set()
        server.close()
        for protocol in protocols:
            if protocol.transport is not None:
                protocol.transport.abort()
        for task in list(state.tasks):
            task.cancel()
        await server.wait_closed()
