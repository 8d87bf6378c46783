"""Issue 28 class 6: JSON values outside the tensor no longer ride on the tensor's allowance, on a real server.

A V2 body's tensor is its input's `data` array, which alone may hold max_queue_rows × d_model
values; everything else (id, shape, parameters, outputs, any other member) may hold at most
MAX_OTHER_BYTES (64 KiB), as a gRPC request's fields besides its tensor data may, and is refused
413 before a byte of it is parsed. Parameters are scalars: an array or an object in any
parameters map is 400, over HTTP as gRPC's InferParameter cannot carry one. Before, a body with
6 M numbers in a parameter was parsed (+332 MiB) and answered 200, and a good request waited.

Memory is the server's resident size (VmRSS sampled every 20 ms, glibc's mmap threshold fixed so
that freed memory shows); good requests are checked against float64 numpy; nothing is timed
(bench/hostile.py's `parameters` scenario measures their wait).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import grpc
import httpx
import numpy as np
import orjson
import pytest
from tritonclient.grpc import service_pb2 as pb

from bench.hostile_clients import MEASURABLE_MALLOC, PeakMemory, flood_for
from ffn_testing import ServerProcess, http_request, raw_request, start_server
from tests.grpc_helpers import infer_request, output_of, stub, trailers
from tests.reference import assert_close, demo_reference
from tests.test_hostile import LAYOUTS

pytestmark = pytest.mark.server

D_MODEL = 512
V2 = "/v2/models/demo/infer"
MiB = 1 << 20
MILLIONS = 6_000_000  # the review's array: 6 M numbers, 24 MB of JSON
ROW = np.linspace(-1, 1, D_MODEL, dtype=np.float32).reshape(1, D_MODEL)
NUMBERS = b"[" + b",".join([b"1.5"] * MILLIONS) + b"]"


@pytest.fixture(scope="module", params=list(LAYOUTS))
def server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """Against both layouts: one process, and a front with the engine process (issue 40)."""
    with start_server(
        env={**MEASURABLE_MALLOC, "FFN_WARMUP": "0", "FFN_LOG_LEVEL": "warning", **LAYOUTS[request.param]}
    ) as srv:
        yield srv


@pytest.fixture(autouse=True)
async def still_serving(server: ServerProcess) -> AsyncIterator[None]:
    await good_v2_request(server)  # the allocator's caches at this size are not growth
    yield
    assert server.proc.poll() is None, f"server died; log:\n{server.logs()}"


async def good_v2_request(server: ServerProcess) -> None:
    """A valid V2 JSON request of 3 rows, answered as the float64 reference says."""
    x = np.linspace(-2, 2, 3 * D_MODEL, dtype=np.float32).reshape(3, D_MODEL)
    body = orjson.dumps(
        {"id": "good", "inputs": [{"name": "input", "shape": [3, D_MODEL], "datatype": "FP32", "data": x.tolist()}]}
    )
    r = await raw_request(server.port, http_request("POST", V2, {"Content-Type": "application/json"}, body))
    assert r.status == 200, r.body[:300]
    answer = r.json()
    assert answer["id"] == "good"
    assert_close(np.asarray(answer["outputs"][0]["data"]).reshape(3, D_MODEL), demo_reference(x))


def v2_body(*, tensor: bytes = b"", tail: bytes = b"", shape: bytes = b"[1, 512]", head: bytes = b"") -> bytes:
    """A V2 body of one row, with `tensor` inserted in the input's object and `tail` after the inputs."""
    data = b'"data": ' + orjson.dumps(ROW.reshape(-1).tolist())
    return (
        b"{"
        + head
        + b'"inputs": [{"name": "input", "shape": '
        + shape
        + b', "datatype": "FP32", '
        + tensor
        + data
        + b"}]"
        + tail
        + b"}"
    )


# Each a body the review's kind of array turns hostile: millions of values outside the input's data.
HOSTILE = {
    "request-parameters": v2_body(tail=b', "parameters": {"x": ' + NUMBERS + b"}"),
    "input-parameters": v2_body(tensor=b'"parameters": {"x": ' + NUMBERS + b"}, "),
    "output-parameters": v2_body(tail=b', "outputs": [{"name": "output", "parameters": {"x": ' + NUMBERS + b"}}]"),
    "shape": v2_body(shape=NUMBERS.replace(b"1.5", b"1")),
    "outputs": v2_body(tail=b', "outputs": ' + NUMBERS),
    "id": v2_body(head=b'"id": "' + b"i" * (24 * MiB) + b'", '),
    "other-member": v2_body(tail=b', "extra": ' + NUMBERS),
}


def post(body: bytes, headers: dict[str, str] | None = None) -> bytes:
    return http_request("POST", V2, {"Content-Type": "application/json", **(headers or {})}, body, close=False)


@pytest.mark.parametrize("body", HOSTILE.values(), ids=HOSTILE.keys())
async def test_millions_of_values_outside_the_data_are_413_before_parsing(server: ServerProcess, body: bytes) -> None:
    async with PeakMemory(server) as memory:
        r = await raw_request(server.port, post(body), timeout=120)
    assert r.status == 413, r.body[:300]
    assert r.json()["error_type"] == "payload_too_large"
    assert "more than 65536 bytes besides its tensor data" in r.json()["error"]
    # The body itself is held while it is read (24 MB); its parse would have cost 14x that.
    assert memory.growth < len(body) + 32 * MiB, f"grew {memory.growth / MiB:.0f} MiB for {len(body) / MiB:.0f} MiB"


async def test_the_binary_extensions_json_header_has_the_same_budget(server: ServerProcess) -> None:
    header = (
        b'{"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "parameters": '
        b'{"binary_data_size": 2048}}], "parameters": {"x": ' + NUMBERS + b"}}"
    )
    body = header + ROW.tobytes()
    headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))}
    async with PeakMemory(server) as memory:
        r = await raw_request(server.port, post(body, headers), timeout=120)
    assert r.status == 413 and "besides its tensor data" in r.json()["error"], r.body[:300]
    assert memory.growth < len(body) + 32 * MiB, f"grew {memory.growth / MiB:.0f} MiB"


async def test_an_array_named_data_in_a_parameter_does_not_pass_for_the_tensor(server: ServerProcess) -> None:
    # The tensor's allowance is the input's data alone: a second "data" array is refused unparsed.
    body = v2_body(tail=b', "parameters": {"data": ' + NUMBERS + b"}")
    async with PeakMemory(server) as memory:
        r = await raw_request(server.port, post(body), timeout=120)
    assert r.status == 400 and "2 arrays named 'data'" in r.json()["error"], r.body[:300]
    assert memory.growth < len(body) + 32 * MiB
    # With the input's data sent in binary, the one "data" array is the parameter's: refused as one.
    header = (
        b'{"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "parameters": '
        b'{"binary_data_size": 2048}}], "parameters": {"data": ' + NUMBERS + b"}}"
    )
    headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))}
    r = await raw_request(server.port, post(header + ROW.tobytes(), headers), timeout=120)
    assert r.status == 400, r.body[:300]
    assert r.json()["error"] == (
        "request parameter 'data' must be a boolean, a number or a string (parameters are scalars), got an array"
    )


SMALL = {
    "request": (v2_body(tail=b', "parameters": {"tags": [1, 2]}'), "request parameter 'tags'", "an array"),
    "input": (v2_body(tensor=b'"parameters": {"opts": {"a": 1}}, '), "input parameter 'opts'", "an object"),
    "output": (
        v2_body(tail=b', "outputs": [{"name": "output", "parameters": {"binary_data": [true]}}]'),
        "output parameter 'binary_data'",
        "an array",
    ),
}


@pytest.mark.parametrize(("body", "named", "got"), SMALL.values(), ids=SMALL.keys())
async def test_a_parameter_is_a_scalar_in_every_parameters_map(
    server: ServerProcess, body: bytes, named: str, got: str
) -> None:
    r = await raw_request(server.port, post(body))
    assert r.status == 400 and r.json()["error_type"] == "invalid_input", r.body[:300]
    assert r.json()["error"] == f"{named} must be a boolean, a number or a string (parameters are scalars), got {got}"


async def test_scalar_parameters_and_a_generous_envelope_are_served(server: ServerProcess) -> None:
    parameters = {f"tag{i}": (f"value {i}" if i % 3 else i if i % 2 else i % 4 == 0) for i in range(2000)}
    parameters["none"] = None
    body = v2_body(head=b'"id": "' + b"r" * 8000 + b'", ', tail=b', "parameters": ' + orjson.dumps(parameters))
    assert 32 * 1024 < len(body) - len(orjson.dumps(ROW.reshape(-1).tolist())) < 64 * 1024
    r = await raw_request(server.port, post(body))
    assert r.status == 200, r.body[:300]
    assert_close(np.asarray(r.json()["outputs"][0]["data"]).reshape(1, D_MODEL), demo_reference(ROW))


async def test_a_good_request_beside_a_flood_of_them_is_answered_right(server: ServerProcess) -> None:
    # The review: a good request waited 24.6 s behind one such body. Now each is refused on counts.
    bodies = list(HOSTILE.values())
    sent = 0

    async def one_hostile() -> None:
        nonlocal sent
        body = bodies[sent % len(bodies)]
        sent += 1
        r = await raw_request(server.port, post(body), timeout=120)
        assert r.status == 413, r.body[:300]

    async with PeakMemory(server) as memory:
        flood = asyncio.ensure_future(flood_for(6.0, 4, one_hostile))
        while not flood.done():
            await good_v2_request(server)
        await flood
    assert sent >= 4
    assert memory.growth < 4 * 2 * max(map(len, bodies)) + 64 * MiB, f"grew {memory.growth / MiB:.0f} MiB"


# ----- both doors: the same budget, the same refusal --------------------------------------------------


async def test_both_doors_refuse_a_huge_shape_or_id_as_too_large_and_a_long_shape_as_invalid(
    server: ServerProcess,
) -> None:
    async with stub(server.grpc_target) as client:
        for dims, request_id, code, error_type in [
            ([1] * 1_000_000 + [D_MODEL], "", grpc.StatusCode.RESOURCE_EXHAUSTED, "payload_too_large"),
            ([1, D_MODEL], "i" * (1 * MiB), grpc.StatusCode.RESOURCE_EXHAUSTED, "payload_too_large"),
            ([1] * 99 + [D_MODEL], "", grpc.StatusCode.INVALID_ARGUMENT, "invalid_input"),
        ]:
            request = infer_request(ROW, request_id=request_id)
            del request.inputs[0].shape[:]
            request.inputs[0].shape.extend(dims)
            with pytest.raises(grpc.aio.AioRpcError) as refusal:
                await client.ModelInfer(request, timeout=120)
            assert refusal.value.code() == code, refusal.value.details()
            assert trailers(refusal.value)["ffn-error-type"] == error_type
            body = v2_body(shape=orjson.dumps(dims), head=b'"id": "%s", ' % request_id.encode())
            r = await raw_request(server.port, post(body), timeout=120)
            assert r.status == (413 if error_type == "payload_too_large" else 400), r.body[:300]
            assert r.json()["error_type"] == error_type
            if error_type == "invalid_input":  # the same check, the same words
                assert r.json()["error"] == refusal.value.details()
        # A parameter with no value is gRPC's null: served on both doors, as JSON null is.
        request = infer_request(ROW)
        request.parameters["nothing"].CopyFrom(pb.InferParameter())
        assert_close(output_of(await client.ModelInfer(request, timeout=120)), demo_reference(ROW))
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        r = await http.post(V2, content=v2_body(tail=b', "parameters": {"nothing": null}'))
    assert r.status_code == 200, r.text
