"""Wire dtype apart from compute dtype: a float32 client of a bfloat16 or float16 model sends and gets float32.

Every encoding of both protocols, through the in-process app, on the plain and the staged path.
The reference is the float64 FFN of the model's own (rounded) weights.
"""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator, Callable

import httpx
import numpy as np
import pytest
import pytest_asyncio
import torch

from app.config.settings import ModelSpec, Settings
from ffn_core import demo_ffn
from tests.in_process import serve_in_process
from tests.reference import numpy_ffn, numpy_weights
from tests.wire import npy_bytes, raw_headers

D = 512
ROWS = 3
TOLERANCE = {"bfloat16": 2e-2, "float16": 3e-3}

# The tests only send requests: each configuration's app (its start and warm-up, seconds in
# float16 on a CPU) serves all of them, on the module's event loop.
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(
    scope="module",
    loop_scope="module",
    params=[("bfloat16", "off"), ("bfloat16", "on"), ("float16", "off"), ("float16", "on")],
    ids=lambda p: f"{p[0]}-staging-{p[1]}",
)
async def served(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[httpx.AsyncClient, str, Callable[[np.ndarray], np.ndarray]]]:
    """(client, model dtype, reference of x) for the demo model computing in a half-precision dtype."""
    dtype, staging = request.param
    async with serve_in_process(Settings(models=[ModelSpec(name="demo", dtype=dtype)], staging=staging)) as app:
        weights = numpy_weights(demo_ffn().to(getattr(torch, dtype)))  # the rounded weights the model computes with
        yield app.client, dtype, lambda x: numpy_ffn(x, weights, "relu")


def x_in(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((ROWS, D)).astype(np.float32)


def split_binary_answer(content: bytes, header_length: int) -> tuple[dict, bytes]:
    return json.loads(content[:header_length]), content[header_length:]


async def test_native_json(served, close):
    client, dtype, reference = served
    x = x_in(1)
    r = await client.post("/v1/models/demo/transform", json={"inputs": x.tolist()})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["dtype"] == "float32"
    close(np.array(body["outputs"]), reference(x), rtol=TOLERANCE[dtype])


async def test_native_raw_float32(served, close):
    client, dtype, reference = served
    x = x_in(2)
    r = await client.post("/v1/models/demo/transform", content=x.tobytes(), headers=raw_headers(x.shape))
    assert r.status_code == 200, r.text
    assert r.headers["x-dtype"] == "float32" and len(r.content) == ROWS * D * 4
    close(np.frombuffer(r.content, "<f4").reshape(ROWS, D), reference(x), rtol=TOLERANCE[dtype])


async def test_native_npy_float32(served, close):
    client, dtype, reference = served
    x = x_in(3)
    r = await client.post(
        "/v1/models/demo/transform",
        content=npy_bytes(x),
        headers={"content-type": "application/x-npy", "accept": "application/x-npy"},
    )
    assert r.status_code == 200, r.text
    y = np.load(io.BytesIO(r.content))
    assert y.dtype == np.dtype("<f4") and y.shape == (ROWS, D)
    close(y, reference(x), rtol=TOLERANCE[dtype])


async def test_v2_json_fp32(served, close):
    client, dtype, reference = served
    x = x_in(4)
    r = await client.post(
        "/v2/models/demo/infer",
        json={"inputs": [{"name": "input", "shape": [ROWS, D], "datatype": "FP32", "data": x.ravel().tolist()}]},
    )
    assert r.status_code == 200, r.text
    (output,) = r.json()["outputs"]
    assert output["datatype"] == "FP32"
    close(np.array(output["data"]).reshape(ROWS, D), reference(x), rtol=TOLERANCE[dtype])


async def test_v2_binary_fp32(served, close):
    client, dtype, reference = served
    x = x_in(5)
    blob = x.tobytes()
    header = json.dumps(
        {
            "inputs": [
                {"name": "input", "shape": [ROWS, D], "datatype": "FP32", "parameters": {"binary_data_size": len(blob)}}
            ],
            "outputs": [{"name": "output", "parameters": {"binary_data": True}}],
        }
    ).encode()
    r = await client.post(
        "/v2/models/demo/infer",
        content=header + blob,
        headers={"content-type": "application/octet-stream", "inference-header-content-length": str(len(header))},
    )
    assert r.status_code == 200, r.text
    answer, raw = split_binary_answer(r.content, int(r.headers["inference-header-content-length"]))
    (output,) = answer["outputs"]
    assert output["datatype"] == "FP32" and output["parameters"]["binary_data_size"] == len(raw) == ROWS * D * 4
    close(np.frombuffer(raw, "<f4").reshape(ROWS, D), reference(x), rtol=TOLERANCE[dtype])


async def test_v2_metadata_names_the_compute_dtype(served):
    client, dtype, _ = served
    meta = (await client.get("/v2/models/demo")).json()
    assert meta["inputs"][0]["datatype"] == {"bfloat16": "BF16", "float16": "FP16"}[dtype]
