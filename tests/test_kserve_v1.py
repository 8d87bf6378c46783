"""KServe's V1 protocol against a real ffn-serve: KServe's own SDK (V1 REST client) and httpx.

- `POST /v1/models/{name}:predict` with `{"instances": [...]}` or `{"inputs": [...]}` answers
  `{"predictions": [...]}`, one per instance, equal to the float64 numpy FFN (tests/reference.py),
  for instances of one row and of a sequence of rows.
- `GET /v1/models/{name}` is `{"name", "ready": true}`, `GET /` is `{"status": "alive"}`: probes,
  open without the API key; predicting needs the key, and so does the native list `GET /v1/models`,
  which keeps its own shape beside V1 (as `POST /v1/models/{name}/transform` keeps working).
- The V2 budgets and errors: a body past max_body_bytes or with more rows than max_queue_rows is
  413 before it is parsed, every mistake a 400 (or 404, 415) with the one error body, counted in
  ffn_requests_total.
- Not ready (draining): readiness and predict answer 503, in-process.

KServe's SDK (pip install -e '.[kserve]') is optional, as in tests/test_probes.py: its test skips without it,
and runs in a process of its own (SDK_SCRIPT says why).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Iterator

import httpx
import numpy as np
import orjson
import pytest

from app.config.settings import Settings
from ffn_testing import ServerProcess, metric_value, start_server
from tests.reference import assert_close, demo_reference

KEY = "kserve-v1-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
D = 512
MAX_ROWS = 64
MAX_BODY = 1 << 20


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    env = {
        "FFN_API_KEY": KEY,
        "FFN_MAX_QUEUE_ROWS": str(MAX_ROWS),
        "FFN_MAX_BODY_BYTES": str(MAX_BODY),
        "FFN_LOG_LEVEL": "warning",
    }
    with start_server(env=env) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client


def instances(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("field", ["instances", "inputs"])
@pytest.mark.parametrize("shape", [(3, D), (2, 4, D)], ids=["rows", "sequences"])
def test_predictions_equal_numpy(http: httpx.Client, field: str, shape: tuple[int, ...]) -> None:
    x = instances(*shape)
    r = http.post("/v1/models/demo:predict", json={field: x.tolist()})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    assert list(r.json()) == ["predictions"]
    predictions = np.asarray(r.json()["predictions"])
    assert predictions.shape == shape  # one prediction per instance, each of its instance's shape
    assert_close(predictions, demo_reference(x.reshape(-1, D)).reshape(shape))


# KServe's SDK runs in a process of its own: its generated V2 protos (kserve.protocol.grpc) and
# tritonclient.grpc's register the same `inference.*` names in protobuf's default pool, so the
# second imported in one process fails (other test files import tritonclient.grpc).
SDK_SCRIPT = """
import asyncio, json, sys
import httpx, kserve

url, key, instances = sys.argv[1], sys.argv[2], json.loads(sys.stdin.read())

async def main():
    client = kserve.InferenceRESTClient(kserve.RESTConfig(protocol="v1", timeout=60))
    auth = {"Authorization": f"Bearer {key}"}
    found = {}
    try:
        found["answer"] = await client.infer(url, {"instances": instances}, model_name="demo", headers=auth)
        found["live"] = await client.is_server_live(url)  # the probes without the key
        found["ready"] = await client.is_model_ready(url, "demo")
        for name, call in (
            ("missing", client.is_model_ready(url, "no-such-model")),
            ("refused", client.infer(url, {"instances": [[1.0, 2.0]]}, model_name="demo", headers=auth)),
        ):
            try:
                await call
            except httpx.HTTPStatusError as exc:
                found[name] = [exc.response.status_code, str(exc)]
    finally:
        await client.close()
    print(json.dumps(found))

asyncio.run(main())
"""


def test_kserves_sdk_v1_client_is_answered_right(server: ServerProcess) -> None:
    if importlib.util.find_spec("kserve") is None:  # not imported here: see SDK_SCRIPT
        pytest.skip("KServe's SDK: pip install -e '.[kserve]'")
    x = instances(5, D, seed=1)
    done = subprocess.run(
        [sys.executable, "-c", SDK_SCRIPT, server.url, KEY],
        input=orjson.dumps(x.tolist()).decode(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = orjson.loads(done.stdout.strip().splitlines()[-1])
    assert_close(np.asarray(found["answer"]["predictions"]), demo_reference(x))
    assert found["live"] is True and found["ready"] is True
    assert found["missing"][0] == 404
    # A refusal reaches the SDK's error with the server's message (it reads the body's "error").
    assert found["refused"][0] == 400 and "last dimension must be d_model=512" in found["refused"][1]


def test_probes_are_open_and_everything_else_needs_the_key(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as anonymous:
        assert anonymous.get("/").json() == {"status": "alive"}
        assert anonymous.get("/v1/models/demo").json() == {"name": "demo", "ready": True}
        missing = anonymous.get("/v1/models/no-such-model")
        assert missing.status_code == 404 and missing.json()["error_type"] == "model_not_found"
        refused = anonymous.post("/v1/models/demo:predict", json={"instances": instances(1, D).tolist()})
        assert refused.status_code == 401 and refused.json()["error_type"] == "unauthorized"
        assert anonymous.get("/v1/models").status_code == 401


def test_the_native_routes_under_v1_keep_working(http: httpx.Client) -> None:
    listed = http.get("/v1/models").json()["models"]
    assert [(m["name"], m["d_model"]) for m in listed] == [("demo", D)]
    x = instances(2, D, seed=2)
    r = http.post("/v1/models/demo/transform", json={"inputs": x.tolist()})
    assert r.status_code == 200
    assert_close(np.asarray(r.json()["outputs"]), demo_reference(x))


def rows_json(n: int) -> bytes:
    return orjson.dumps({"instances": np.zeros((n, D), dtype=np.float32).tolist()})


REFUSED = {
    "not an object": (b"[[1.0]]", {}, 400, "invalid_input", "a KServe V1 body is a JSON object"),
    "no instances": (b'{"rows": [[1.0]]}', {}, 400, "invalid_input", "unknown field 'rows'"),
    "both fields": (b'{"instances": [[1.0]], "inputs": [[1.0]]}', {}, 400, "invalid_input", "one of"),
    "empty": (b'{"instances": []}', {}, 400, "invalid_input", "must be a list of instances"),
    "flat list": (b'{"instances": [1.0, 2.0]}', {}, 400, "invalid_input", "must be a list of instances"),
    "ragged": (b'{"instances": [[1.0], [1.0, 2.0]]}', {}, 400, "invalid_input", "rectangular"),
    "wrong d_model": (b'{"instances": [[1.0, 2.0]]}', {}, 400, "invalid_input", "last dimension must be d_model=512"),
    "strings": (b'{"instances": [["a"]]}', {}, 400, "invalid_input", "only numbers"),
    "booleans": (b'{"instances": [[true]]}', {}, 400, "invalid_input", "numbers"),
    "beyond float32": (b'{"instances": [[1e39]]}', {}, 400, "invalid_input", "out of float32 range"),
    "malformed": (b'{"instances": [[1.0,', {}, 400, "invalid_input", "malformed JSON"),
    "duplicate key": (b'{"instances": [[1.0]], "instances": [[2.0]]}', {}, 400, "invalid_input", "duplicate"),
    "rows past max_queue_rows": (rows_json(MAX_ROWS + 200), {}, 413, "payload_too_large", "more arrays or values"),
    "past max_body_bytes": (b" " * (MAX_BODY + 1), {}, 413, "payload_too_large", "exceeds the limit"),
    "not json": (b"x", {"content-type": "application/octet-stream"}, 415, "unsupported_media_type", "KServe V1"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_bad_request_gets_the_tables_answer(http: httpx.Client, case: str) -> None:
    body, headers, status, error_type, message = REFUSED[case]
    r = http.post("/v1/models/demo:predict", content=body, headers={"content-type": "application/json", **headers})
    assert r.status_code == status, r.text
    assert r.json()["error_type"] == error_type
    assert message in r.json()["error"]


def test_an_unknown_model_is_404_and_every_outcome_is_counted(http: httpx.Client) -> None:
    def counted(outcome: str) -> float:
        return metric_value(
            http.get("/metrics").text, "ffn_requests_total", model="demo", outcome=outcome, protocol="http"
        )

    before_ok, before_bad = counted("ok"), counted("invalid_input")
    r = http.post("/v1/models/no-such-model:predict", json={"instances": instances(1, D).tolist()})
    assert r.status_code == 404 and r.json()["error_type"] == "model_not_found"
    assert http.post("/v1/models/demo:predict", json={"instances": instances(1, D).tolist()}).status_code == 200
    assert http.post("/v1/models/demo:predict", json={"instances": [[1.0]]}).status_code == 400
    assert (counted("ok"), counted("invalid_input")) == (before_ok + 1, before_bad + 1)


async def test_a_model_not_ready_answers_503(start_app) -> None:
    served = await start_app(Settings(warmup=False))
    await served.app.state.service.engine.drain()  # the model turns UNAVAILABLE, draining
    ready = await served.client.get("/v1/models/demo")
    assert ready.status_code == 503 and ready.json()["error_type"] == "unavailable"
    assert "draining" in ready.json()["error"]
    r = await served.client.post("/v1/models/demo:predict", json={"instances": instances(1, D).tolist()})
    assert r.status_code == 503 and r.json()["error_type"] == "unavailable"
