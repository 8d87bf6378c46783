"""The gRPC door takes the protocol core's admission: bytes held against max_held_bytes, message limits per method.

A real server, a real grpcio client. What is measured is the server's resident memory (VmRSS,
sampled every 20 ms, glibc's mmap threshold fixed so that freed memory shows), never time.
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
from ffn_testing import ServerProcess, start_server
from tests.grpc_helpers import infer_request, output_of, stub, trailers
from tests.model_files import matches, write_ffn

pytestmark = pytest.mark.server

MiB = 1024 * 1024
D = 16  # a small model: 16 MiB of float32 rows is 262,144 rows, cheap to compute and to check
HELD = 192 * MiB
MESSAGE = 16 * MiB
CALLS = 32  # 512 MiB sent at once: past the budget, so some calls are refused, and far past what it lets in
WEIGHTS: dict[str, np.ndarray] = {}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("grpc-budgets")
    WEIGHTS.update(write_ffn(folder / "small.safetensors", 3, d_model=D))
    (folder / "ffn.toml").write_text('[[models]]\nname = "small"\nweights = "small.safetensors"\n')
    env = {
        **MEASURABLE_MALLOC,
        "FFN_MAX_HELD_BYTES": str(HELD),
        "FFN_MAX_BODY_BYTES": str(32 * MiB),
        "FFN_MAX_QUEUE_ROWS": str(CALLS * MESSAGE // (D * 4)),  # the queue takes them all: the bytes decide
        "FFN_WARMUP": "0",
        "FFN_LOG_LEVEL": "warning",
    }
    with start_server(env=env, config=folder / "ffn.toml") as srv:
        yield srv


async def _call(target: str, request: pb.ModelInferRequest) -> pb.ModelInferResponse | grpc.aio.AioRpcError:
    async with stub(target) as client:
        try:
            return await client.ModelInfer(request, timeout=300)
        except grpc.aio.AioRpcError as error:
            return error


async def test_concurrent_large_calls_hold_at_most_max_held_bytes_and_the_rest_are_refused_with_a_retry_hint(
    server: ServerProcess,
) -> None:
    x = np.random.default_rng(0).standard_normal((MESSAGE // (D * 4), D)).astype(np.float32)
    request = infer_request(x, "small")
    async with PeakMemory(server) as memory:
        outcomes = await asyncio.gather(*(_call(server.grpc_target, request) for _ in range(CALLS)))
    answered = [outcome for outcome in outcomes if isinstance(outcome, pb.ModelInferResponse)]
    refused = [outcome for outcome in outcomes if isinstance(outcome, grpc.aio.AioRpcError)]
    assert answered and refused, Counter(type(outcome).__name__ for outcome in outcomes)
    for response in answered:
        assert matches(output_of(response), WEIGHTS, x)
    for error in refused:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
        assert trailers(error)["ffn-error-type"] == "too_many_bytes_held", error.details()
        assert trailers(error)["grpc-retry-pushback-ms"] == "1000"
    # Sent at once: 512 MiB, held by the server at most HELD (192 MiB) plus what grpc holds while
    # messages arrive and answers leave. Before the budget this grew by about three copies of all.
    assert memory.growth < HELD + 256 * MiB, f"grew by {memory.growth / MiB:.0f} MiB"
    await asyncio.sleep(0.5)
    assert server.rss_bytes() - memory.before < 64 * MiB, "the answered and refused calls' bytes are given back"


async def test_the_budget_is_given_back_so_a_call_after_the_flood_is_answered(server: ServerProcess) -> None:
    x = np.random.default_rng(1).standard_normal((MESSAGE // (D * 4), D)).astype(np.float32)
    # One call at a time, each as large as can be held twice over the calls: none is refused.
    for _ in range(3):
        outcome = await _call(server.grpc_target, infer_request(x, "small"))
        assert isinstance(outcome, pb.ModelInferResponse), outcome
        assert matches(output_of(outcome), WEIGHTS, x)


@pytest.mark.parametrize(
    ("method", "request_type"),
    [
        ("LogSettings", pb.LogSettingsRequest),
        ("TraceSetting", pb.TraceSettingRequest),
        ("RepositoryModelLoad", pb.RepositoryModelLoadRequest),
        ("ModelMetadata", pb.ModelMetadataRequest),
    ],
)
async def test_a_large_message_of_a_method_without_tensors_is_refused_unparsed(
    server: ServerProcess, method: str, request_type: type
) -> None:
    # About 10 MiB of what costs the parser most: map entries, or a long name.
    if method == "LogSettings":
        request = request_type(
            settings={f"k{i}": pb.LogSettingsRequest.SettingValue(bool_param=True) for i in range(600_000)}
        )
    elif method == "TraceSetting":
        request = request_type(
            settings={f"k{i}": pb.TraceSettingRequest.SettingValue(value=[""] * 4) for i in range(500_000)}
        )
    elif method == "RepositoryModelLoad":
        request = request_type(
            model_name="m", parameters={f"k{i}": pb.ModelRepositoryParameter(bool_param=True) for i in range(600_000)}
        )
    else:
        request = request_type(name="m" * (10 * MiB))
    assert request.ByteSize() > 8 * MiB
    async with PeakMemory(server) as memory:
        async with stub(server.grpc_target) as client:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await getattr(client, method)(request, timeout=120)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
    assert f"a {method} message is at most" in (refused.value.details() or "")
    assert memory.growth < 64 * MiB, f"grew by {memory.growth / MiB:.0f} MiB"
