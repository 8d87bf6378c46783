"""SIGTERM under load loses nothing: a real `ffn-serve` process drained while requests flow.

Workers send demo requests in a loop; big requests to a `slow` model (one in its forward pass,
one queued behind it) keep the drain open for at least one whole pass; then SIGTERM. Every
request sent before the signal must get 200 with the right answer, or 503 if it reached the
server after the drain began; never a transport error. Readiness turns 503 during the drain, new
work gets 503 with Retry-After, and the process exits 0. When the drain times out, what is left
is answered 503 (not cut off), and the exit code is still 0.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from ffn_testing import metric_value, start_server, wait_for_metrics
from tests.reference import demo_reference
from tests.slow_model import slow_model_config
from tests.wire import raw_headers

pytestmark = pytest.mark.server  # every test here starts ffn-serve processes

D_MODEL = 512
WORKERS = 8
SLOW_ROWS = 3072


@dataclass
class Sent:
    at: float  # time.monotonic() just before sending
    rows: int
    outcome: str  # "200", "503", ... or the transport error's class name
    done_at: float = 0.0
    x: np.ndarray | None = None
    y: np.ndarray | None = None  # a 200's answer, checked against float64 numpy after the run


async def load_worker(url: str, seed: int, log: list[Sent], stop: asyncio.Event) -> None:
    """Send until a request is refused or fails after SIGTERM (or `stop` is set); check answers later."""
    rng = np.random.default_rng(seed)
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:
        while not stop.is_set():
            rows = int(rng.integers(1, 9))
            x = rng.standard_normal((rows, D_MODEL)).astype(np.float32)
            sent = Sent(time.monotonic(), rows, "", x=x)
            log.append(sent)
            try:
                if seed % 2:
                    r = await client.post("/v1/models/demo/transform", json={"inputs": x.tolist()})
                    y = np.asarray(r.json()["outputs"]) if r.status_code == 200 else None
                else:
                    r = await client.post(
                        "/v1/models/demo/transform", content=x.tobytes(), headers=raw_headers((rows, D_MODEL))
                    )
                    y = np.frombuffer(r.content, "<f4").reshape(rows, D_MODEL) if r.status_code == 200 else None
            except httpx.TransportError as exc:
                sent.outcome = type(exc).__name__
                return
            finally:
                sent.done_at = time.monotonic()
            sent.outcome = str(r.status_code)
            if y is None:
                if r.status_code == 503:
                    assert r.headers.get("retry-after") == "1"
                    assert r.json()["error_type"] == "unavailable"
                return
            sent.y = y


@pytest.fixture(scope="module")
def drain_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("drain")
    return slow_model_config(
        folder, f"max_wait_ms = 20\nmax_batch_rows = {SLOW_ROWS}\nwarmup = false\ndrain_timeout_s = 30", with_demo=True
    )


async def test_sigterm_under_load_answers_everything_accepted(drain_config: Path) -> None:
    with start_server(config=drain_config) as server:
        log: list[Sent] = []
        stop = asyncio.Event()
        workers = [asyncio.create_task(load_worker(server.url, seed, log, stop)) for seed in range(WORKERS)]
        async with httpx.AsyncClient(base_url=server.url, timeout=60.0) as probe:
            # Load flowing: some demo requests already answered.
            await wait_for_metrics(
                probe,
                lambda m: metric_value(m, "ffn_requests_total", model="demo", outcome="ok") >= 20,
                "20 demo requests answered",
            )
            # Big slow requests: one in its forward pass and one queued behind it, so the drain
            # lasts at least one whole forward pass after SIGTERM whatever the machine's speed.
            slow_x = np.ones((SLOW_ROWS, D_MODEL), dtype=np.float32).tobytes()
            slow: list[asyncio.Task[httpx.Response]] = []
            give_up = time.monotonic() + 60
            while time.monotonic() < give_up:
                page = (await probe.get("/metrics")).text
                started = metric_value(page, "ffn_queue_seconds_count", model="slow")
                done = metric_value(page, "ffn_compute_seconds_count", model="slow")
                queued = metric_value(page, "ffn_queue_rows", model="slow")
                if started - done == 1 and queued == SLOW_ROWS:
                    break
                if len(slow) < 2 or (started == len(slow) and len(slow) < 6):  # none waiting: send one more
                    slow.append(
                        asyncio.create_task(
                            probe.post(
                                "/v1/models/slow/transform", content=slow_x, headers=raw_headers((SLOW_ROWS, D_MODEL))
                            )
                        )
                    )
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("never saw one slow request computing and another queued")
            slow_sent = time.monotonic()
            fresh = httpx.AsyncClient(base_url=server.url, timeout=10.0)
            assert (await fresh.get("/v2/health/ready")).status_code == 200  # connected before the signal

            sigterm_at = time.monotonic()
            server.terminate()

            try:
                readiness = []
                while True:  # until refused: the process is going away
                    try:
                        readiness.append((await fresh.get("/v2/health/ready")).status_code)
                    except httpx.TransportError as exc:
                        readiness.append(f"{exc!r} after {time.monotonic() - sigterm_at:.3f} s; {server.logs()}")
                        break
                    if readiness[-1] == 503:
                        break
                    await asyncio.sleep(0.005)
                assert readiness and readiness[-1] == 503, f"readiness during drain: {readiness}"
                refused = await fresh.post("/v1/models/demo/transform", json={"inputs": [[0.5] * D_MODEL]})
                assert refused.status_code == 503
                assert refused.headers["retry-after"] == "1"
                assert refused.json()["error_type"] == "unavailable"
                live = await fresh.get("/v2/health/live")
                assert live.status_code == 200  # the process answers while it drains
            finally:
                await fresh.aclose()

            slow_answers = await asyncio.gather(*slow)
            stop.set()
            await asyncio.wait_for(asyncio.gather(*workers), timeout=60)
        code = server.wait(60)
        logs = server.logs()

    assert code == 0, f"exit code {code}; log:\n{logs}"
    assert "draining" in logs
    for answer in slow_answers:  # the queued one was accepted before SIGTERM: answered, not dropped
        assert answer.status_code == 200 and answer.headers["x-shape"] == f"{SLOW_ROWS},{D_MODEL}"
    assert slow_sent < sigterm_at
    before = [s for s in log if s.at < sigterm_at]
    assert len(before) >= 20
    for s in before:
        assert s.outcome in ("200", "503"), f"request sent before SIGTERM ended with {s.outcome}"
        if s.outcome == "200":
            np.testing.assert_allclose(s.y, demo_reference(s.x), rtol=1e-4, atol=1e-4)
    drained = [s for s in before if s.outcome == "200" and s.done_at > sigterm_at]
    assert drained, "no demo request in flight at SIGTERM was answered after it: nothing was drained"
    after = [s for s in log if s.at >= sigterm_at]
    for s in after:
        assert s.outcome in ("200", "503", "ConnectError", "RemoteProtocolError", "ReadError"), s.outcome


async def test_drain_timeout_answers_what_is_left_503_and_exits_0(drain_config: Path) -> None:
    """Work that cannot finish within FFN_DRAIN_TIMEOUT_S is answered 503 (never a 500 or a reset)."""
    with start_server(config=drain_config, env={"FFN_DRAIN_TIMEOUT_S": "0.2"}) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60.0) as client:
            body = np.ones((SLOW_ROWS, D_MODEL), dtype=np.float32).tobytes()
            slow = [
                asyncio.create_task(
                    client.post("/v1/models/slow/transform", content=body, headers=raw_headers((SLOW_ROWS, D_MODEL)))
                )
                for _ in range(3)
            ]
            # One computing, two queued: seconds of work left.
            await wait_for_metrics(
                client,
                lambda m: metric_value(m, "ffn_queue_rows", model="slow") == 2 * SLOW_ROWS,
                "two slow requests queued behind a third",
            )
            server.terminate()
            answers = await asyncio.gather(*slow)
        code = server.wait(60)
        logs = server.logs()

    assert code == 0, f"exit code {code}; log:\n{logs}"
    assert "drain timeout reached" in logs
    statuses = sorted(a.status_code for a in answers)
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(503) >= 2, f"the queued requests should be refused at the timeout: {statuses}"
    for answer in answers:
        if answer.status_code == 503:
            assert answer.json()["error_type"] == "unavailable"
