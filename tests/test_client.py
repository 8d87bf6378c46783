"""ffn_client against a real ffn-serve process, plus its codecs and retry policy on local fakes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from ffn_client import (
    AsyncClient,
    BadRequest,
    Client,
    FFNError,
    ModelNotFound,
    Overloaded,
    ProtocolError,
    TransportError,
    Unauthorized,
)
from ffn_client import encodings as enc
from ffn_client.errors import (
    DeadlineExceeded,
    NotAcceptable,
    OutOfMemory,
    PayloadTooLarge,
    ServerError,
    Unavailable,
    UnsupportedMediaType,
    error_from_response,
    parse_retry_after,
)
from ffn_client.stub_server import StubAnswer, StubRequest, StubServer, echo
from ffn_testing import free_port, start_server
from tests.reference import assert_close, demo_reference

REPO = Path(__file__).resolve().parents[1]
D_MODEL = 512
# Largest error allowed, relative to the largest output: float32 math, then the answer's rounding.
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
COMBINATIONS = [(e, d) for e in enc.ENCODINGS for d in enc.SUPPORTED_DTYPES[e]]


@pytest.fixture(scope="module")
def client(demo_server):
    with Client(demo_server.url, max_retries=0) as c:
        yield c


# -- against the real server ------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(7, D_MODEL), (2, 3, D_MODEL)], ids=["2d", "3d"])
@pytest.mark.parametrize(("encoding", "dtype"), COMBINATIONS, ids=[f"{e}-{d}" for e, d in COMBINATIONS])
def test_transform_matches_numpy(client, encoding, dtype, shape):
    # Built transposed: a non-contiguous array must travel as well as a contiguous one.
    x = np.random.default_rng(len(shape)).standard_normal(shape[::-1]).astype(np.float32).T
    y = client.transform("demo", x, encoding=encoding, dtype=dtype)
    assert y.dtype == (np.float16 if dtype == "float16" else np.float32)
    assert_close(y, demo_reference(enc.as_wire_values(x, dtype)), TOLERANCE[dtype])


def test_float16_array_goes_as_float16_by_default(client):
    x = np.random.default_rng(1).standard_normal((3, D_MODEL)).astype(np.float16)
    y = client.transform("demo", x)
    assert y.dtype == np.float16
    assert_close(y, demo_reference(x), TOLERANCE["float16"])


async def test_async_client_concurrent_requests(demo_server):
    rng = np.random.default_rng(2)
    inputs = [rng.standard_normal((int(n), D_MODEL)).astype(np.float32) for n in rng.integers(1, 40, 8)]
    encodings = ["binary", "json", "npy", "v2-binary"] * 2
    async with AsyncClient(demo_server.url) as client:
        assert await client.ready() and await client.live()
        outputs = await asyncio.gather(
            *(client.transform("demo", x, encoding=e) for x, e in zip(inputs, encodings, strict=True))
        )
        with pytest.raises(ModelNotFound):
            await client.transform("no-such-model", inputs[0])
    for x, y in zip(inputs, outputs, strict=True):
        assert_close(y, demo_reference(x), TOLERANCE["float32"])


def test_models_and_metadata(client):
    assert client.ready() and client.live()
    (demo,) = [m for m in client.models() if m["name"] == "demo"]
    assert (demo["d_model"], demo["d_ff"], demo["activation"], demo["gated"]) == (512, 2048, "relu", False)
    meta = client.metadata("demo")
    assert meta["inputs"][0]["name"] == "input" and meta["inputs"][0]["shape"][-1] == D_MODEL
    assert meta["outputs"][0]["name"] == "output"


@pytest.mark.parametrize("encoding", enc.ENCODINGS)
def test_unknown_model_is_model_not_found(client, encoding):
    with pytest.raises(ModelNotFound) as raised:
        client.transform("no-such-model", np.zeros((2, D_MODEL), np.float32), encoding=encoding)
    assert raised.value.status == 404
    assert "no-such-model" in raised.value.message  # the server's own words
    assert raised.value.error_type and raised.value.error_type != "ModelNotFound"


@pytest.mark.parametrize("encoding", enc.ENCODINGS)
def test_wrong_d_model_is_bad_request(client, encoding):
    with pytest.raises(BadRequest) as raised:
        client.transform("demo", np.zeros((2, D_MODEL + 1), np.float32), encoding=encoding)
    assert raised.value.status == 400
    assert str(D_MODEL) in raised.value.message and str(D_MODEL + 1) in raised.value.message


def test_metadata_of_unknown_model(client):
    with pytest.raises(ModelNotFound):
        client.metadata("no-such-model")


@pytest.mark.server
def test_api_key_against_a_server_that_requires_one():
    with start_server(env={"FFN_API_KEY": "s3cret", "FFN_LOG_LEVEL": "warning"}) as secured:
        with Client(secured.url, max_retries=0) as anonymous:
            assert anonymous.ready()  # health needs no key
            with pytest.raises(Unauthorized) as raised:
                anonymous.transform("demo", np.ones((1, D_MODEL)))
            assert raised.value.status == 401 and raised.value.message
        with Client(secured.url, api_key="s3cret") as client:
            assert client.transform("demo", np.ones((1, D_MODEL))).shape == (1, D_MODEL)
            assert [m["name"] for m in client.models()] == ["demo"]


def test_unsupported_encoding_dtype_fails_before_sending():
    with Client("http://127.0.0.1:9", transport=httpx.MockTransport(lambda r: pytest.fail("sent"))) as client:
        for encoding, dtype in [("json", "float16"), ("npy", "bfloat16"), ("binary", "float64"), ("xml", None)]:
            with pytest.raises(ValueError):
                client.transform("demo", np.zeros((1, 4)), encoding=encoding, dtype=dtype)


def test_no_server_is_transport_error():
    with Client(f"http://127.0.0.1:{free_port()}", timeout=5) as client:
        assert not client.ready()
        with pytest.raises(TransportError):
            client.transform("demo", np.zeros((1, D_MODEL)))


# -- retries on 429, against a scripted local server ---------------------------------------------


def overloaded_then_echo(failures: int, retry_after: str | None):
    """A responder answering 429 `failures` times, then echoing; and the list of requests it saw."""
    seen: list[StubRequest] = []

    def respond(request: StubRequest) -> StubAnswer:
        seen.append(request)
        if len(seen) <= failures:
            headers = {"content-type": "application/json"}
            if retry_after is not None:
                headers["retry-after"] = retry_after
            body = b'{"error": "queue full: 70000 rows waiting", "error_type": "overloaded"}'
            return StubAnswer(429, headers, body)
        return echo(request)

    return respond, seen


def test_retries_after_429_honouring_retry_after():
    respond, seen = overloaded_then_echo(failures=2, retry_after="2")
    x = np.arange(2 * 8, dtype=np.float32).reshape(2, 8)
    with StubServer(respond).in_thread() as stub, Client(stub.url, max_retries=3) as client:
        sleeps: list[float] = []
        client._sleep = sleeps.append
        y = client.transform("demo", x)
    assert len(seen) == 3  # two 429s, then the answer
    assert sleeps == [2.0, 2.0]  # each wait is the server's Retry-After
    np.testing.assert_array_equal(y, x)  # the stub echoes


def test_gives_up_after_max_retries():
    respond, seen = overloaded_then_echo(failures=5, retry_after="2")
    with StubServer(respond).in_thread() as stub, Client(stub.url, max_retries=1) as client:
        sleeps: list[float] = []
        client._sleep = sleeps.append
        with pytest.raises(Overloaded) as raised:
            client.transform("demo", np.zeros((1, 8)))
    assert len(seen) == 2 and sleeps == [2.0]
    assert raised.value.retry_after == 2.0
    assert raised.value.message == "queue full: 70000 rows waiting"


def test_retry_wait_is_capped_and_backs_off_without_retry_after():
    respond, seen = overloaded_then_echo(failures=1, retry_after="120")
    with StubServer(respond).in_thread() as stub:
        with Client(stub.url, max_retries=2, max_retry_wait=0.5) as client:
            sleeps: list[float] = []
            client._sleep = sleeps.append
            client.transform("demo", np.zeros((1, 8)))
        assert sleeps == [0.5]
        stub.respond, seen = overloaded_then_echo(failures=2, retry_after=None)
        with Client(stub.url, max_retries=2, retry_backoff=0.1) as client:
            sleeps = []
            client._sleep = sleeps.append
            client.transform("demo", np.zeros((1, 8)))
        assert sleeps == [0.1, 0.2] and len(seen) == 3


async def test_async_client_retries_after_429():
    respond, seen = overloaded_then_echo(failures=2, retry_after="1.5")
    sleeps: list[float] = []

    async def record(seconds: float) -> None:
        sleeps.append(seconds)

    with StubServer(respond).in_thread() as stub:
        async with AsyncClient(stub.url, max_retries=3) as client:
            client._sleep = record
            y = await client.transform("demo", np.ones((3, 8), np.float32), encoding="npy")
    assert len(seen) == 3 and sleeps == [1.5, 1.5]
    np.testing.assert_array_equal(y, np.ones((3, 8)))


# -- errors and request details on mock transports ---------------------------------------------


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (400, BadRequest),
        (401, Unauthorized),
        (404, ModelNotFound),
        (406, NotAcceptable),
        (413, PayloadTooLarge),
        (415, UnsupportedMediaType),
        (429, Overloaded),
        (500, ServerError),
        (502, ServerError),
        (503, Unavailable),
        (504, DeadlineExceeded),
        (507, OutOfMemory),
        (418, FFNError),
    ],
)
def test_error_classes_by_status(status, cls):
    body = json.dumps({"error": f"went wrong {status}", "error_type": "kind"}).encode()
    error = error_from_response(status, httpx.Headers({"Retry-After": "3"}), body)
    assert type(error) is cls
    assert (error.status, error.error_type, error.message, error.retry_after) == (
        status,
        "kind",
        f"went wrong {status}",
        3.0,
    )
    assert isinstance(error, FFNError) and f"went wrong {status}" in str(error)


def test_error_without_json_body_keeps_the_text():
    error = error_from_response(502, httpx.Headers(), b"Bad Gateway from the proxy")
    assert isinstance(error, ServerError) and error.message == "Bad Gateway from the proxy"
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0 and parse_retry_after("soon") is None


def test_api_key_and_deadline_headers_are_sent():
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.headers.get("authorization") != "Bearer s3cret":
            return httpx.Response(401, json={"error": "missing or wrong API key", "error_type": "unauthorized"})
        return httpx.Response(
            200,
            content=request.content,
            headers={"content-type": "application/octet-stream", "x-shape": "1,4", "x-dtype": "float32"},
        )

    with Client("http://ffn", api_key="s3cret", transport=httpx.MockTransport(handler)) as client:
        client.transform("demo", np.ones((1, 4)), timeout_ms=250)
    assert seen[0].headers["x-timeout-ms"] == "250"
    with Client("http://ffn", transport=httpx.MockTransport(handler)) as client:
        with pytest.raises(Unauthorized, match="wrong API key"):
            client.transform("demo", np.ones((1, 4)))


def test_v2_deadline_is_the_timeout_parameter_in_microseconds():
    for encoding in ("v2-json", "v2-binary"):
        request = enc.encode_request("m", np.ones((1, 4)), encoding, timeout_ms=250)
        split = int(request.headers.get("Inference-Header-Content-Length", len(request.body)))
        assert json.loads(request.body[:split])["parameters"] == {"timeout": 250_000}
        assert "X-Timeout-Ms" not in request.headers


def test_deadline_reaches_the_server(client):
    """A generous deadline is accepted on every route (the server refuses malformed ones with 400)."""
    for encoding in enc.ENCODINGS:
        y = client.transform("demo", np.ones((2, D_MODEL)), encoding=encoding, timeout_ms=30_000)
        assert y.shape == (2, D_MODEL)
        with pytest.raises(BadRequest, match="timeout"):
            client.transform("demo", np.ones((2, D_MODEL)), encoding=encoding, timeout_ms=-5)


def test_answer_of_the_wrong_shape_is_protocol_error():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200,
            content=b"\0" * 8,
            headers={"content-type": "application/octet-stream", "x-shape": "1,2", "x-dtype": "float32"},
        )

    with Client("http://ffn", transport=httpx.MockTransport(handler)) as client, pytest.raises(ProtocolError):
        client.transform("demo", np.ones((1, 4)))


# -- codecs ---------------------------------------------------------------------------------------


def test_bfloat16_matches_torch_round_to_nearest_even():
    import torch

    special = [1.0, 1.00390625, 1.01171875, -2.5, 3.0e38, 3.4e38, 1e-40, 0.0, -0.0, float("inf"), float("-inf")]
    x = np.concatenate(
        [np.array(special, np.float32), np.random.default_rng(3).standard_normal(10_000).astype(np.float32)]
    )
    ours = enc.float32_to_bf16(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(enc.bf16_to_float32(ours), torch.from_numpy(x).to(torch.bfloat16).float().numpy())
    nan_bits = enc.float32_to_bf16(np.array([np.nan, -np.nan], np.float32))
    assert np.isnan(enc.bf16_to_float32(nan_bits)).all()


@pytest.mark.parametrize("dtype", enc.DTYPES)
def test_raw_bytes_round_trip(dtype):
    x = np.random.default_rng(4).standard_normal((2, 3, 5)).astype(np.float32)
    raw = enc.to_bytes(x, dtype)
    assert len(raw) == x.size * (4 if dtype == "float32" else 2)
    np.testing.assert_array_equal(enc.from_bytes(raw, x.shape, dtype), enc.as_wire_values(x, dtype))
    with pytest.raises(ProtocolError):
        enc.from_bytes(raw[:-1], x.shape, dtype)


def test_v2_binary_framing():
    x = np.arange(12, dtype=np.float32).reshape(2, 2, 3)
    request = enc.encode_request("m", x, "v2-binary", "float16")
    split = int(request.headers["Inference-Header-Content-Length"])
    header = json.loads(request.body[:split])
    assert request.path == "/v2/models/m/infer"
    assert header["inputs"] == [
        {"name": "input", "shape": [4, 3], "datatype": "FP16", "parameters": {"binary_data_size": 24}}
    ]
    assert header["outputs"] == [{"name": "output", "parameters": {"binary_data": True}}]
    assert request.body[split:] == x.astype("<f2").tobytes()

    # An answer with two binary outputs: ours is the second, so its bytes start after the first's.
    answer = json.dumps(
        {
            "outputs": [
                {"name": "other", "datatype": "FP32", "shape": [1], "parameters": {"binary_data_size": 4}},
                {"name": "output", "datatype": "FP16", "shape": [4, 3], "parameters": {"binary_data_size": 24}},
            ]
        }
    ).encode()
    body = answer + b"\0\0\0\0" + (x * 2).astype("<f2").tobytes()
    y = enc.decode_response(request, httpx.Headers({"Inference-Header-Content-Length": str(len(answer))}), body)
    assert y.shape == x.shape and y.dtype == np.float16
    np.testing.assert_array_equal(y, x * 2)


def test_v2_json_answer_decodes_flat_data():
    x = np.ones((2, 3), np.float32)
    request = enc.encode_request("m", x, "v2-json", "bfloat16")
    assert json.loads(request.body)["inputs"][0]["datatype"] == "BF16"
    answer = {"outputs": [{"name": "output", "datatype": "BF16", "shape": [2, 3], "data": [0.5] * 6}]}
    y = enc.decode_response(request, httpx.Headers(), json.dumps(answer).encode())
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, np.full((2, 3), 0.5))


def test_importing_ffn_client_does_not_import_the_server_stack():
    code = (
        "import sys, ffn_client, ffn_client.loadtest, ffn_client.encodings, ffn_client.http1, ffn_testing;"
        "print(sorted(m for m in ('torch', 'fastapi', 'app', 'ffn_core', 'matplotlib', 'uvicorn') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


def test_a_proxys_html_error_page_is_reduced_to_its_title():
    page = b"<html>\r\n<head><title>504 Gateway Time-out</title></head>\r\n<body><center><h1>504</h1></center></body></html>"
    error = error_from_response(504, {}, page)
    assert str(error) == "HTTP 504 DeadlineExceeded: 504 Gateway Time-out (an HTML page, from a proxy?)"


def test_tls_options_become_one_context_as_httpx_reads_verify_and_cert(tmp_path) -> None:
    import ssl

    import trustme

    from ffn_client.tls import client_context

    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    leaf = ca.issue_cert("client")
    leaf.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "both.pem"))
    leaf.cert_chain_pems[0].write_to_path(str(tmp_path / "client.pem"))
    leaf.private_key_pem.write_to_path(str(tmp_path / "client.key"))
    assert client_context(True) is True and client_context(False) is False  # httpx's own, untouched
    context = client_context(tmp_path / "ca.pem")
    assert isinstance(context, ssl.SSLContext) and context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert context.minimum_version >= ssl.TLSVersion.TLSv1_2
    for cert in (tmp_path / "both.pem", (tmp_path / "client.pem", tmp_path / "client.key")):
        assert isinstance(client_context(str(tmp_path / "ca.pem"), cert), ssl.SSLContext)
    with pytest.raises(ssl.SSLError):  # a certificate without its key is refused here, not at the first request
        client_context(tmp_path / "ca.pem", tmp_path / "client.pem")
    with pytest.raises(ValueError, match="verification on"):
        client_context(False, tmp_path / "both.pem")


def test_a_float16_array_in_json_is_refused_before_sending_unless_float32_is_asked_for() -> None:
    # Issue 41: docs/client.md says so, and the array went out as float32 without a word.
    from ffn_client.encodings import encode_request

    x = np.ones((1, 512), dtype=np.float16)
    with pytest.raises(ValueError, match="float16"):
        encode_request("demo", x, "json")
    sent = encode_request("demo", x, "json", dtype="float32")
    assert sent.dtype == "float32" and json.loads(sent.body)["inputs"] == [[1.0] * 512]
    assert encode_request("demo", x, "binary").dtype == "float16"  # an encoding that carries it keeps it
