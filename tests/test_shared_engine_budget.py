"""One byte budget for the fronts-and-engine layout (issue 40, item 2), over HTTP binary and gRPC.

With `--shared-engine --workers 2` and max_held_bytes 256 MiB: 48 concurrent 31 MiB requests grow the
whole process tree (the supervisor, both fronts, the engine: ServerProcess.tree_rss_bytes, sampled
every 20 ms by PeakMemory) by less than the budget + 512 MiB at their peak; past the budget they are
refused 429; no front is replaced; a 31 MiB request alone is answered right before and after
(checked against numpy). What is measured is memory, never time.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from bench.hostile_clients import MEASURABLE_MALLOC, PeakMemory
from ffn_client.http1 import Response
from ffn_testing import ServerProcess, http_request, raw_request, start_server
from tests.grpc_helpers import infer_or_error, infer_request, output_of
from tests.model_files import matches, write_ffn
from tests.wire import raw_headers
from tests.worker_logs import worker_pids

pytestmark = pytest.mark.server

MiB = 1 << 20
D = 32  # a small model: 31 MiB of float32 rows is 253,952 rows, cheap to compute and to check
HELD = 256 * MiB
SIZE = 31 * MiB
CALLS = 48
ROWS = SIZE // (D * 4)
WEIGHTS: dict[str, np.ndarray] = {}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("layout-budget")
    WEIGHTS.update(write_ffn(folder / "small.safetensors", 5, d_model=D))
    (folder / "ffn.toml").write_text('[[models]]\nname = "small"\nweights = "small.safetensors"\n')
    env = {
        **MEASURABLE_MALLOC,
        "FFN_SHARED_ENGINE": "true",
        "FFN_WORKERS": "2",
        "FFN_MAX_HELD_BYTES": str(HELD),
        "FFN_MAX_QUEUE_ROWS": str(CALLS * ROWS),  # the queue takes them all: the bytes decide
        "FFN_MAX_BATCH_ROWS": "16384",
        "FFN_WARMUP": "0",
        "FFN_TORCH_THREADS": "1",
        "FFN_LOG_FORMAT": "json",
    }
    with start_server(env=env, config=folder / "ffn.toml", ready_timeout=180) as srv:
        yield srv


def request_bytes(x: np.ndarray) -> bytes:
    # Keep-alive: the server answers a refusal before the body and reads the rest, never resetting the connection.
    return http_request("POST", "/v1/models/small/transform", raw_headers(x.shape), x.tobytes(), close=False)


def pieces(data: bytes) -> Iterator[memoryview]:
    """The request in 1 MiB writes: the test's own buffers stay small while 48 are sent at once."""
    view = memoryview(data)
    for at in range(0, len(view), MiB):
        yield view[at : at + MiB]


async def one(port: int, data: bytes) -> Response:
    return await raw_request(port, pieces(data), timeout=600)  # type: ignore[arg-type]


def answer_of(response: Response, x: np.ndarray) -> np.ndarray:
    assert response.status == 200, response.body[:300]
    return np.frombuffer(response.body, "<f4").reshape(x.shape)


async def test_a_flood_of_large_requests_holds_the_whole_tree_within_the_budget(server: ServerProcess) -> None:
    x = np.random.default_rng(0).standard_normal((ROWS, D)).astype(np.float32)
    data = request_bytes(x)
    assert matches(answer_of(await one(server.port, data), x), WEIGHTS, x)  # alone, before
    assert (
        "each front holds at most 64 MiB, and as much in its hand-off memory (max_held_bytes 256 MiB split between 2 fronts)"
        in server.logs()
    )
    fronts = worker_pids(server)
    await asyncio.sleep(0.5)
    async with PeakMemory(server) as memory:
        outcomes = await asyncio.gather(*(one(server.port, data) for _ in range(CALLS)))
    statuses = Counter(response.status for response in outcomes)
    assert set(statuses) <= {200, 429} and statuses[200] and statuses[429], statuses
    for response in outcomes:
        if response.status == 200:
            assert matches(answer_of(response, x), WEIGHTS, x)
        else:
            assert response.json()["error_type"] == "too_many_bytes_held", response.body[:300]  # type: ignore[index]
    print(f"48 x 31 MiB over HTTP binary: {dict(statuses)}, the tree grew {memory.growth / MiB:.0f} MiB at peak")
    assert memory.growth < HELD + 512 * MiB, f"grew by {memory.growth / MiB:.0f} MiB"
    assert worker_pids(server) == fronts, "a front was replaced"
    assert matches(answer_of(await one(server.port, data), x), WEIGHTS, x)  # alone, after


async def test_a_flood_of_large_grpc_calls_holds_the_whole_tree_within_the_budget(server: ServerProcess) -> None:
    x = np.random.default_rng(1).standard_normal((ROWS, D)).astype(np.float32)
    request = infer_request(x, "small")
    alone = await infer_or_error(server.grpc_target, request)
    assert isinstance(alone, pb.ModelInferResponse), alone
    assert matches(output_of(alone), WEIGHTS, x)  # alone, before
    fronts = worker_pids(server)
    await asyncio.sleep(0.5)
    async with PeakMemory(server) as memory:
        outcomes = await asyncio.gather(*(infer_or_error(server.grpc_target, request) for _ in range(CALLS)))
    answered = [outcome for outcome in outcomes if isinstance(outcome, pb.ModelInferResponse)]
    refused = [outcome for outcome in outcomes if isinstance(outcome, grpc.aio.AioRpcError)]
    print(
        f"48 x 31 MiB ModelInfer: {len(answered)} answered, {len(refused)} refused, grew {memory.growth / MiB:.0f} MiB"
    )
    assert answered and refused
    for response in answered:
        assert matches(output_of(response), WEIGHTS, x)
    for error in refused:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert memory.growth < HELD + 512 * MiB, f"grew by {memory.growth / MiB:.0f} MiB"
    assert worker_pids(server) == fronts, "a front was replaced"
    after = await infer_or_error(server.grpc_target, request)
    assert isinstance(after, pb.ModelInferResponse), after
    assert matches(output_of(after), WEIGHTS, x)  # alone, after
