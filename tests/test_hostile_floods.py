"""Connection floods of issue 20 against a real `ffn-serve`: the server's memory stays flat, good requests are served.

Classes 1 (a trailer section that never ends), 2 (pipelined requests never read) and 5 (bodies
trickled just inside the read timeout). The server runs with an API key (the floods need none:
trailers come before the key could matter, health probes carry none), short timeouts and a
small connection cap; memory is its resident size from /proc, sampled while each flood runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

from bench.hostile_clients import MEASURABLE_MALLOC, PeakMemory, flood_pipelined, flood_trailers, trickle_body
from ffn_testing import ServerProcess, http_request, raw_request, start_server
from tests.test_hostile import LAYOUTS
from tests.wire import demo_answers_right

KEY = "floods-test-key-7d1e"
AUTH = {"Authorization": f"Bearer {KEY}"}
V1 = "/v1/models/demo/transform"
MAX_CONNECTIONS = 16
MiB = 1 << 20
FLAT = 50 * MiB  # the bound on RSS growth under a flood


@pytest.fixture(scope="module", params=list(LAYOUTS))
def server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """Against both layouts: one process, and a front with the engine process (issue 40)."""
    env = {
        "FFN_API_KEY": KEY,
        "FFN_WARMUP": "0",
        "FFN_HEADER_TIMEOUT_S": "3",
        "FFN_READ_TIMEOUT_S": "1",
        "FFN_SEND_TIMEOUT_S": "1",
        "FFN_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
        **MEASURABLE_MALLOC,
    }
    with start_server(env={**env, **LAYOUTS[request.param]}) as srv:
        yield srv


@pytest.fixture(autouse=True)
async def still_serving(server: ServerProcess) -> AsyncIterator[None]:
    await demo_answers_right(server.port, AUTH)  # the allocator's caches at this size are not growth
    yield
    assert server.proc.poll() is None, f"server died; log:\n{server.logs()}"
    await demo_answers_right(server.port, AUTH)


async def test_a_trailer_flood_keeps_memory_flat(server: ServerProcess) -> None:
    # Before: every trailer field was appended to the request's headers (the review: 2.7 GB in 13 s).
    async with PeakMemory(server) as memory:
        await asyncio.wait_for(asyncio.gather(*(flood_trailers(server.port, 64 * MiB) for _ in range(4))), 300)
    assert memory.growth < FLAT, f"RSS grew {memory.growth / MiB:.0f} MiB while 4 x 64 MiB of trailers flooded in"


async def test_a_pipelined_flood_keeps_memory_flat_and_probes_answered(server: ServerProcess) -> None:
    # Before: every pipelined request in a read was parsed and queued, reading resumed at each answer (1 GB in 10 s).
    async with PeakMemory(server) as memory:
        flood = asyncio.gather(*(flood_pipelined(server.port, 16 * MiB) for _ in range(2)))
        r = await raw_request(server.port, http_request("GET", "/v2/health/ready"))
        assert r.status == 200
        await asyncio.wait_for(flood, 300)
    assert memory.growth < FLAT, f"RSS grew {memory.growth / MiB:.0f} MiB while 2 x 16 MiB of GETs were pipelined"


async def test_a_pipelined_flood_on_many_connections_keeps_memory_flat_and_good_requests_answered_right(
    server: ServerProcess,
) -> None:
    # The same on most of the connection cap at once: each connection holds at most one read
    # unparsed, and their requests start one a turn of the loop, so the good ones still get theirs.
    async with PeakMemory(server) as memory:
        flood = asyncio.gather(*(flood_pipelined(server.port, 2 * MiB) for _ in range(MAX_CONNECTIONS - 4)))
        await asyncio.sleep(0.5)  # every flooding connection is open and pipelining
        await demo_answers_right(server.port, AUTH)
        await asyncio.wait_for(flood, 300)
    assert memory.growth < FLAT, f"RSS grew {memory.growth / MiB:.0f} MiB while 12 connections pipelined GETs"


async def test_tricklers_cannot_fill_the_connection_cap(server: ServerProcess) -> None:
    # Before: bodies sent a byte just inside the read timeout were never timed out; as many as the
    # cap held it, and every other client got 503 for as long as they kept trickling.
    async with PeakMemory(server) as memory:
        tricklers = [asyncio.ensure_future(trickle_body(server.port, 0.5, AUTH)) for _ in range(MAX_CONNECTIONS)]
        await asyncio.sleep(1.0)  # every trickler has sent its head and a few bytes
        await demo_answers_right(server.port, AUTH)
        statuses = await asyncio.wait_for(asyncio.gather(*tricklers), 120)
    # Half the cap may be receiving; the others are refused as they try, the rest time out on the rate.
    assert set(statuses) <= {408, 503, None}, statuses
    assert statuses.count(408) <= MAX_CONNECTIONS // 2, statuses
    assert memory.growth < FLAT


async def test_a_v2_envelope_of_millions_of_keys_is_refused_before_parsing(server: ServerProcess) -> None:
    # Class 6. Before: counted arrays and values only; 4.6 M parameter keys (57 MiB) cost 12x the body and
    # 3 s, and the request, valid otherwise, was answered 200.
    keys = b",".join(b'"k%07d":1' % i for i in range(4_600_000))
    body = (
        b'{"parameters": {'
        + keys
        + b'}, "inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": ['
        + b",".join([b"0"] * 512)
        + b"]}]}"
    )
    request = http_request(
        "POST", "/v2/models/demo/infer", {**AUTH, "Content-Type": "application/json"}, body, close=False
    )
    async with PeakMemory(server) as memory:
        r = await raw_request(server.port, request, timeout=120)
    assert r.status == 413 and r.json()["error_type"] == "payload_too_large", r.body[:300]
    assert memory.growth < 3 * len(body), f"RSS grew {memory.growth / MiB:.0f} MiB for a {len(body) / MiB:.0f} MiB body"
