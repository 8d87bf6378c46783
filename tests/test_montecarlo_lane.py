"""The engine's Monte Carlo dropout lane: on the model's device thread, bounded, and nothing computed
for a request nobody waits for. The device thread is held by a blocked call, never by timing."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch

from app.engine import errors
from app.engine.montecarlo import MonteCarloLane, MonteCarloRequest
from app.metrics import Metrics
from ffn_client.testing import metric_value
from ffn_core import FFNConfig, build_ffn, mc_dropout

D_MODEL, D_FF = 8, 32
ASK = MonteCarloRequest(passes=6, dropout=0.25, seed=11)


@dataclass
class Lane:
    lane: MonteCarloLane
    executor: ThreadPoolExecutor
    metrics: Metrics
    model: torch.nn.Module

    def count(self, series: str) -> float:
        return metric_value(self.metrics.render().decode(), series, model="m")

    async def hold(self) -> threading.Event:
        """Block the device thread until the returned event is set."""
        release, holding = threading.Event(), threading.Event()

        def blocked() -> None:
            holding.set()
            release.wait(60)

        asyncio.get_running_loop().run_in_executor(self.executor, blocked)
        await asyncio.to_thread(holding.wait, 60)
        return release

    async def flush(self) -> None:
        """Wait until the device thread has run everything submitted before."""
        await asyncio.get_running_loop().run_in_executor(self.executor, lambda: None)


@pytest.fixture
async def lane() -> AsyncIterator[Lane]:
    torch.manual_seed(0)
    model = build_ffn(FFNConfig(D_MODEL, D_FF, "gelu", gated=True, dropout=0.25))
    executor = ThreadPoolExecutor(max_workers=1)
    metrics = Metrics()
    lane = MonteCarloLane(model, executor=executor, instruments=metrics.for_model("m"), max_rows=16, max_queue_rows=20)
    lane.start()
    yield Lane(lane, executor, metrics, model)
    lane.stop()
    executor.shutdown(wait=True)


async def until_waiting(lane: MonteCarloLane, rows: int) -> None:
    while lane.waiting_rows != rows:
        await asyncio.sleep(0.001)


def rows(n: int) -> torch.Tensor:
    return torch.randn(n, D_MODEL, generator=torch.Generator().manual_seed(n))


async def test_the_answer_is_mc_dropout_of_the_rows_and_is_counted_like_a_batch(lane: Lane) -> None:
    x = rows(5)
    result = await lane.lane.submit(x, ASK)
    mean, std = mc_dropout(lane.model, x, passes=6, p=0.25, seed=11)
    assert torch.equal(result.mean, mean) and torch.equal(result.std, std)
    assert lane.count("ffn_compute_seconds_count") == 1 and lane.count("ffn_batch_rows_sum") == 5
    assert lane.count("ffn_request_seconds_count") == 1 and lane.count("ffn_queue_seconds_count") == 1
    assert lane.count("ffn_request_compute_seconds_total") > 0
    assert lane.count("ffn_last_inference_timestamp_seconds") > 0
    assert lane.lane.waiting_rows == 0


async def test_a_deadline_passed_before_its_turn_is_504_and_never_computed(lane: Lane) -> None:
    release = await lane.hold()
    deadline = asyncio.get_running_loop().time() + 0.05
    with pytest.raises(errors.DeadlineExceeded):
        await lane.lane.submit(rows(2), ASK, deadline=deadline)
    release.set()
    await lane.flush()
    assert lane.count("ffn_compute_seconds_count") == 0
    assert lane.count("ffn_failed_request_seconds_count") == 1
    assert lane.lane.waiting_rows == 0


async def test_a_client_gone_before_its_turn_is_never_computed(lane: Lane) -> None:
    release = await lane.hold()
    task = asyncio.create_task(lane.lane.submit(rows(3), ASK))
    await until_waiting(lane.lane, 3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    await lane.flush()
    assert lane.count("ffn_compute_seconds_count") == 0 and lane.count("ffn_failed_request_seconds_count") == 1


async def test_bounded_in_rows(lane: Lane) -> None:
    with pytest.raises(errors.RequestTooLarge, match="at most 16 rows"):
        await lane.lane.submit(rows(17), ASK)
    release = await lane.hold()
    waiting = asyncio.create_task(lane.lane.submit(rows(16), ASK))
    await until_waiting(lane.lane, 16)
    with pytest.raises(errors.Overloaded, match="16 of 20 rows waiting"):
        await lane.lane.submit(rows(5), ASK)
    release.set()
    assert (await waiting).mean.shape == (16, D_MODEL)
    assert lane.count("ffn_failed_request_seconds_count") == 2


async def test_stop_answers_the_waiting_503(lane: Lane) -> None:
    release = await lane.hold()
    task = asyncio.create_task(lane.lane.submit(rows(2), ASK))
    await until_waiting(lane.lane, 2)
    lane.lane.stop()
    with pytest.raises(errors.Unavailable, match="shutting down"):
        await task
    release.set()
    await lane.flush()
    assert lane.count("ffn_compute_seconds_count") == 0


async def test_drain_waits_for_the_accepted_and_refuses_new_ones(lane: Lane) -> None:
    release = await lane.hold()
    task = asyncio.create_task(lane.lane.submit(rows(2), ASK))
    await until_waiting(lane.lane, 2)
    assert await lane.lane.drain(0.05) is False  # the device thread is held: not finished yet
    with pytest.raises(errors.Unavailable):
        await lane.lane.submit(rows(1), ASK)
    release.set()
    assert await lane.lane.drain(60) is True
    assert (await task).std.shape == (2, D_MODEL)


@pytest.mark.parametrize(
    ("raised", "answered", "message"),
    [
        (MemoryError, errors.InsufficientMemory, "6 passes over 4 rows do not fit"),
        (RuntimeError, errors.ModelError, "the Monte Carlo dropout passes failed: RuntimeError"),
    ],
)
async def test_a_failing_pass_is_answered_and_the_lane_goes_on(
    lane: Lane, monkeypatch: pytest.MonkeyPatch, raised: type[Exception], answered: type[Exception], message: str
) -> None:
    def fail(x: torch.Tensor) -> torch.Tensor:
        raise raised("injected")

    monkeypatch.setattr(lane.model, "hidden", fail)
    with pytest.raises(answered, match=message):
        await lane.lane.submit(rows(4), ASK)
    monkeypatch.undo()
    assert (await lane.lane.submit(rows(4), ASK)).mean.shape == (4, D_MODEL)
    assert lane.count("ffn_failed_request_seconds_count") == 1 and lane.count("ffn_compute_seconds_count") == 1
