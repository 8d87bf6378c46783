"""Open Inference Protocol (KServe V2) against a real ffn-serve: NVIDIA's tritonclient, and the wire by hand."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from app.config.settings import Settings
from tests.reference import bf16_round, demo_reference
from tests.wire import bf16_bytes, from_bf16_bytes

D = 512


@pytest.fixture(scope="module")
def client(demo_server):
    c = triton.InferenceServerClient(demo_server.url.removeprefix("http://"))
    yield c
    c.close()


def test_server_metadata_and_health(client):
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta["name"] == "ffn-serve" and "binary_tensor_data" in meta["extensions"]
    assert client.is_model_ready("demo")


def test_model_metadata(client):
    meta = client.get_model_metadata("demo")
    assert meta["name"] == "demo"
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, D]}]
    assert meta["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, D]}]


@pytest.mark.parametrize("binary_in", [False, True])
@pytest.mark.parametrize("binary_out", [False, True])
@pytest.mark.parametrize("datatype", ["FP32", "FP16"])
def test_infer_with_tritonclient(client, binary_in, binary_out, datatype):
    np_dtype = np.float32 if datatype == "FP32" else np.float16
    x = np.random.default_rng(3).standard_normal((5, D)).astype(np_dtype)
    tensor = triton.InferInput("input", list(x.shape), datatype)
    tensor.set_data_from_numpy(x, binary_data=binary_in)
    wanted = triton.InferRequestedOutput("output", binary_data=binary_out)
    result = client.infer("demo", [tensor], outputs=[wanted], request_id="req-7")
    y = result.as_numpy("output")
    assert result.get_response()["id"] == "req-7"
    assert y.shape == x.shape
    tolerance = 1e-5 if datatype == "FP32" else 2e-3
    np.testing.assert_allclose(y.astype(np.float64), demo_reference(x), rtol=tolerance, atol=tolerance)


def test_infer_three_dimensional_input(client):
    x = np.random.default_rng(4).standard_normal((2, 3, D)).astype(np.float32)
    tensor = triton.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    y = client.infer("demo", [tensor]).as_numpy("output")  # no outputs named: all binary
    np.testing.assert_allclose(y, demo_reference(x), rtol=1e-5, atol=1e-5)


def test_unknown_model_surfaces_as_message(client):
    tensor = triton.InferInput("input", [1, D], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, D), np.float32))
    with pytest.raises(InferenceServerException) as info:
        client.infer("no-such-model", [tensor])
    assert "no-such-model" in info.value.message()
    assert info.value.status() == "404"


def test_wrong_shape_surfaces_as_message(client):
    tensor = triton.InferInput("input", [1, 7], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, 7), np.float32))
    with pytest.raises(InferenceServerException) as info:
        client.infer("demo", [tensor])
    assert "d_model=512" in info.value.message()
    assert info.value.status() == "400"


def split_binary_answer(response: httpx.Response) -> tuple[dict, bytes]:
    """Parse the binary extension by hand: JSON header of the stated length, then raw bytes."""
    header_length = int(response.headers["Inference-Header-Content-Length"])
    return json.loads(response.content[:header_length]), response.content[header_length:]


def test_wire_format_byte_for_byte(demo_server):
    x = np.random.default_rng(5).standard_normal((3, D)).astype(np.float32)
    blob = x.astype("<f4").tobytes()
    header = json.dumps(
        {
            "id": "wire-1",
            "inputs": [
                {"name": "input", "shape": [3, D], "datatype": "FP32", "parameters": {"binary_data_size": len(blob)}}
            ],
            "outputs": [{"name": "output", "parameters": {"binary_data": True}}],
        }
    ).encode()
    r = httpx.post(
        f"{demo_server.url}/v2/models/demo/infer",
        content=header + blob,
        headers={"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))},
    )
    assert r.status_code == 200, r.text
    answer, raw = split_binary_answer(r)
    assert answer["model_name"] == "demo" and answer["id"] == "wire-1"
    (output,) = answer["outputs"]
    assert output["name"] == "output" and output["datatype"] == "FP32" and output["shape"] == [3, D]
    assert output["parameters"]["binary_data_size"] == len(raw) == 3 * D * 4
    y = np.frombuffer(raw, dtype="<f4").reshape(3, D)
    np.testing.assert_allclose(y, demo_reference(x), rtol=1e-5, atol=1e-5)


def test_wire_bf16_binary_and_nested_json(demo_server):
    x = np.random.default_rng(6).standard_normal((2, D)).astype(np.float32)
    blob = bf16_bytes(x)
    header = json.dumps(
        {
            "inputs": [
                {"name": "input", "shape": [2, D], "datatype": "BF16", "parameters": {"binary_data_size": len(blob)}}
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    r = httpx.post(
        f"{demo_server.url}/v2/models/demo/infer",
        content=header + blob,
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert r.status_code == 200, r.text
    answer, raw = split_binary_answer(r)
    assert answer["outputs"][0]["datatype"] == "BF16"
    y = from_bf16_bytes(raw, (2, D)).astype(np.float64)
    np.testing.assert_allclose(y, demo_reference(bf16_round(x)), rtol=1e-2, atol=1e-2)

    # JSON tensors may be nested as well as flat; the JSON answer is flat, row-major.
    r = httpx.post(
        f"{demo_server.url}/v2/models/demo/infer",
        json={"inputs": [{"name": "input", "shape": [2, D], "datatype": "FP32", "data": x.tolist()}]},
    )
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    (output,) = r.json()["outputs"]
    np.testing.assert_allclose(np.array(output["data"]).reshape(2, D), demo_reference(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("document", "blob", "header_length", "needle"),
    [
        (
            {"inputs": [{"name": "input", "shape": [1, D], "datatype": "FP32", "parameters": {"binary_data_size": 8}}]},
            b"\0" * 8,
            None,
            "binary_data_size is 8",
        ),
        ({"inputs": [{"name": "x", "shape": [1, D], "datatype": "FP32", "data": [0.0] * D}]}, b"", None, "'x'"),
        ({"inputs": [{"name": "input", "shape": [1, D], "datatype": "INT8", "data": [0] * D}]}, b"", None, "datatype"),
        (
            {"inputs": [{"name": "input", "shape": [2, D], "datatype": "FP32", "data": [0.0] * D}]},
            b"",
            None,
            "holds 512",
        ),
        ({"inputs": []}, b"", 10_000, "exceeds the body"),
    ],
)
def test_v2_errors(demo_server, document, blob, header_length, needle):
    header = json.dumps(document).encode()
    length = header_length if header_length is not None else len(header)
    r = httpx.post(
        f"{demo_server.url}/v2/models/demo/infer",
        content=header + blob,
        headers={"Inference-Header-Content-Length": str(length)},
    )
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]


# ----- the versioned path behind the API key (in-process) ---------------------------------------

KEY = "v2-versioned-key"
VERSIONED = "/v2/models/demo/versions/1/infer"


@pytest.fixture
async def secured(start_app) -> httpx.AsyncClient:
    return (await start_app(Settings(api_key=KEY, warmup=False))).client


def v2_body(x: np.ndarray) -> dict:
    return {
        "id": "versioned",
        "inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}],
    }


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", KEY])
async def test_versioned_infer_without_the_key_is_401(secured: httpx.AsyncClient, authorization: str | None) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    r = await secured.post(VERSIONED, json=v2_body(np.zeros((1, D), np.float32)), headers=headers)
    assert r.status_code == 401, r.text
    assert r.json()["error_type"] == "unauthorized"


async def test_versioned_infer_with_the_key_answers_right(secured: httpx.AsyncClient) -> None:
    x = np.random.default_rng(7).standard_normal((3, D)).astype(np.float32)
    r = await secured.post(VERSIONED, json=v2_body(x), headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["model_name"] == "demo" and answer["id"] == "versioned"
    (output,) = answer["outputs"]
    assert output["name"] == "output" and output["shape"] == [3, D]
    np.testing.assert_allclose(np.array(output["data"]).reshape(3, D), demo_reference(x), rtol=1e-5, atol=1e-5)
