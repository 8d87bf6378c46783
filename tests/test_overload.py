"""Overload, deadlines and client disconnects against a real `ffn-serve` process.

- A burst of 10x the queue's capacity: 429 with Retry-After at once, no 5xx, every accepted
  request answered right (float64 numpy on demo_ffn()'s weights).
- A deadline that passes in the queue: 504, and its rows never reach a forward pass.
- A client that hangs up while queued: its rows are dropped, the server keeps serving.

The queue is made to hold work on purpose: for the burst, a long batching window
(FFN_MAX_WAIT_MS=1000) with max_batch_rows above max_queue_rows, so accepted rows wait a second
while the rest of the burst arrives; for deadlines and disconnects, a `slow` model (d_ff 8192)
whose one big request keeps the model thread busy for a second or more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import numpy as np
import orjson
import pytest

from ffn_testing import ServerProcess, http_request, metric_value, raw_request, start_server, wait_for_metrics
from tests.reference import demo_reference
from tests.slow_model import slow_model_config
from tests.wire import raw_headers

D_MODEL = 512
QUEUE_ROWS = 64
SLOW_ROWS = 3072  # ~1 s or more of forward on the slow model on a 2-core CPU


async def metrics(client: httpx.AsyncClient) -> str:
    response = await client.get("/metrics")
    assert response.status_code == 200
    return response.text


# ----- burst --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def burst_server() -> Iterator[ServerProcess]:
    env = {
        "FFN_MAX_QUEUE_ROWS": str(QUEUE_ROWS),
        "FFN_MAX_BATCH_ROWS": "1024",
        "FFN_MAX_WAIT_MS": "1000",
        "FFN_WARMUP": "0",
        "FFN_TORCH_THREADS": "1",
    }
    with start_server(env=env) as server:
        yield server


async def test_burst_of_ten_times_the_queue_gets_429s_and_right_answers(burst_server: ServerProcess) -> None:
    rng = np.random.default_rng(1)
    row_counts = [1 + i % 4 for i in range(256)]  # 640 rows: 10x the queue
    inputs = [rng.standard_normal((n, D_MODEL)).astype(np.float32) for n in row_counts]
    path = "/v1/models/demo/transform"
    requests = [
        http_request("POST", path, {"Content-Type": "application/json"}, orjson.dumps({"inputs": x.tolist()}))
        if i % 2
        else http_request("POST", path, raw_headers(x.shape), x.tobytes())
        for i, x in enumerate(inputs)
    ]
    # One connection per request, all at once (httpx's pool is the bottleneck at this concurrency).
    async with httpx.AsyncClient(base_url=burst_server.url, timeout=30.0) as client:
        before = await metrics(client)
        responses = await asyncio.gather(*(raw_request(burst_server.port, r) for r in requests))
        after = await metrics(client)

    statuses = [r.status for r in responses]
    assert set(statuses) <= {200, 429}, f"unexpected statuses {sorted(set(statuses))}"
    refused = [r for r in responses if r.status == 429]
    accepted = [(i, r) for i, r in enumerate(responses) if r.status == 200]
    assert refused, "a burst of 10x the queue's capacity got no 429"
    assert accepted, "no request of the burst was accepted"
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error_type"] == "overloaded"
    accepted_rows = sum(row_counts[i] for i, _ in accepted)
    for i, r in accepted:
        if r.headers["content-type"].startswith("application/json"):
            y = np.asarray(r.json()["outputs"], dtype=np.float64)
        else:
            assert r.headers["x-shape"] == f"{row_counts[i]},{D_MODEL}"
            y = np.frombuffer(r.body, dtype="<f4").reshape(row_counts[i], D_MODEL)
        np.testing.assert_allclose(y, demo_reference(inputs[i]), rtol=1e-4, atol=1e-4)

    def delta(name: str, **labels: str) -> float:
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert delta("ffn_requests_total", model="demo", outcome="overloaded") == len(refused)
    assert delta("ffn_requests_total", model="demo", outcome="ok") == len(accepted)
    assert delta("ffn_batch_rows_sum", model="demo") == accepted_rows
    assert metric_value(after, "ffn_queue_rows", model="demo") == 0


async def test_request_larger_than_the_queue_is_413(burst_server: ServerProcess) -> None:
    x = np.zeros((QUEUE_ROWS + 1, D_MODEL), dtype=np.float32)
    async with httpx.AsyncClient(base_url=burst_server.url, timeout=30.0) as client:
        r = await client.post("/v1/models/demo/transform", content=x.tobytes(), headers=raw_headers(x.shape))
        assert r.status_code == 413
        assert r.json()["error_type"] == "payload_too_large"
        ok = await client.post("/v1/models/demo/transform", json={"inputs": x[:2].tolist()})
        assert ok.status_code == 200


# ----- deadlines and disconnects -------------------------------------------------------------


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    config = slow_model_config(
        tmp_path_factory.mktemp("slow-model"), "max_wait_ms = 0\nmax_batch_rows = 4096\nwarmup = false"
    )
    with start_server(config=config) as server:
        yield server


class SlowRequest:
    """One big request to the slow model, in the background; `started()` waits for its forward pass."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        x = np.random.default_rng(2).standard_normal((SLOW_ROWS, D_MODEL)).astype(np.float32)
        self.task = asyncio.create_task(
            client.post("/v1/models/slow/transform", content=x.tobytes(), headers=raw_headers(x.shape))
        )

    async def started(self, before: str) -> None:
        count = metric_value(before, "ffn_queue_seconds_count", model="slow")
        # queue_seconds is observed when a batch starts its forward pass.
        await wait_for_metrics(
            self.client,
            lambda m: metric_value(m, "ffn_queue_seconds_count", model="slow") > count,
            "the slow request's forward pass to start",
        )

    async def answered(self) -> None:
        r = await self.task
        assert r.status_code == 200, r.text
        assert r.headers["x-shape"] == f"{SLOW_ROWS},{D_MODEL}"


def rows_delta(before: str, after: str) -> tuple[float, float]:
    """(batches, rows) computed by the slow model between two /metrics pages."""
    count = metric_value(after, "ffn_batch_rows_count", model="slow") - metric_value(
        before, "ffn_batch_rows_count", model="slow"
    )
    rows = metric_value(after, "ffn_batch_rows_sum", model="slow") - metric_value(
        before, "ffn_batch_rows_sum", model="slow"
    )
    return count, rows


async def only_the_slow_and_follow_up_computed(
    client: httpx.AsyncClient, slow: SlowRequest, before: str, outcome: str
) -> None:
    """Once the slow request is answered, a 2-row follow-up (the server still serves, and the
    collector has moved past the test's request) is answered too; those two were the only
    forward passes since `before`, and the test's request was counted once as `outcome`."""
    await slow.answered()
    x = np.ones((2, D_MODEL), dtype=np.float32)
    r = await client.post("/v1/models/slow/transform", content=x.tobytes(), headers=raw_headers(x.shape))
    assert r.status_code == 200, r.text
    after = await metrics(client)
    assert rows_delta(before, after) == (2, SLOW_ROWS + 2), f"the rows of the request ending {outcome} were computed"
    counted = metric_value(after, "ffn_requests_total", model="slow", outcome=outcome) - metric_value(
        before, "ffn_requests_total", model="slow", outcome=outcome
    )
    assert counted == 1


@pytest.mark.parametrize("protocol", ["v1", "v2"])
async def test_deadline_passing_in_the_queue_gives_504_and_no_compute(
    slow_server: ServerProcess, protocol: str
) -> None:
    x = np.ones((5, D_MODEL), dtype=np.float32)
    async with httpx.AsyncClient(base_url=slow_server.url, timeout=60.0) as client:
        before = await metrics(client)
        slow = SlowRequest(client)
        await slow.started(before)
        if protocol == "v1":
            r = await client.post(
                "/v1/models/slow/transform", content=x.tobytes(), headers=raw_headers(x.shape, **{"x-timeout-ms": "20"})
            )
        else:
            r = await client.post(
                "/v2/models/slow/infer",
                json={
                    "inputs": [
                        {"name": "input", "shape": [5, D_MODEL], "datatype": "FP32", "data": x.ravel().tolist()}
                    ],
                    "parameters": {"timeout": 20_000},  # microseconds, as Triton's clients send it
                },
            )
        assert r.status_code == 504, r.text
        assert r.json()["error_type"] == "deadline_exceeded"
        await only_the_slow_and_follow_up_computed(client, slow, before, "deadline_exceeded")


async def test_client_that_hangs_up_is_dropped_without_compute(slow_server: ServerProcess) -> None:
    rows = 3
    x = np.ones((rows, D_MODEL), dtype=np.float32)
    request = http_request("POST", "/v1/models/slow/transform", raw_headers(x.shape), x.tobytes(), close=False)
    async with httpx.AsyncClient(base_url=slow_server.url, timeout=60.0) as client:
        before = await metrics(client)
        slow = SlowRequest(client)
        await slow.started(before)
        computed_before = metric_value(await metrics(client), "ffn_compute_seconds_count", model="slow")

        _, writer = await asyncio.open_connection("127.0.0.1", slow_server.port)
        writer.write(request)
        await writer.drain()
        await wait_for_metrics(
            client, lambda m: metric_value(m, "ffn_queue_rows", model="slow") == rows, "the request to be queued"
        )
        writer.close()  # hang up while queued
        await writer.wait_closed()
        released = await wait_for_metrics(
            client, lambda m: metric_value(m, "ffn_queue_rows", model="slow") == 0, "the queue to drop the rows"
        )
        # Released while the big forward pass still runs: dropped, not taken into a batch.
        assert metric_value(released, "ffn_compute_seconds_count", model="slow") == computed_before

        await only_the_slow_and_follow_up_computed(client, slow, before, "client_closed_request")
