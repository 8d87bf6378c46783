"""Triton's trace extension over HTTP: settings change which requests are traced, in every worker.

Whether a request was traced shows on its answer: a traced one carries its span's traceparent.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from app.config.settings import ModelSpec, Settings
from bench.otlp_receiver import OtlpReceiver
from ffn_testing import ServerProcess, start_server
from tests.in_process import InProcessApp

D = 512
SERVER_KIND = 2


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as running:
        yield running


@pytest.fixture
async def traced(start_app, receiver: OtlpReceiver) -> InProcessApp:
    """Two models, a and b, traced to the receiver."""
    return await start_app(
        Settings(otlp_endpoint=receiver.url, warmup=False, models=[ModelSpec(name="a"), ModelSpec(name="b")])
    )


def body(rows: int = 1) -> dict:
    data = np.full((rows, D), 0.5, np.float32).ravel().tolist()
    return {"inputs": [{"name": "input", "shape": [rows, D], "datatype": "FP32", "data": data}]}


async def infer(app: InProcessApp, model: str = "a", headers: dict[str, str] | None = None) -> httpx.Response:
    response = await app.client.post(f"/v2/models/{model}/infer", json=body(), headers=headers)
    assert response.status_code == 200, response.text
    return response


async def traced_answers(app: InProcessApp, count: int, model: str = "a") -> list[bool]:
    return ["traceparent" in (await infer(app, model)).headers for _ in range(count)]


async def post(app: InProcessApp, settings: dict, model: str | None = None) -> httpx.Response:
    path = "/v2/trace/setting" if model is None else f"/v2/models/{model}/trace/setting"
    return await app.client.post(path, json=settings)


async def test_trace_rate_and_trace_count_choose_the_requests_traced(traced: InProcessApp) -> None:
    assert await traced_answers(traced, 2) == [True, True]
    assert (await post(traced, {"trace_rate": "3"})).json()["trace_rate"] == "3"
    assert await traced_answers(traced, 6) == [False, False, True, False, False, True]
    changed = await post(traced, {"trace_rate": "1", "trace_count": "2"})
    assert changed.json()["trace_count"] == "2"
    assert await traced_answers(traced, 4) == [True, True, False, False]
    assert (await traced.client.get("/v2/trace/setting")).json()["trace_count"] == "0"
    await post(traced, {"trace_count": "-1"})
    assert await traced_answers(traced, 2) == [True, True]


async def test_a_propagated_parent_is_traced_whatever_the_rate_and_count(traced: InProcessApp) -> None:
    await post(traced, {"trace_rate": "1000", "trace_count": "0"})
    assert await traced_answers(traced, 2) == [False, False]
    trace_id = secrets.token_hex(16)
    answer = await infer(traced, headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
    assert answer.headers["traceparent"].startswith(f"00-{trace_id}-")
    await post(traced, {"trace_level": ["OFF"]})  # OFF is off, parent or not
    answer = await infer(traced, headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
    assert "traceparent" not in answer.headers


async def test_a_models_setting_applies_to_it_alone_until_null_puts_it_back(traced: InProcessApp) -> None:
    off = await post(traced, {"trace_level": ["OFF"]}, model="a")
    assert off.status_code == 200 and off.json()["trace_level"] == ["OFF"]
    assert await traced_answers(traced, 1, "a") == [False]
    assert await traced_answers(traced, 1, "b") == [True]
    assert (await traced.client.get("/v2/models/b/trace/setting")).json()["trace_level"] == ["TIMESTAMPS"]
    assert (await traced.client.get("/v2/trace/setting")).json()["trace_level"] == ["TIMESTAMPS"]
    back = await post(traced, {"trace_level": None}, model="a")
    assert back.json()["trace_level"] == ["TIMESTAMPS"]
    assert await traced_answers(traced, 1, "a") == [True]


async def test_tensors_level_describes_the_tensors_never_their_values(
    traced: InProcessApp, receiver: OtlpReceiver
) -> None:
    await post(traced, {"trace_level": ["TIMESTAMPS", "TENSORS"]})
    # Uncompressed answers (httpx asks for gzip by default): the span counts the bytes sent.
    answer = await infer(traced, headers={"X-Request-Id": "with-tensors", "Accept-Encoding": "identity"})
    trace_id = answer.headers["traceparent"].split("-")[1]
    spans = await asyncio.to_thread(
        receiver.wait_for, lambda spans: {"decode", "encode"} <= {s.name for s in spans if s.trace_id == trace_id}
    )
    stages = {s.name: s for s in spans if s.trace_id == trace_id}
    assert stages["decode"].attributes["ffn.input.shape"] == [1, D]
    assert stages["decode"].attributes["ffn.input.dtype"] == "float32"
    assert stages["encode"].attributes["ffn.output.bytes"] == len(answer.content)
    assert stages["encode"].attributes["ffn.output.content_type"] == answer.headers["content-type"]
    assert answer.headers["content-type"] == "application/json"
    assert not any(isinstance(value, float) for span in stages.values() for value in span.attributes.values())

    # Another encoding, the content type it answered with: a native .npy answer.
    x = np.full((2, D), 0.5, np.float32)
    npy = await traced.client.post(
        "/v1/models/a/transform",
        content=x.tobytes(),
        headers={
            "content-type": "application/octet-stream",
            "x-shape": f"2,{D}",
            "accept": "application/x-npy",
            "accept-encoding": "identity",
        },
    )
    assert npy.status_code == 200 and npy.headers["content-type"] == "application/x-npy"
    npy_trace = npy.headers["traceparent"].split("-")[1]
    spans = await asyncio.to_thread(
        receiver.wait_for, lambda spans: any(s.trace_id == npy_trace and s.name == "encode" for s in spans)
    )
    (encode,) = [s for s in spans if s.trace_id == npy_trace and s.name == "encode"]
    assert encode.attributes["ffn.output.content_type"] == "application/x-npy"
    assert encode.attributes["ffn.output.bytes"] == len(npy.content)


async def test_log_frequency_sends_every_n_traces_instead_of_waiting(
    start_app, receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the batch processor's schedule at ten minutes, only log_frequency (or the end) sends spans."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")
    app = await start_app(Settings(otlp_endpoint=receiver.url, warmup=False))
    assert (await post(app, {"log_frequency": "1"})).json()["log_frequency"] == "1"
    await infer_demo(app, "sent-at-once")
    await asyncio.to_thread(receiver.wait_for, lambda spans: has_request(spans, "sent-at-once"))
    await post(app, {"log_frequency": "0"})
    await infer_demo(app, "sent-at-the-end")
    await post(app, {"log_frequency": "2"})
    await infer_demo(app, "first-of-two")
    await infer_demo(app, "second-of-two")  # the second trace since log_frequency was set: all are sent
    spans = await asyncio.to_thread(receiver.wait_for, lambda spans: has_request(spans, "second-of-two"))
    assert has_request(spans, "sent-at-the-end") and has_request(spans, "first-of-two")


async def infer_demo(app: InProcessApp, request_id: str) -> None:
    response = await app.client.post("/v2/models/demo/infer", json=body(), headers={"X-Request-Id": request_id})
    assert response.status_code == 200


def has_request(spans: list, request_id: str) -> bool:
    return any(s.kind == SERVER_KIND and s.attributes.get("ffn.request_id") == request_id for s in spans)


@pytest.mark.parametrize(
    ("path", "content", "status", "error_type"),
    [
        ("/v2/trace/setting", b'{"trace_file": "/tmp/x"}', 400, "invalid_input"),
        ("/v2/trace/setting", b'{"trace_rate": "0"}', 400, "invalid_input"),
        ("/v2/trace/setting", b'{"trace_rate": 5}', 400, "invalid_input"),
        ("/v2/trace/setting", b"not json", 400, "invalid_input"),
        ("/v2/trace/setting", b"[1]", 400, "invalid_input"),
        ("/v2/trace/setting", b"{" * 100_000, 413, "payload_too_large"),
        ("/v2/models/nope/trace/setting", b"{}", 404, "model_not_found"),
    ],
)
async def test_a_bad_post_is_refused_with_the_error_body(
    traced: InProcessApp, path: str, content: bytes, status: int, error_type: str
) -> None:
    response = await traced.client.post(path, content=content, headers={"X-Request-Id": "bad-setting"})
    assert response.status_code == status, response.text
    assert response.json()["error_type"] == error_type and response.json()["request_id"] == "bad-setting"
    assert (await traced.client.get("/v2/trace/setting")).json()["trace_rate"] == "1"  # nothing changed


async def test_an_empty_post_changes_nothing_and_answers_the_settings(traced: InProcessApp) -> None:
    empty = await traced.client.post("/v2/trace/setting")
    assert empty.status_code == 200
    assert empty.json() == (await traced.client.get("/v2/trace/setting")).json()


async def test_without_an_endpoint_the_level_is_off_and_changes_are_refused(start_app) -> None:
    app = await start_app(Settings(warmup=False))
    assert (await app.client.get("/v2/models/demo/trace/setting")).json()["trace_level"] == ["OFF"]
    refused = await post(app, {"trace_level": ["TIMESTAMPS"]})
    assert refused.status_code == 400 and "--otlp-endpoint" in refused.json()["error"]
    response = await app.client.post("/v2/models/demo/infer", json=body())
    assert response.status_code == 200 and "traceparent" not in response.headers


# ----- every worker ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_workers(receiver: OtlpReceiver) -> Iterator[ServerProcess]:
    env = {"FFN_WORKERS": "2", "FFN_OTLP_ENDPOINT": receiver.url, "FFN_LOG_LEVEL": "warning"}
    with start_server(env=env) as server:
        yield server


async def answers_by_worker(server: ServerProcess) -> dict[str, bool]:
    """Whether each worker traced its requests, by the prefix of the request ids it gives (one per process).

    Which worker accepts a connection is the kernel's choice: bursts of new connections until both have.
    """
    seen: dict[str, list[bool]] = {}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        for _ in range(30):
            responses = await asyncio.gather(
                *(client.post("/v2/models/demo/infer", json=body(), headers={"Connection": "close"}) for _ in range(16))
            )
            for response in responses:
                assert response.status_code == 200
                seen.setdefault(response.headers["x-request-id"][:12], []).append("traceparent" in response.headers)
            if len(seen) == 2:
                break
    assert len(seen) == 2, seen
    assert all(len(set(traced)) == 1 for traced in seen.values()), seen
    return {prefix: traced[0] for prefix, traced in seen.items()}


@pytest.mark.server
async def test_a_setting_reaches_every_worker(two_workers: ServerProcess) -> None:
    assert set((await answers_by_worker(two_workers)).values()) == {True}
    async with httpx.AsyncClient(base_url=two_workers.url, timeout=60) as client:
        off = await client.post("/v2/trace/setting", json={"trace_level": ["OFF"]})
        assert off.status_code == 200 and off.json()["trace_level"] == ["OFF"]
        assert set((await answers_by_worker(two_workers)).values()) == {False}
        await client.post("/v2/trace/setting", json={"trace_level": None})
    assert set((await answers_by_worker(two_workers)).values()) == {True}
