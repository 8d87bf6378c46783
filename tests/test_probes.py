"""Probes: server health and model readiness answer KServe's bodies, and need no API key.

The rule (app/http/edge.py, docs/api.md): the probes, GET /v2/health/live, /v2/health/ready and
/v2/models/{name}[/versions/{v}]/ready, need no key, because Kubernetes, load balancers, KServe
and tritonclient's is_* methods probe without one; every other route needs it. Checked with the
clients themselves against a real server that has a key: tritonclient (which reads the status
alone) and KServe's REST client (which reads the bodies), each sending no key.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import tritonclient.http as triton

from app.config.settings import Settings
from ffn_testing import ServerProcess, start_server

KEY = "probe-test-key"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with start_server(env={"FFN_API_KEY": KEY, "FFN_LOG_LEVEL": "warning"}) as srv:
        yield srv


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v2/health/live", {"live": True}),
        ("/v2/health/ready", {"ready": True}),
        ("/v2/models/demo/ready", {"name": "demo", "ready": True}),
        ("/v2/models/demo/versions/1/ready", {"name": "demo", "ready": True}),
    ],
)
def test_probes_answer_kserves_bodies_without_a_key(server: ServerProcess, path: str, body: dict) -> None:
    r = httpx.get(server.url + path)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json() == body


def test_everything_else_still_needs_the_key(server: ServerProcess) -> None:
    for method, path in [
        ("GET", "/v2/models/demo"),
        ("GET", "/v2/models/demo/config"),
        ("POST", "/v2/models/demo/ready"),
    ]:
        r = httpx.request(method, server.url + path)
        assert (r.status_code, r.json()["error_type"]) == (401, "unauthorized"), path
    assert httpx.get(server.url + "/v2/models/demo", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_an_unknown_model_is_404_to_a_probe(server: ServerProcess) -> None:
    r = httpx.get(server.url + "/v2/models/no-such-model/ready")
    assert (r.status_code, r.json()["error_type"]) == (404, "model_not_found")


def test_tritonclient_probes_without_a_key(server: ServerProcess) -> None:
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        assert client.is_server_live() is True and client.is_server_ready() is True
        assert client.is_model_ready("demo") is True and client.is_model_ready("demo", "1") is True
        assert client.is_model_ready("no-such-model") is False
    finally:
        client.close()


async def test_kserve_rest_client_probes_without_a_key(server: ServerProcess) -> None:
    kserve = pytest.importorskip("kserve", reason="KServe's SDK: pip install -e '.[kserve]'")
    client = kserve.InferenceRESTClient(kserve.RESTConfig(protocol="v2", timeout=30))
    try:
        assert await client.is_server_live(server.url) is True
        assert await client.is_server_ready(server.url) is True
        assert await client.is_model_ready(server.url, "demo") is True
        assert await client.is_model_ready(server.url, "no-such-model") is False
    finally:
        await client.close()


async def test_not_ready_is_503_with_the_error_body(start_app) -> None:
    served = await start_app(Settings(warmup=False))
    engine = served.app.state.service.engine
    await engine.drain()  # the model turns UNAVAILABLE, draining
    for path in ("/v2/health/ready", "/v2/models/demo/ready"):
        r = await served.client.get(path)
        assert r.status_code == 503 and r.json()["error_type"] == "unavailable", path
        assert "draining" in r.json()["error"]
    r = await served.client.get("/v2/health/live")
    assert (r.status_code, r.json()) == (200, {"live": True})
