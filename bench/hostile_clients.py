"""Hostile clients for bench/hostile.py and the tests: floods, tricklers, readers that never read.

Each is a plain coroutine against a server's port; PeakMemory samples the server's resident size
while a block runs, and GoodTraffic is the stream of good requests whose latency a flood may hurt.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.queues
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ffn_client.http1 import Response, read_response
from ffn_testing import HOST, ServerProcess, http_request, raw_request

V1 = "/v1/models/demo/transform"
MiB = 1 << 20
# glibc keeps large freed blocks for reuse once it has seen one freed (its mmap threshold rises),
# so RSS would not show memory given back; a fixed threshold makes RSS show what is really held.
MEASURABLE_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}


class PeakMemory:
    """Samples a server's resident size (its whole process tree's) every 20 ms while a block runs: `growth` is peak minus before."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.before = self.peak = server.tree_rss_bytes()
        self._task: asyncio.Task[None] | None = None

    async def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, self.server.tree_rss_bytes())
            await asyncio.sleep(0.02)

    async def __aenter__(self) -> PeakMemory:
        self._task = asyncio.create_task(self._sample())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        self.peak = max(self.peak, self.server.tree_rss_bytes())

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


async def pipelining_client(port: int, requests: int, window: int = 64) -> float:
    """A well-behaved pipelining client: `requests` GETs, `window` sent ahead of the answers read; req/s."""
    reader, writer = await asyncio.open_connection(HOST, port)
    probe = http_request("GET", "/v2/health/live", close=False)
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        sent = answered = 0
        while answered < requests:
            ahead = min(window - (sent - answered), requests - sent)
            if ahead > 0:
                writer.write(probe * ahead)
                sent += ahead
            status = (await read_response(reader)).status
            if status != 200:
                raise RuntimeError(f"pipelined request {answered} answered {status}")
            answered += 1
        return requests / (loop.time() - started)
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


async def flood_for(seconds: float, concurrency: int, flood: Callable[[], Awaitable[object]]) -> int:
    """Keep `concurrency` floods running, each started again when it ends, for `seconds`; how many ran."""
    loop = asyncio.get_running_loop()
    stop = loop.time() + seconds
    started = 0

    async def one_lane() -> None:
        nonlocal started
        while loop.time() < stop:
            started += 1
            try:
                await asyncio.wait_for(flood(), max(0.1, stop - loop.time()))
            except (TimeoutError, OSError):
                pass

    await asyncio.gather(*(one_lane() for _ in range(concurrency)))
    return started


async def idle_connection(port: int, seconds: float) -> None:
    """A connection that says nothing for `seconds`, or until the server closes it."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        await asyncio.wait_for(reader.read(1), seconds)
    except (TimeoutError, OSError):
        pass
    finally:
        writer.close()


async def slow_upload(
    port: int, size: int, rate: float, headers: dict[str, str] | None = None, shape: str | None = None
) -> int | None:
    """A raw float32 body of `size` bytes sent at `rate` bytes/s: the answer's status, None if cut off.

    `shape`: the X-Shape to claim (by default the body's own; another one makes it a 400 once read).
    """
    rows = size // (512 * 4)
    body = np.zeros((rows, 512), dtype="<f4").tobytes()
    head = {
        **(headers or {}),
        "Content-Type": "application/octet-stream",
        "X-Shape": shape or f"{rows},512",
        "Content-Length": str(len(body)),
    }
    reader, writer = await asyncio.open_connection(HOST, port)
    answer = asyncio.ensure_future(read_response(reader))
    try:
        writer.write(http_request("POST", V1, head, close=False))
        piece = max(1, int(rate / 10))
        for offset in range(0, len(body), piece):
            if answer.done():
                break
            writer.write(body[offset : offset + piece])
            await writer.drain()
            await asyncio.sleep(0.1)
        return (await asyncio.wait_for(answer, 60)).status
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        return None
    finally:
        answer.cancel()
        writer.close()


def one_row_request(headers: dict[str, str] | None = None) -> bytes:
    row = np.linspace(-1, 1, 512, dtype="<f4")
    head = {**(headers or {}), "Content-Type": "application/octet-stream", "X-Shape": "1,512"}
    return http_request("POST", V1, head, row.tobytes())


@dataclass
class Samples:
    """Good requests' outcomes: each one's latency in seconds and its status (None: no answer)."""

    latencies: list[float] = field(default_factory=list)
    statuses: list[int | None] = field(default_factory=list)

    def ok(self) -> list[float]:
        return [t for t, s in zip(self.latencies, self.statuses, strict=True) if s == 200]

    def percentile(self, q: float) -> float:
        ok = self.ok()
        return float(np.percentile(ok, q)) if ok else float("nan")

    @property
    def failed(self) -> int:
        return sum(status != 200 for status in self.statuses)


class GoodTraffic:
    """`clients` clients, each sending `request` on a new connection, one after another, while the block runs.

    They run in a process of their own, with their own event loop: a flood sent from this process
    must not delay them here, only at the server. `samples` is filled when the block ends.
    """

    def __init__(self, port: int, clients: int = 4, request: bytes | None = None) -> None:
        self.port, self.clients = port, clients
        self.request = request if request is not None else one_row_request()
        self.samples = Samples()
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._results: multiprocessing.queues.Queue[tuple[list[float], list[int | None]]] = context.Queue()
        self._process = context.Process(
            target=_good_traffic_main, args=(port, clients, self.request, self._stop, self._results), daemon=True
        )

    async def __aenter__(self) -> GoodTraffic:
        self._process.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        latencies, statuses = await asyncio.to_thread(self._results.get, True, 120)
        await asyncio.to_thread(self._process.join, 30)
        self.samples = Samples(latencies, statuses)


def _good_traffic_main(port: int, clients: int, request: bytes, stop: Any, results: Any) -> None:
    """GoodTraffic's process: the clients on a loop of their own until `stop` is set, then the samples."""

    async def traffic() -> Samples:
        samples = Samples()
        loop = asyncio.get_running_loop()

        async def client() -> None:
            while not stop.is_set():
                sent = loop.time()
                try:
                    status: int | None = (await raw_request(port, request, timeout=30)).status
                except (OSError, TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                    status = None
                samples.latencies.append(loop.time() - sent)
                samples.statuses.append(status)
                await asyncio.sleep(0.01)

        await asyncio.gather(*(client() for _ in range(clients)))
        return samples

    samples = asyncio.run(traffic())
    results.put((samples.latencies, samples.statuses))


async def quiet_samples(port: int, seconds: float, request: bytes | None = None) -> Samples:
    """The good requests' outcomes with nothing else going on, for `seconds`."""
    async with GoodTraffic(port, request=request) as good:
        await asyncio.sleep(seconds)
    return good.samples
