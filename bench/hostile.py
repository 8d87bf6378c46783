"""Hostile clients against a real server: what a header flood, a huge JSON body and unread answers cost.

Not run in CI. It starts `python -m app.cli` on a free 127.0.0.1 port from `--server-dir` (this
checkout by default; point it at another checkout to compare before and after), runs each
scenario on a fresh server, samples the server's VmRSS every 20 ms, and prints one line each:

- headers: 4 connections each send up to 64 MiB of 8 KB headers of a head that never ends;
- empty-rows: a 64 MiB JSON body of empty rows `[[],[],...]`, while /v2/health/live is probed;
- big-json: a 49 MiB JSON body of valid numbers (10,000 x 513, so refused after parsing: the parse
  alone is measured), while /v2/health/live is probed;
- unread: 12 clients ask for ~10 MiB JSON answers on sockets they never read (and keep open);
  RSS once the answers are computed, and after the send timeout (`--send-timeout`, default 2 s).

The server runs with a fixed glibc mmap threshold (MEASURABLE_MALLOC), so that memory it frees
shows in its RSS.

    python3 bench/hostile.py
    python3 bench/hostile.py --server-dir /path/to/checkout-before --only headers empty-rows

The stall is the longest a health probe waited for its answer; RSS growth is peak minus the
reading before the scenario. Timings are noisy on a shared machine; RSS is not.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np

from ffn_client.http1 import Response, read_response
from ffn_client.testing import HOST, ServerProcess, http_request, raw_request, start_server

REPO_ROOT = Path(__file__).resolve().parent.parent
V1 = "/v1/models/demo/transform"
MiB = 1 << 20
# glibc keeps large freed blocks for reuse once it has seen one freed (its mmap threshold rises),
# so RSS would not show memory given back; a fixed threshold makes RSS show what is really held.
MEASURABLE_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}


# ----- hostile clients (tests/test_hostile_connections.py uses them too) ----------------------


class PeakMemory:
    """Samples a server's resident size every 20 ms while a block runs: `growth` is peak minus before."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.before = self.peak = server.rss_bytes()
        self._task: asyncio.Task[None] | None = None

    async def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, self.server.rss_bytes())
            await asyncio.sleep(0.02)

    async def __aenter__(self) -> PeakMemory:
        self._task = asyncio.create_task(self._sample())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        self.peak = max(self.peak, self.server.rss_bytes())

    @property
    def growth(self) -> int:
        return self.peak - self.before


async def flood_headers(port: int, total: int) -> None:
    """Send a request head that never ends: 8 KB headers until `total` bytes or the server hangs up."""
    _, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")
        line = b"X-Flood-%06d: " + b"a" * 8000 + b"\r\n"
        for i in range(total // len(line)):
            writer.write(line % i)
            await writer.drain()
    except (ConnectionResetError, BrokenPipeError):
        pass
    finally:
        writer.close()


async def flood_trailers(port: int, total: int, headers: dict[str, str] | None = None) -> None:
    """A chunked request whose trailer section never ends: 8 KB trailer fields until `total` bytes or the server hangs up."""
    _, writer = await asyncio.open_connection(HOST, port)
    try:
        head = {**(headers or {}), "Content-Type": "application/json", "Transfer-Encoding": "chunked"}
        writer.write(http_request("POST", V1, head, close=False) + b"1\r\n{\r\n0\r\n")
        await writer.drain()
        await asyncio.sleep(0.2)  # the request is in the app, reading its body: its head was checked whole
        line = b"X-Trailer-%06d: " + b"a" * 8000 + b"\r\n"
        for i in range(total // len(line)):
            writer.write(line % i)
            await writer.drain()
    except (ConnectionResetError, BrokenPipeError):
        pass
    finally:
        writer.close()


async def flood_pipelined(port: int, total: int, stall_s: float = 3.0) -> None:
    """Pipeline tiny GETs (health probes: no key needed) without reading an answer, until `total` bytes,
    the server hangs up, or it stops reading for `stall_s` seconds."""
    _, writer = await asyncio.open_connection(HOST, port)
    batch = http_request("GET", "/v2/health/live", close=False) * 2000
    sent = 0
    try:
        while sent < total:
            writer.write(batch)
            await asyncio.wait_for(writer.drain(), stall_s)
            sent += len(batch)
    except (TimeoutError, ConnectionResetError, BrokenPipeError):
        pass
    finally:
        writer.close()


async def trickle_body(
    port: int, interval: float, headers: dict[str, str] | None = None, limit: float = 60.0
) -> int | None:
    """Send a 1 MB body's head, then one byte every `interval` s: the answer's status, None if closed or out of time."""
    reader, writer = await asyncio.open_connection(HOST, port)
    head = {**(headers or {}), "Content-Type": "application/json", "Content-Length": str(1 << 20)}
    answer = asyncio.ensure_future(read_response(reader))
    try:
        writer.write(http_request("POST", V1, head, close=False))
        async with asyncio.timeout(limit):
            while not answer.done():
                writer.write(b" ")
                await writer.drain()
                await asyncio.wait([answer], timeout=interval)
            return (await answer).status
    except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
        return None
    finally:
        answer.cancel()
        writer.close()


async def probe_while(port: int, work: Awaitable[Response], limit: float = 60.0) -> tuple[Response, list[float]]:
    """Run `work` while GET /v2/health/live is probed on its own connection; each probe's wait in seconds."""
    loop = asyncio.get_running_loop()
    waits: list[float] = []
    task = asyncio.ensure_future(work)
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        while not task.done():
            sent = loop.time()
            writer.write(http_request("GET", "/v2/health/live", close=False))
            r = await asyncio.wait_for(read_response(reader), limit)
            assert r.status == 200, f"health probe answered {r.status}"
            waits.append(loop.time() - sent)
            await asyncio.sleep(0.02)
    finally:
        writer.close()
    return await task, waits


async def request_and_never_read(port: int, request: bytes) -> socket.socket:
    """Send `request` on a socket with a tiny receive buffer, and never read the answer."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (HOST, port))
    await loop.sock_sendall(sock, request)
    return sock


def empty_rows_body(size: int) -> bytes:
    """A JSON body of `size` bytes whose inputs are empty rows: [[],[],...]."""
    rows = (size - 16) // 3
    return b'{"inputs": [' + b"[]," * (rows - 1) + b"[]]}"


def numbers_body(rows: int, columns: int) -> bytes:
    """A JSON body of rows x columns plain numbers (0.1234567 each)."""
    row = b"[" + b",".join([b"0.1234567"] * columns) + b"]"
    return b'{"inputs": [' + b",".join([row] * rows) + b"]}"


def json_post(body: bytes, headers: dict[str, str] | None = None) -> bytes:
    return http_request("POST", V1, {**(headers or {}), "Content-Type": "application/json"}, body, close=False)


# ----- scenarios ---------------------------------------------------------------------------------


async def headers_scenario(server: ServerProcess) -> str:
    async with PeakMemory(server) as memory:
        await asyncio.wait_for(asyncio.gather(*(flood_headers(server.port, 64 * MiB) for _ in range(4))), 120)
    return (
        f"headers: 4 x 64 MiB of headers, RSS {memory.before / MiB:.0f} -> peak {memory.peak / MiB:.0f} MiB "
        f"(+{memory.growth / MiB:.0f} MiB)"
    )


async def body_scenario(server: ServerProcess, name: str, body: bytes) -> str:
    async with PeakMemory(server) as memory:
        r, waits = await probe_while(server.port, raw_request(server.port, json_post(body), timeout=120))
    return (
        f"{name}: {len(body) / MiB:.0f} MiB body -> {r.status}, {len(waits)} probes, longest probe wait "
        f"{max(waits, default=0) * 1000:.0f} ms, RSS {memory.before / MiB:.0f} -> peak {memory.peak / MiB:.0f} MiB "
        f"(+{memory.growth / MiB:.0f} MiB, {memory.growth / len(body):.1f}x the body)"
    )


def unread_request(rows: int = 1024, headers: dict[str, str] | None = None) -> bytes:
    """A raw float32 request of `rows` zero rows whose JSON answer is about 10 KiB a row."""
    return http_request(
        "POST",
        V1,
        {**(headers or {}), "Content-Type": "application/octet-stream", "X-Shape": f"{rows},512"},
        np.zeros((rows, 512), dtype="<f4").tobytes(),
        close=False,
    )


async def unread_clients(
    server: ServerProcess, request: bytes, clients: int, send_timeout: float, dropped: Callable[[], bool] | None = None
) -> tuple[int, int]:
    """RSS once `clients` unread answers are computed, and again after the send timeout: (held, after).

    `dropped`, if given, says when the server has let go of every answer (else: the timeout plus 3 s).
    """
    sockets = [await request_and_never_read(server.port, request) for _ in range(clients)]
    try:
        await asyncio.sleep(8.0)  # every answer computed, and stuck in its transport
        held = server.rss_bytes()
        await asyncio.sleep(send_timeout + 3.0)
        for _ in range(1200):
            if dropped is None or dropped():
                break
            await asyncio.sleep(0.1)
        return held, server.rss_bytes()
    finally:
        for sock in sockets:
            sock.close()


async def unread_scenario(server: ServerProcess, send_timeout: float) -> str:
    request = unread_request()
    assert (await raw_request(server.port, request)).status == 200  # caches at this size, read normally
    before = server.rss_bytes()
    held, after = await unread_clients(server, request, 12, send_timeout)
    return (
        f"unread: 12 clients never reading ~10 MiB answers, RSS {before / MiB:.0f} -> {held / MiB:.0f} MiB "
        f"with the answers computed (+{(held - before) / MiB:.0f}), {after / MiB:.0f} MiB after the send timeout "
        f"(+{(after - before) / MiB:.0f}), the clients still connected"
    )


async def run(scenario: str, server: ServerProcess, send_timeout: float) -> str:
    if scenario == "headers":
        return await headers_scenario(server)
    if scenario == "empty-rows":
        return await body_scenario(server, scenario, empty_rows_body(64 * MiB))
    if scenario == "big-json":
        return await body_scenario(server, scenario, numbers_body(10_000, 513))
    return await unread_scenario(server, send_timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server-dir", type=Path, default=REPO_ROOT, help="checkout whose app/ is served")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=["headers", "empty-rows", "big-json", "unread"],
        default=["headers", "empty-rows", "big-json", "unread"],
    )
    parser.add_argument("--send-timeout", type=float, default=2.0, help="FFN_SEND_TIMEOUT_S of the server")
    args = parser.parse_args(argv)
    env = {
        "FFN_WARMUP": "0",
        "FFN_LOG_LEVEL": "warning",
        "FFN_SEND_TIMEOUT_S": str(args.send_timeout),
        **MEASURABLE_MALLOC,
    }
    for scenario in args.only:
        with start_server(env=env, cwd=args.server_dir) as server:
            print(asyncio.run(run(scenario, server, args.send_timeout)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
