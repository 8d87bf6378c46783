"""The gRPC door under floods no grpc library would send (issue 28, classes 1, 2 and 4), a good caller beside.

A short version of each of bench/hostile_grpc.py's scenarios against a real server in each layout, with an
API key: the attackers speak HTTP/2 frame by frame (bench/hostile_grpc_clients.py, hyper-h2), the
good callers make an authenticated ModelInfer on a fresh gRPC connection, and a native request on a
fresh HTTP connection, every half second, each answer checked against numpy. What is asserted is
what the flood got (connections closed, settings advertised), that every good call was answered
right, and the server's memory: never how long anything took.

Class 5 (a header block of endless CONTINUATION frames) stays open: grpc core stores the whole
block before it applies its metadata limit, and grpcio lets a servicer see none of it (see
docs/operations.md). Class 3 (control messages) is tests/test_grpc_budgets.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc
import httpx
import numpy as np
import pytest
from tritonclient.grpc import service_pb2_grpc

from bench.hostile_clients import MEASURABLE_MALLOC, PeakMemory
from bench.hostile_grpc_clients import (
    HOST,
    GoodCaller,
    callers_beside,
    every,
    headers_only_streams,
    infer_request,
    rapid_reset,
    slow_messages,
    unread_answers,
    watch_streams,
)
from ffn_testing import ServerProcess, start_server
from tests.model_files import answer, matches, write_ffn
from tests.test_hostile import LAYOUTS

pytestmark = pytest.mark.server

MiB = 1024 * 1024
KEY = "floods-key"
D = 16
MAX_CONNECTIONS = 48  # small, so that a flood past it is cheap to send
HEADER_TIMEOUT_S = 3.0
SEND_TIMEOUT_S = 2.0
HELD = 128 * MiB
WEIGHTS: dict[str, np.ndarray] = {}
X = np.random.default_rng(7).standard_normal((4, D)).astype(np.float32)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Every flood against both layouts: one process, and a front with the engine process (issue 40)."""
    folder = tmp_path_factory.mktemp("grpc-floods")
    WEIGHTS.update(write_ffn(folder / "small.safetensors", 11, d_model=D))
    (folder / "ffn.toml").write_text('[[models]]\nname = "demo"\nweights = "small.safetensors"\n')
    env = {
        **MEASURABLE_MALLOC,
        "FFN_API_KEY": KEY,
        "FFN_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
        "FFN_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
        "FFN_SEND_TIMEOUT_S": str(SEND_TIMEOUT_S),
        # The layout holds a request twice (in the front and in the hand-off's memory): twice the budget
        # gives its front the single process's HELD, so that both meet the floods with the same rooms.
        "FFN_MAX_HELD_BYTES": str(HELD * (2 if LAYOUTS[request.param] else 1)),
        "FFN_MAX_QUEUE_ROWS": str(1 << 18),  # the unread answers' rows all queue at once: no good call refused 429
        "FFN_WARMUP": "0",
        "FFN_LOG_LEVEL": "warning",
        **LAYOUTS[request.param],
    }
    with start_server(env=env, config=folder / "ffn.toml") as srv:
        yield srv


@dataclass
class HttpCaller:
    """A native request on a fresh HTTP connection every `interval_s`, each answer checked against numpy."""

    url: str
    interval_s: float = 0.5
    answered: int = 0
    failures: list[str] = field(default_factory=list)

    async def one(self) -> None:
        try:
            async with httpx.AsyncClient(base_url=self.url, timeout=60) as client:  # a fresh connection
                response = await client.post(
                    "/v1/models/demo/transform",
                    json={"inputs": X.tolist()},
                    headers={"Authorization": f"Bearer {KEY}"},
                )
        except httpx.HTTPError as error:
            self.failures.append(repr(error))
            return
        if response.status_code != 200:
            self.failures.append(f"{response.status_code} {response.text[:80]}")
        elif not matches(np.asarray(response.json()["outputs"]), WEIGHTS, X):
            self.failures.append("a wrong answer")
        else:
            self.answered += 1

    async def run(self, stop: asyncio.Event) -> None:
        await every(self.interval_s, self.one, stop)


@dataclass
class Beside:
    grpc: GoodCaller
    http: HttpCaller

    def assert_all_answered_right(self) -> None:
        """Every good call on both doors answered right, and at least one on each while the flood ran."""
        assert self.grpc.wrong == 0
        assert self.grpc.failures == [], self.grpc.failures[:3]
        assert self.grpc.latencies, "no gRPC call was made"
        assert self.http.failures == [], self.http.failures[:3]
        assert self.http.answered, "no HTTP request was made"


@contextlib.asynccontextmanager
async def good_callers(server: ServerProcess) -> AsyncIterator[Beside]:
    """Good callers on both doors, on a loop of their own, for the block's duration."""
    expected = answer(WEIGHTS, X).astype(np.float32)
    callers = Beside(GoodCaller(server.grpc_target, X, expected, KEY, timeout_s=60), HttpCaller(server.url))
    async with callers_beside(callers.grpc, callers.http):
        yield callers


def _port(server: ServerProcess) -> int:
    assert server.grpc_port is not None
    return server.grpc_port


async def test_connections_that_never_send_the_preface_are_closed_at_the_header_timeout(server: ServerProcess) -> None:
    # More silent connections than max_connections: they fill the cap, and grpc core closes each at
    # header_timeout_s, so that fresh connections get in again while the attacker still holds its
    # sockets. The HTTP door is not touched by any of it.
    silent = []
    for _ in range(MAX_CONNECTIONS + 16):
        silent.append(await asyncio.open_connection(HOST, _port(server)))
    async with good_callers(server) as callers:
        ends = await asyncio.gather(*(_until_closed(reader) for reader, _ in silent))
        assert all(ends), (
            f"{ends.count(False)} of {len(ends)} silent connections still open after 30 s (grpc core closes one that sent no SETTINGS at 60 s by itself)"
        )
        fresh = GoodCaller(server.grpc_target, X, answer(WEIGHTS, X).astype(np.float32), KEY, timeout_s=60)
        await fresh.one()  # a fresh connection while the attacker's sockets are still held
    for _, writer in silent:
        writer.close()
    assert fresh.failures == [] and fresh.wrong == 0 and fresh.latencies, fresh.failures
    assert callers.http.failures == [], callers.http.failures[:3]
    assert callers.http.answered


async def _until_closed(reader: asyncio.StreamReader) -> bool:
    """Whether the server closes the connection within 30 s, ten header timeouts (what it sends before, read and dropped)."""
    try:
        async with asyncio.timeout(30):
            while await reader.read(65536):
                pass
        return True
    except TimeoutError:
        return False
    except ConnectionError:
        return True


async def test_health_watch_streams_open_without_a_key_take_no_slot_of_the_authenticated_calls(
    server: ServerProcess,
) -> None:
    # Twice the probes' budget of Watch streams: the ones past it are refused, and the calls that
    # need a key, which count in a budget of their own, are all answered.
    async with good_callers(server) as callers:
        opened = await watch_streams(server.grpc_target, 2 * MAX_CONNECTIONS, 4, 2.0)
    assert 0 < opened <= MAX_CONNECTIONS
    callers.assert_all_answered_right()


async def test_a_connection_opening_streams_of_headers_only_is_held_to_the_advertised_streams(
    server: ServerProcess,
) -> None:
    async with good_callers(server) as callers:
        # Ten times the advertised cap. (5,000 cost the client 3.5 s of CPU more: h2 counts a
        # connection's open streams by walking all of them at every send.)
        raw = await headers_only_streams(_port(server), 1000, 2.0, KEY)
        advertised = raw.h2.remote_settings.max_concurrent_streams
        open_streams = raw.h2.open_outbound_streams
        raw.close()
    assert advertised == 100, "SETTINGS_MAX_CONCURRENT_STREAMS is advertised"
    assert open_streams <= 100
    callers.assert_all_answered_right()


async def test_messages_declared_and_never_finished_leave_the_door_open(server: ServerProcess) -> None:
    async with good_callers(server) as callers, PeakMemory(server) as memory:
        raws = await asyncio.gather(*(slow_messages(_port(server), 100, 2.0, KEY) for _ in range(4)))
        for raw in raws:
            raw.close()
    callers.assert_all_answered_right()
    assert memory.growth < HELD + 256 * MiB, f"grew by {memory.growth / MiB:.0f} MiB"


async def test_answers_never_read_end_their_connection_at_the_send_timeout_and_are_given_back(
    server: ServerProcess,
) -> None:
    x = np.zeros((2048, D), np.float32)  # 128 KiB answers, none of which can be sent: the window is 0
    async with good_callers(server) as callers, PeakMemory(server) as memory:
        raws = await unread_answers(_port(server), 64, x, SEND_TIMEOUT_S + 10, KEY, connections=2)
    assert all(raw.closed for raw in raws), "the server ended each connection whose answers were not taken"
    callers.assert_all_answered_right()
    await asyncio.sleep(0.5)
    assert server.tree_rss_bytes() - memory.before < 64 * MiB, "the unread answers' bytes were given back"


async def test_rapid_reset_does_not_cancel_other_callers(server: ServerProcess) -> None:
    # Streams opened and reset at once, as fast as one connection takes them (CVE-2023-44487):
    # before, every call on a fresh connection ended CANCELLED for about 3 s after.
    async with good_callers(server) as callers, PeakMemory(server) as memory:
        raw = await rapid_reset(_port(server), 3.0, KEY)
        raw.close()
        await asyncio.sleep(2.0)  # the good callers go on past the flood: the 3 s after it included
    assert raw.resets > 1000, "the flood was sent"
    callers.assert_all_answered_right()
    assert memory.growth < 256 * MiB, f"grew by {memory.growth / MiB:.0f} MiB"


async def test_metadata_past_max_header_bytes_is_refused_and_the_door_goes_on(server: ServerProcess) -> None:
    x = X
    metadata = (("authorization", f"Bearer {KEY}"),)
    async with grpc.aio.insecure_channel(server.grpc_target) as channel:
        client = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.ModelInfer(infer_request(x), metadata=(*metadata, ("x-big", "a" * 20_000)), timeout=60)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
        assert "16384" in (refused.value.details() or "")  # the budget: FFN_MAX_HEADER_BYTES' default
        answer_ = await client.ModelInfer(infer_request(x), metadata=(*metadata, ("x-fits", "a" * 8_000)), timeout=60)
    rows = np.frombuffer(answer_.raw_output_contents[0], "<f4").reshape(x.shape)
    assert matches(rows, WEIGHTS, x)
