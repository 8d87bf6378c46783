"""Compressed bodies against a real ffn-serve: gzip and deflate both ways, and decompression bombs.

- tritonclient.http (sync and aio) with request and response compression in both algorithms,
  JSON and binary tensors: answers equal to the float64 numpy FFN (tests/reference.py).
- Every tensor route reads a gzip or deflate body (deflate as zlib, and as a raw stream) and
  answers compressed when Accept-Encoding asks: the bytes on the wire checked as gzip or zlib.
- A bomb (1 KiB-ish per MiB of zeros: 1 GiB in about 1 MiB) is refused 413 once its inflated
  size passes max_body_bytes, on every route, with the server's VmRSS and VmHWM (its peak) flat;
  corrupt, truncated or trailing data is a 400, another coding a 415.
- The inflated bytes count against the held-bytes budget as they are inflated (in-process).
- gRPC: tritonclient.grpc's compressed requests answered right, and a gzip-compressed ModelInfer
  whose message inflates past max_body_bytes (grpc.max_receive_message_length) refused
  RESOURCE_EXHAUSTED by grpc core itself, with RSS flat.
"""

from __future__ import annotations

import asyncio
import gzip
import struct
import zlib
from collections.abc import Iterator
from functools import cache

import grpc
import numpy as np
import orjson
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton
import tritonclient.http.aio as triton_aio
from tritonclient.grpc import service_pb2 as pb

from app.config.settings import Settings
from ffn_client.http1 import Response
from ffn_testing import ServerProcess, http_request, raw_request, start_server
from tests.in_process import InProcessApp
from tests.reference import assert_close, demo_reference
from tests.test_request_budgets import held_when_queued

D = 512
LIMIT = 4 << 20  # max_body_bytes of the server below
MIB = 1 << 20
RSS_GROWTH = 48 * MIB  # what a refused bomb may cost the server at most (the limit's 4 MiB, and slack)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    env = {"FFN_MAX_BODY_BYTES": str(LIMIT), "FFN_WARMUP": "0", "FFN_LOG_LEVEL": "warning"}
    with start_server(env=env) as srv:
        yield srv


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, D)).astype(np.float32)


def memory(server: ServerProcess) -> dict[str, int]:
    """The server's VmRSS (now) and VmHWM (its peak so far), in bytes, from /proc/<pid>/status."""
    found = {}
    with open(f"/proc/{server.proc.pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0]) * 1024
    return found


# ----- tritonclient, both algorithms both ways ---------------------------------------------------


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("response", ["gzip", "deflate"])
@pytest.mark.parametrize("request_", ["gzip", "deflate"])
def test_tritonclient_compresses_both_ways(server: ServerProcess, request_: str, response: str, binary: bool) -> None:
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        x = rows(5, seed=len(request_) + len(response))
        tensor = triton.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=binary)
        output = triton.InferRequestedOutput("output", binary_data=binary)
        result = client.infer(
            "demo",
            [tensor],
            outputs=[output],
            request_compression_algorithm=request_,
            response_compression_algorithm=response,
        )
        assert_close(result.as_numpy("output"), demo_reference(x))
    finally:
        client.close()


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
async def test_tritonclient_aio_compresses_both_ways(server: ServerProcess, algorithm: str) -> None:
    client = triton_aio.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        x = rows(3, seed=7)
        tensor = triton_aio.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=True)
        result = await client.infer(
            "demo", [tensor], request_compression_algorithm=algorithm, response_compression_algorithm=algorithm
        )
        assert_close(result.as_numpy("output"), demo_reference(x))
    finally:
        await client.close()


# ----- every tensor route, the bytes on the wire -------------------------------------------------


def zlib_stream(data: bytes) -> bytes:
    return zlib.compress(data)


def raw_deflate(data: bytes) -> bytes:
    compressor = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
    return compressor.compress(data) + compressor.flush()


CODINGS = {
    "gzip": ("gzip", gzip.compress),
    "deflate": ("deflate", zlib_stream),
    "raw deflate": ("deflate", raw_deflate),
}
X = rows(4, seed=3)
ROUTES = {
    "native raw": (
        "/v1/models/demo/transform",
        X.tobytes(),
        {"Content-Type": "application/octet-stream", "X-Shape": f"4,{D}", "Accept": "application/octet-stream"},
        lambda body, headers: np.frombuffer(body, dtype="<f4").reshape(4, D),
    ),
    "native json": (
        "/v1/models/demo/transform",
        orjson.dumps({"inputs": X.tolist()}),
        {"Content-Type": "application/json"},
        lambda body, headers: np.asarray(orjson.loads(body)["outputs"]),
    ),
    "v2 binary": (
        "/v2/models/demo/infer",
        None,  # built below: a JSON header and the tensor's bytes
        {"Content-Type": "application/octet-stream"},
        lambda body, headers: np.frombuffer(
            body[int(headers["inference-header-content-length"]) :], dtype="<f4"
        ).reshape(4, D),
    ),
    "kserve v1": (
        "/v1/models/demo:predict",
        orjson.dumps({"instances": X.tolist()}),
        {"Content-Type": "application/json"},
        lambda body, headers: np.asarray(orjson.loads(body)["predictions"]),
    ),
}
V2_HEADER = orjson.dumps(
    {
        "inputs": [
            {"name": "input", "shape": [4, D], "datatype": "FP32", "parameters": {"binary_data_size": X.nbytes}}
        ],
        "outputs": [{"name": "output", "parameters": {"binary_data": True}}],
    }
)


def route(name: str) -> tuple[str, bytes, dict[str, str]]:
    path, body, headers, _ = ROUTES[name]
    if body is None:
        body = V2_HEADER + X.tobytes()
        headers = {**headers, "Inference-Header-Content-Length": str(len(V2_HEADER))}
    return path, body, headers


async def post(server: ServerProcess, path: str, headers: dict[str, str], body: bytes) -> Response:
    return await raw_request(server.port, http_request("POST", path, headers, body, close=False), timeout=60)


@pytest.mark.parametrize("coding", list(CODINGS))
@pytest.mark.parametrize("name", list(ROUTES))
async def test_each_route_reads_a_compressed_body(server: ServerProcess, name: str, coding: str) -> None:
    path, body, headers = route(name)
    header, compress = CODINGS[coding]
    r = await post(server, path, {**headers, "Content-Encoding": header}, compress(body))
    assert r.status == 200, r.body[:300]
    assert "content-encoding" not in r.headers  # not asked for
    assert_close(ROUTES[name][3](r.body, r.headers), demo_reference(X))


@pytest.mark.parametrize(("accept", "coding"), [("gzip", "gzip"), ("deflate", "deflate"), ("br, gzip;q=0.5", "gzip")])
@pytest.mark.parametrize("name", list(ROUTES))
async def test_each_route_answers_compressed_when_asked(
    server: ServerProcess, name: str, accept: str, coding: str
) -> None:
    path, body, headers = route(name)
    r = await post(server, path, {**headers, "Accept-Encoding": accept}, body)
    assert r.status == 200, r.body[:300]
    assert (r.headers["content-encoding"], r.headers["vary"]) == (coding, "Accept-Encoding")
    if coding == "gzip":
        assert r.body[:2] == b"\x1f\x8b"
        inflated = gzip.decompress(r.body)
    else:
        inflated = zlib.decompress(r.body)  # a zlib stream, as RFC 9110's deflate is
    assert int(r.headers["content-length"]) == len(r.body)
    assert_close(ROUTES[name][3](inflated, r.headers), demo_reference(X))


async def test_no_accept_encoding_or_identity_answers_uncompressed(server: ServerProcess) -> None:
    path, body, headers = route("native raw")
    for accept in ({}, {"Accept-Encoding": "identity"}, {"Accept-Encoding": "gzip;q=0, deflate;q=0"}):
        r = await post(server, path, {**headers, **accept}, body)
        assert r.status == 200 and "content-encoding" not in r.headers
        assert_close(np.frombuffer(r.body, dtype="<f4").reshape(4, D), demo_reference(X))


# ----- bombs and broken streams ------------------------------------------------------------------


@cache
def gzip_of_zeros(mib: int) -> bytes:
    """A valid gzip member of `mib` MiB of zeros, about 1 KiB per MiB, built without compressing it all.

    After a full flush the compressor starts afresh, so each further MiB of zeros compresses to
    the same bytes: one block repeated, then the end block and the trailer (CRC-32, size).
    """
    zeros = bytes(MIB)
    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    first = compressor.compress(zeros) + compressor.flush(zlib.Z_FULL_FLUSH)
    again = compressor.compress(zeros) + compressor.flush(zlib.Z_FULL_FLUSH)
    end = compressor.flush(zlib.Z_FINISH)[:-8]  # the final empty block, without this compressor's trailer
    crc = 0
    for _ in range(mib):
        crc = zlib.crc32(zeros, crc)
    return first + again * (mib - 1) + end + struct.pack("<II", crc, (mib * MIB) & 0xFFFFFFFF)


def test_the_bomb_is_what_it_says() -> None:
    assert gzip.decompress(gzip_of_zeros(6)) == bytes(6 * MIB)
    assert len(gzip_of_zeros(1024)) < 2 * MIB  # 1 GiB of zeros


@pytest.mark.parametrize("name", list(ROUTES))
async def test_a_decompression_bomb_is_413_with_memory_flat(server: ServerProcess, name: str) -> None:
    path, _, headers = route(name)
    bomb = gzip_of_zeros(1024)  # 1 GiB inflated, 256 times the limit
    before = memory(server)
    r = await post(server, path, {**headers, "Content-Encoding": "gzip"}, bomb)
    assert r.status == 413, r.body[:300]
    answer = orjson.loads(r.body)
    assert answer["error_type"] == "payload_too_large"
    assert f"inflates past the limit of {LIMIT} bytes (max_body_bytes)" in answer["error"]
    after = memory(server)
    assert after["VmRSS"] - before["VmRSS"] < RSS_GROWTH, (before, after)
    assert after["VmHWM"] - before["VmHWM"] < RSS_GROWTH, (before, after)  # the peak, not only what is left
    # And the server goes on answering.
    path, body, headers = route(name)
    assert (await post(server, path, headers, body)).status == 200


async def test_a_bomb_sent_chunked_is_refused_the_same(server: ServerProcess) -> None:
    bomb = gzip_of_zeros(256)
    chunked = b"".join(
        b"%x\r\n%s\r\n" % (len(bomb[i : i + 65536]), bomb[i : i + 65536]) for i in range(0, len(bomb), 65536)
    )
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip", "Transfer-Encoding": "chunked"}
    r = await post(server, "/v2/models/demo/infer", headers, chunked + b"0\r\n\r\n")
    assert r.status == 413 and orjson.loads(r.body)["error_type"] == "payload_too_large"


def _body() -> bytes:
    return orjson.dumps({"inputs": X.tolist()})


BROKEN = {
    "not gzip": ("gzip", b"this is not gzip at all", 400, "not valid gzip data"),
    "truncated gzip": ("gzip", gzip.compress(_body())[:-40], 400, "truncated"),
    "data after the stream": ("gzip", gzip.compress(_body()) + b"more", 400, "after the end of its gzip stream"),
    "empty gzip": ("gzip", b"", 400, "truncated"),
    "not deflate": ("deflate", b"\x78\x9c garbage that is not deflate", 400, "not valid deflate data"),
    "brotli": ("br", b"\x0b\x02\x80", 415, "send the body as gzip, deflate or uncompressed"),
    "two codings": ("gzip, gzip", gzip.compress(gzip.compress(_body())), 415, "not supported"),
}


@pytest.mark.parametrize("case", list(BROKEN))
async def test_a_broken_or_unknown_coding_is_a_clear_4xx(server: ServerProcess, case: str) -> None:
    coding, body, status, message = BROKEN[case]
    headers = {"Content-Type": "application/json", "Content-Encoding": coding}
    r = await post(server, "/v1/models/demo/transform", headers, body)
    assert r.status == status, r.body[:300]
    assert message in orjson.loads(r.body)["error"]


# ----- the held-bytes budget counts inflated bytes ------------------------------------------------


async def test_inflated_bytes_count_against_the_held_budget(start_app, monkeypatch: pytest.MonkeyPatch) -> None:
    running: InProcessApp = await start_app(Settings(warmup=False, max_body_bytes=600_000, max_held_bytes=1_000_000))
    gate = asyncio.Event()
    seen = held_when_queued(monkeypatch, running, gate)
    raw = {"content-type": "application/octet-stream", "x-shape": f"256,{D}"}
    big = np.tile(rows(1), (256, 1))  # 512 KiB raw: held while it waits at the gate
    first = asyncio.ensure_future(running.client.post("/v1/models/demo/transform", content=big.tobytes(), headers=raw))
    async with asyncio.timeout(30):
        while not seen:
            await asyncio.sleep(0.01)
    # 512 KiB of zeros in about 1 KiB: small on the wire, refused once inflated past what is left.
    squeezed = gzip.compress(bytes(big.nbytes))
    assert len(squeezed) < 4096
    r = await running.client.post(
        "/v1/models/demo/transform", content=squeezed, headers={**raw, "content-encoding": "gzip"}
    )
    assert r.status_code == 429 and r.json()["error_type"] == "too_many_bytes_held"
    gate.set()
    assert (await first).status_code == 200
    assert running.app.state.service.held.held == 0
    r = await running.client.post(
        "/v1/models/demo/transform", content=gzip.compress(big.tobytes()), headers={**raw, "content-encoding": "gzip"}
    )
    assert r.status_code == 200  # alone, it fits
    assert_close(np.asarray(r.json()["outputs"]), demo_reference(big))
    assert seen[-1] == big.nbytes  # held: the inflated body (the tensor is a view of it)
    assert running.app.state.service.held.held == 0


# ----- gRPC ------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_tritonclient_grpc_compressed_requests_are_answered(server: ServerProcess, algorithm: str) -> None:
    client = triton_grpc.InferenceServerClient(server.grpc_target)
    try:
        x = rows(6, seed=11)
        tensor = triton_grpc.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer("demo", [tensor], compression_algorithm=algorithm)
        assert_close(result.as_numpy("output"), demo_reference(x))
    finally:
        client.close()


def test_a_grpc_message_inflating_past_the_limit_is_resource_exhausted_with_memory_flat(
    server: ServerProcess,
) -> None:
    """grpc core checks max_receive_message_length (= max_body_bytes) on the inflated size too."""
    size = 64 * MIB  # 16 times the limit, about 64 KiB compressed
    request = pb.ModelInferRequest(model_name="demo")
    tensor = request.inputs.add(name="input", datatype="FP32")
    tensor.shape.extend([size // (4 * D), D])
    request.raw_input_contents.append(bytes(size))
    message = request.SerializeToString()
    del request
    before = memory(server)
    options = [("grpc.max_send_message_length", -1)]
    with grpc.insecure_channel(server.grpc_target, compression=grpc.Compression.Gzip, options=options) as channel:
        infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=lambda data: data,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        for _ in range(2):
            with pytest.raises(grpc.RpcError) as info:
                infer(message, timeout=60)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "larger than max" in info.value.details()
    after = memory(server)
    assert after["VmRSS"] - before["VmRSS"] < RSS_GROWTH, (before, after)
    assert after["VmHWM"] - before["VmHWM"] < RSS_GROWTH, (before, after)
    # A compressed request within the limit still goes through.
    client = triton_grpc.InferenceServerClient(server.grpc_target)
    try:
        x = rows(2, seed=12)
        small = triton_grpc.InferInput("input", list(x.shape), "FP32")
        small.set_data_from_numpy(x)
        assert_close(client.infer("demo", [small], compression_algorithm="gzip").as_numpy("output"), demo_reference(x))
    finally:
        client.close()
