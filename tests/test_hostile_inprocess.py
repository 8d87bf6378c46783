"""Issue 11 in-process: an overflowing request does not harm its batch, and a dead batcher shows in readiness."""

from __future__ import annotations

import asyncio

import numpy as np

from app.config.settings import Settings
from tests.reference import assert_close, demo_reference, demo_weights

V1 = "/v1/models/demo/transform"


def overflowing_rows() -> np.ndarray:
    """Finite float32 rows aligned with the demo weights so that output 0 overflows float32."""
    weights = demo_weights()
    direction = weights["layer1.weight"].T @ weights["layer2.weight"][0]
    return (3e38 * np.sign(direction)).astype(np.float32).reshape(1, -1)


async def test_an_overflowing_request_fails_alone_in_its_batch(start_app) -> None:
    # One forward pass carries both: a batch of 3 rows fills with both requests (1 + 2 rows), and
    # the longest batching window waits for the second however slow the machine is.
    client = (await start_app(Settings(warmup=False, max_wait_ms=1000, max_batch_rows=3))).client
    normal = np.random.default_rng(3).standard_normal((2, 512)).astype(np.float32)
    bad, good = await asyncio.gather(
        client.post(V1, json={"inputs": overflowing_rows().tolist()}),
        client.post(V1, json={"inputs": normal.tolist()}),
    )
    assert bad.status_code == 422 and bad.json()["error_type"] == "non_finite_output"
    assert good.status_code == 200
    assert_close(np.asarray(good.json()["outputs"]), demo_reference(normal))
    metrics = (await client.get("/metrics")).text
    assert 'ffn_requests_total{model="demo",outcome="non_finite_output",protocol="http"} 1.0' in metrics
    assert 'ffn_batch_rows_count{model="demo"} 1.0' in metrics  # one pass carried both


async def test_a_dead_batcher_turns_readiness_503_and_says_why(start_app) -> None:
    running = await start_app(Settings(warmup=False))
    client = running.client
    batcher = running.app.state.service.engine.model("demo")._batcher
    batcher._collector.cancel()  # dies by something other than stop()
    await asyncio.sleep(0.05)
    ready = await client.get("/v2/health/ready")
    assert ready.status_code == 503
    assert ready.json()["error_type"] == "unavailable" and "batcher stopped unexpectedly" in ready.json()["error"]
    assert (await client.get("/v2/models/demo/ready")).status_code == 503
    r = await client.post(V1, json={"inputs": [[0.0] * 512]})
    assert r.status_code == 503 and "stopped unexpectedly" in r.json()["error"]
    assert (await client.get("/v2/health/live")).status_code == 200  # alive: restart it, don't route to it
