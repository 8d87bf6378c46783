"""The native API in-process (httpx + ASGITransport, lifespan running): encodings, dtypes, errors."""

from __future__ import annotations

import io
import re
from collections.abc import AsyncIterator

import httpx
import numpy as np
import pytest
import pytest_asyncio

from app.config.settings import Settings
from ffn_testing import metric_value
from tests.in_process import serve_in_process
from tests.reference import bf16_round, demo_reference
from tests.wire import bf16_bytes, from_bf16_bytes, npy_bytes

D = 512
URL = "/v1/models/demo/transform"


# One app for the file, on the module's event loop: the tests only send requests (the metrics
# test counts what moved between two scrapes).
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with serve_in_process(Settings(max_batch_rows=256, max_body_bytes=4 * 1024 * 1024)) as app:
        yield app.client


def random_input(shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("shape", [(1, D), (7, D), (2, 5, D)])
async def test_json_in_json_out(client, shape):
    x = random_input(shape)
    r = await client.post(URL, json={"inputs": x.tolist()})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "demo" and body["shape"] == list(shape) and body["dtype"] == "float32"
    np.testing.assert_allclose(np.array(body["outputs"]), demo_reference(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("accept", ["application/json", "application/octet-stream", "application/x-npy"])
@pytest.mark.parametrize("content_type", ["application/json", "application/octet-stream", "application/x-npy"])
async def test_every_encoding_in_and_out_float32(client, content_type, accept):
    shape = (3, 4, D)
    x = random_input(shape, seed=1)
    headers = {"content-type": content_type, "accept": accept}
    if content_type == "application/json":
        content = httpx.Request("POST", "/", json={"inputs": x.tolist()}).read()
    elif content_type == "application/octet-stream":
        content = x.astype("<f4").tobytes()
        headers |= {"x-shape": "3,4,512", "x-dtype": "float32"}
    else:
        content = npy_bytes(x)
    r = await client.post(URL, content=content, headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith(accept)
    if accept == "application/json":
        y = np.array(r.json()["outputs"])
    elif accept == "application/octet-stream":
        assert r.headers["x-shape"] == "3,4,512" and r.headers["x-dtype"] == "float32"
        y = np.frombuffer(r.content, dtype="<f4").reshape(shape)
    else:
        y = np.load(io.BytesIO(r.content), allow_pickle=False)
        assert y.dtype == np.float32
    assert y.shape == shape
    np.testing.assert_allclose(y, demo_reference(x), rtol=1e-5, atol=1e-5)


async def test_float16_binary_in_and_out(client):
    x = random_input((5, D), seed=2).astype(np.float16)
    r = await client.post(
        URL,
        content=x.astype("<f2").tobytes(),
        headers={
            "content-type": "application/octet-stream",
            "x-shape": "5,512",
            "x-dtype": "float16",
            "accept": "application/octet-stream",
        },
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-dtype"] == "float16"
    y = np.frombuffer(r.content, dtype="<f2").reshape(5, D).astype(np.float64)
    # The model computes in float32 on the float16 input; only the answer is rounded to float16.
    np.testing.assert_allclose(y, demo_reference(x.astype(np.float64)), rtol=2e-3, atol=2e-3)


async def test_float16_npy_in_and_out(client):
    x = random_input((4, D), seed=3).astype(np.float16)
    r = await client.post(
        URL, content=npy_bytes(x), headers={"content-type": "application/x-npy", "accept": "application/x-npy"}
    )
    assert r.status_code == 200, r.text
    y = np.load(io.BytesIO(r.content))
    assert y.dtype == np.float16
    np.testing.assert_allclose(y.astype(np.float64), demo_reference(x), rtol=2e-3, atol=2e-3)


async def test_bfloat16_binary_in_and_out(client):
    x = random_input((6, D), seed=4)
    r = await client.post(
        URL,
        content=bf16_bytes(x),
        headers={
            "content-type": "application/octet-stream",
            "x-shape": "6,512",
            "x-dtype": "bfloat16",
            "accept": "application/octet-stream",
        },
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-dtype"] == "bfloat16"
    y = from_bf16_bytes(r.content, (6, D)).astype(np.float64)
    expected = demo_reference(bf16_round(x))
    np.testing.assert_allclose(y, expected, rtol=1e-2, atol=1e-2)


async def test_bfloat16_in_json_out(client):
    x = random_input((2, D), seed=5)
    r = await client.post(
        URL,
        content=bf16_bytes(x),
        headers={"content-type": "application/octet-stream", "x-shape": "2,512", "x-dtype": "bfloat16"},
    )
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(np.array(r.json()["outputs"]), demo_reference(bf16_round(x)), rtol=1e-5, atol=1e-5)


async def test_models_list(client):
    r = await client.get("/v1/models")
    assert r.status_code == 200
    assert r.content.endswith(b"}\n")  # a line of its own in a terminal
    (model,) = r.json()["models"]
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", model.pop("digest")), "its weights' digest (tests/test_digest.py)"
    assert model == {  # the fixture waited for readiness: the model says READY too
        "name": "demo",
        "version": 1,
        "d_model": 512,
        "d_ff": 2048,
        "activation": "relu",
        "gated": False,
        "variant": "relu",
        "bias": {"layer1": True, "layer2": True, "linear_v": None},
        "dropout": 0.0,
        "dtype": "float32",
        "device": "cpu",
        "format": "demo",
        "ready": True,
        "state": "READY",
        "reason": "",
    }


RAW = {"content-type": "application/octet-stream"}
ONE_ROW = np.zeros((1, D), dtype="<f4").tobytes()


@pytest.mark.parametrize(
    ("content", "headers", "status", "error_type", "needle"),
    [
        (b"{not json", {}, 400, "invalid_input", "malformed JSON"),
        (b'{"inputs": [[1.0, 2.0], [3.0]]}', {}, 400, "invalid_input", "rectangular"),
        (b'{"inputs": [[1.0, 2.0]]}', {}, 400, "invalid_input", "d_model=512"),
        (b'{"inputs": [1.0, 2.0]}', {}, 400, "invalid_input", "rank 1"),
        (b'{"inputs": [[NaN]]}', {}, 400, "invalid_input", "malformed JSON"),
        (b'{"inputs": [[Infinity]]}', {}, 400, "invalid_input", "malformed JSON"),
        (b'{"inputs": [["1.0"]]}', {}, 400, "invalid_input", "only numbers"),
        (b'{"inputs": [[1e39]]}', {}, 400, "invalid_input", "float32 range"),
        (b'{"inputs": []}', {}, 400, "invalid_input", "rank 1"),
        (b'{"input": [[1.0]]}', {}, 400, "invalid_input", '"inputs"'),
        (b"[1, 2]", {}, 400, "invalid_input", "object"),
        (ONE_ROW[:-4], RAW | {"x-shape": "1,512"}, 400, "invalid_input", "needs 2048 bytes"),
        (ONE_ROW, RAW | {"x-shape": "1000000,1000000"}, 400, "invalid_input", "last dimension"),
        (ONE_ROW, RAW | {"x-shape": "2000000,512"}, 400, "invalid_input", "needs 4096000000 bytes"),
        (ONE_ROW, RAW | {"x-shape": "1,512", "x-dtype": "float64"}, 400, "invalid_input", "X-Dtype"),
        (ONE_ROW, RAW, 400, "invalid_input", "X-Shape"),
        (np.full((1, D), np.nan, dtype="<f4").tobytes(), RAW | {"x-shape": "1,512"}, 400, "invalid_input", "NaN"),
        (b"x", {"content-type": "text/plain"}, 415, "unsupported_media_type", "text/plain"),
        (b"{}", {"accept": "text/html"}, 406, "not_acceptable", "text/html"),
        (b"\x93NUMPY garbage", {"content-type": "application/x-npy"}, 400, "invalid_input", ".npy"),
    ],
)
async def test_bad_requests(client, content, headers, status, error_type, needle):
    r = await client.post(URL, content=content, headers=headers)
    assert r.status_code == status, r.text
    body = r.json()
    assert body["error_type"] == error_type
    assert needle in body["error"]


async def test_unknown_model_is_404(client):
    r = await client.post("/v1/models/nope/transform", json={"inputs": [[0.0] * D]})
    assert r.status_code == 404
    assert r.json()["error_type"] == "model_not_found"


async def test_body_over_limit_is_413(client):
    big = np.zeros((2100, D), dtype="<f4").tobytes()  # > 4 MiB
    r = await client.post(URL, content=big, headers=RAW | {"x-shape": "2100,512"})
    assert r.status_code == 413
    assert r.json()["error_type"] == "payload_too_large"


async def test_bfloat16_cannot_be_answered_as_npy(client):
    r = await client.post(
        URL,
        content=bf16_bytes(np.zeros((1, D), np.float32)),
        headers=RAW | {"x-shape": "1,512", "x-dtype": "bfloat16", "accept": "application/x-npy"},
    )
    assert r.status_code == 406


async def test_metrics_count_outcomes_rows_and_latencies(client):
    """Three valid requests of 1, 3 and 5 rows, sent one after another (so each is its own batch),
    and two invalid ones: the counters, the histograms' counts and buckets move by exactly that."""
    before = (await client.get("/metrics")).text
    for rows in (1, 3, 5):
        r = await client.post(URL, json={"inputs": [[0.0] * D] * rows})
        assert r.status_code == 200, r.text
    for body in (b"{bad", b'{"inputs": [[1.0]]}'):
        assert (await client.post(URL, content=body)).status_code == 400
    after = (await client.get("/metrics")).text

    def moved(name: str, **labels: str) -> float:
        return metric_value(after, name, model="demo", **labels) - metric_value(before, name, model="demo", **labels)

    assert moved("ffn_requests_total", outcome="ok") == 3
    assert moved("ffn_requests_total", outcome="invalid_input") == 2  # refused before the queue
    assert moved("ffn_batch_rows_count") == 3 and moved("ffn_batch_rows_sum") == 9
    # Cumulative buckets: 1 row fits le=1, 3 rows le=4, 5 rows le=8.
    assert [moved("ffn_batch_rows_bucket", le=le) for le in ("1.0", "2.0", "4.0", "8.0", "+Inf")] == [1, 1, 2, 3, 3]
    for name in ("ffn_queue_seconds", "ffn_request_seconds", "ffn_compute_seconds"):  # one entry, one batch each
        assert moved(f"{name}_count") == 3, name
        assert moved(f"{name}_bucket", le="+Inf") == 3, name
    assert metric_value(after, "ffn_queue_rows", model="demo") == 0
