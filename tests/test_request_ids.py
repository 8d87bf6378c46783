"""Request ids: every answer carries one (X-Request-Id, and in every error body), and so does the access log.

A client's X-Request-Id is kept when it is a plausible id and replaced by one of the server's when
it could be anything else (the request is answered all the same, and the replacement logged at
most once a minute); a V2 request's `id` joins it in error bodies and logs.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from app.config.settings import Settings
from app.observe import identity
from app.observe.throttle import Throttle
from ffn_testing import ServerProcess, http_request, raw_request, start_server
from tests.in_process import InProcessApp

D = 512
GENERATED = re.compile(r"[0-9a-f]{20}")  # 12 hex digits of the process, 8 of its counter


@pytest.fixture
async def app(start_app) -> InProcessApp:
    return await start_app(Settings(warmup=False))


def v2_body(data: list[float], request_id: str | None = None) -> dict:
    body: dict = {"inputs": [{"name": "input", "shape": [1, D], "datatype": "FP32", "data": data}]}
    if request_id is not None:
        body["id"] = request_id
    return body


async def test_an_answer_carries_a_fresh_id_unless_the_client_sent_one(app: InProcessApp) -> None:
    first, second = [await app.client.get("/v1/models") for _ in range(2)]
    ids = [r.headers["x-request-id"] for r in (first, second)]
    assert all(GENERATED.fullmatch(i) for i in ids) and ids[0] != ids[1]
    assert ids[0][:12] == ids[1][:12]  # one process, one prefix
    uuid = "0f8fad5b-d9cb-469f-a165-70867728950e"
    assert (await app.client.get("/v1/models", headers={"X-Request-Id": uuid})).headers["x-request-id"] == uuid


@pytest.mark.parametrize(
    "given",
    ["a", "x" * 200, "0f8fad5b-d9cb-469f-a165-70867728950e", "nginx:3f2a.b_c+d/e=f@g", "Root=1-5759e988"],
)
async def test_a_plausible_client_id_is_kept(app: InProcessApp, given: str) -> None:
    r = await app.client.post(
        "/v1/models/demo/transform", json={"inputs": [[0.0] * 3]}, headers={"X-Request-Id": given}
    )
    assert r.status_code == 400  # the rows are wrong; the id is fine
    assert r.headers["x-request-id"] == given and r.json()["request_id"] == given


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("x" * 201, "1 to 200 characters"),
        ("has space", "letters, digits"),
        ('quote"d', "letters, digits"),
        ("new\tline", "letters, digits"),
        ("é", "letters, digits"),
        ("", "1 to 200 characters"),
    ],
)
async def test_an_implausible_client_id_is_replaced_by_one_of_the_servers_and_the_request_answered(
    app: InProcessApp, given: str, says: str, caplog: pytest.LogCaptureFixture
) -> None:
    identity._REPLACED = Throttle()  # a fresh limiter: this test's replacement is logged
    with caplog.at_level(logging.WARNING, logger="ffn_serve"):
        r = await app.client.get("/v1/models", headers=[("X-Request-Id", given.encode("utf-8"))])
    assert r.status_code == 200 and r.json()["models"][0]["name"] == "demo"
    assert GENERATED.fullmatch(r.headers["x-request-id"])  # the server's own, never the client's
    (line,) = [record.getMessage() for record in caplog.records if "X-Request-Id" in record.getMessage()]
    assert "replaced a client's X-Request-Id" in line and says in line
    assert not given or given not in line  # a replaced id is never written to the log either


async def test_two_client_ids_are_replaced(app: InProcessApp) -> None:
    r = await app.client.get("/v1/models", headers=[("X-Request-Id", "a"), ("X-Request-Id", "b")])
    assert r.status_code == 200 and GENERATED.fullmatch(r.headers["x-request-id"])


def test_replacements_are_logged_at_most_once_a_minute_with_the_count_since(caplog: pytest.LogCaptureFixture) -> None:
    identity._REPLACED = Throttle(every_s=60.0)
    with caplog.at_level(logging.WARNING, logger="ffn_serve"):
        for _ in range(1000):  # a client sending bad ids as fast as it can
            identity.request_id_from([b"a", b"b"])
    assert len(caplog.records) == 1 and "(1 since the last line)" in caplog.records[0].getMessage()


def test_a_throttle_reports_the_events_since_its_last_line() -> None:
    throttle = Throttle(every_s=60.0)
    assert [throttle.due() for _ in range(1000)] == [1] + [0] * 999
    every_time = Throttle(every_s=0.0)
    assert [every_time.due() for _ in range(3)] == [1, 1, 1]


async def test_every_error_body_carries_the_id_of_its_answer(app: InProcessApp) -> None:
    answers = [
        await app.client.get("/no/such/route"),
        await app.client.delete("/v1/models"),
        await app.client.post("/v1/models/nope/transform", json={"inputs": [[0.0] * D]}),
        await app.client.post("/v1/models/demo/transform", content=b"{", headers={"Content-Type": "application/json"}),
        await app.client.get("/v2/models/nope/ready"),
    ]
    assert [r.status_code for r in answers] == [404, 405, 404, 400, 404]
    for r in answers:
        assert r.json()["request_id"] == r.headers["x-request-id"], r.text
        assert {"error", "error_type"} <= set(r.json())  # what clients read before stays


async def test_an_unexpected_error_is_a_500_that_still_carries_its_id(app: InProcessApp) -> None:
    async def broken() -> None:
        raise RuntimeError("a bug, for this test")

    app.app.router.add_api_route("/test-only/broken", broken)
    # Starlette answers the 500, then raises the error again for the server to log: a client that
    # sees the answer, as a server's would, takes a transport that does not re-raise it.
    transport = httpx.ASGITransport(app=app.app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://ffn.test") as client:
        r = await client.get("/test-only/broken", headers={"X-Request-Id": "the-500"})
    assert r.status_code == 500 and r.json() == {
        "error": "internal server error",
        "error_type": "internal",
        "request_id": "the-500",
    }
    assert r.headers["x-request-id"] == "the-500"


async def test_a_v2_error_after_the_body_is_read_carries_the_v2_id_too(app: InProcessApp) -> None:
    short = await app.client.post("/v2/models/demo/infer", json=v2_body([0.0] * (D - 1), "mine-1"))
    assert short.status_code == 400
    assert short.json()["id"] == "mine-1" and short.json()["request_id"] == short.headers["x-request-id"]
    anonymous = await app.client.post("/v2/models/demo/infer", json=v2_body([0.0] * (D - 1)))
    assert "id" not in anonymous.json()


async def test_the_api_keys_401_carries_an_id(start_app) -> None:
    app = await start_app(Settings(warmup=False, api_key="sesame"))
    r = await app.client.get("/v1/models", headers={"X-Request-Id": "no-key"})
    assert r.status_code == 401 and r.json()["request_id"] == "no-key" == r.headers["x-request-id"]


# ----- a real server: the protocol's own refusals and the access log ---------------------------


@pytest.fixture(scope="module", params=["text", "json"])
def logged(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    env = {"FFN_ACCESS_LOG": "true", "FFN_LOG_FORMAT": request.param, "FFN_LOG_LEVEL": "info"}
    with start_server(env=env) as server:
        yield server


def access_lines(server: ServerProcess, marker: str) -> list[str]:
    return [line for line in server.logs().splitlines() if "uvicorn.access" in line and marker in line]


@pytest.mark.server
async def test_the_access_log_line_names_the_request_and_its_v2_id(logged: ServerProcess) -> None:
    forged = 'x"\n2099-01-01 INFO uvicorn.access: forged'
    x = np.zeros(D, np.float32).tolist()
    r = httpx.post(
        f"{logged.url}/v2/models/demo/infer", json=v2_body(x, forged), headers={"X-Request-Id": "logged-1"}, timeout=60
    )
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "logged-1"
    (line,) = access_lines(logged, "logged-1")
    assert not any("forged" in other and "logged-1" not in other for other in logged.logs().splitlines())
    if line.startswith("{"):
        entry = json.loads(line)
        assert entry["request_id"] == "logged-1" and entry["id"] == forged and entry["status"] == 200
    else:
        assert line.endswith(' request_id=logged-1 id="x\\"\\n2099-01-01 INFO uvicorn.access: forged"'), line
        assert '"POST /v2/models/demo/infer HTTP/1.1" 200' in line


@pytest.mark.server
async def test_the_protocols_own_refusal_carries_an_id(logged: ServerProcess) -> None:
    r = await raw_request(logged.port, b"G(T /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
    assert r.status == 400
    body = r.json()
    assert isinstance(body, dict) and GENERATED.fullmatch(body["request_id"])
    assert body["request_id"] == r.headers["x-request-id"]
    good = await raw_request(logged.port, http_request("GET", "/v2/health/live"))
    assert good.status == 200 and GENERATED.fullmatch(good.headers["x-request-id"])
