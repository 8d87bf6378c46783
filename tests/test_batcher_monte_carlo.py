"""Monte Carlo dropout requests in the Batcher: admitted by rows × passes, run in slices between plain
batches, expired at their deadline, drained and stopped like any entry.

The device thread is held by a blocked call, never by timing; the order of what ran on it is recorded.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
import torch

from app.engine import errors
from app.engine.batcher import Batcher
from app.engine.montecarlo import MonteCarloRequest
from app.observe.metrics import Metrics
from ffn_core import FFNConfig, MonteCarloPasses, build_ffn, mc_dropout
from ffn_testing import metric_value

D_MODEL, D_FF = 8, 32
ASK = MonteCarloRequest(passes=6, dropout=0.25, seed=11)


@dataclass
class Device:
    """The model's forward and Monte Carlo passes on one thread, recording each call; `hold()` blocks the next."""

    model: torch.nn.Module
    calls: list[tuple[str, int]] = field(default_factory=list)  # ("plain", rows) or ("mc", passes)
    held: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    holding: bool = False
    fail_with: type[Exception] | None = None

    def hold(self) -> None:
        self.holding, self.release = True, threading.Event()
        self.held.clear()

    def _wait_if_held(self) -> None:
        if self.holding:
            self.holding = False
            self.held.set()
            self.release.wait(60)

    def forward(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        self.calls.append(("plain", sum(p.shape[0] for p in parts)))
        self._wait_if_held()
        with torch.inference_mode():
            return self.model(torch.cat(list(parts)))

    def start(self, rows: torch.Tensor, request: MonteCarloRequest) -> MonteCarloPasses:
        if self.fail_with is not None:
            raise self.fail_with("injected")
        device = self

        class Recorded(MonteCarloPasses):
            def run(self, passes: int) -> None:
                device.calls.append(("mc", min(passes, self.remaining)))
                device._wait_if_held()
                super().run(passes)

        return Recorded(self.model, rows, passes=request.passes, p=request.dropout, seed=request.seed)


@dataclass
class Setup:
    batcher: Batcher
    device: Device
    metrics: Metrics

    def count(self, series: str) -> float:
        return metric_value(self.metrics.render().decode(), series, model="m")

    async def held(self) -> None:
        """Wait until the device thread is blocked in the call `device.hold()` marked."""
        assert await asyncio.to_thread(self.device.held.wait, 60)


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    torch.manual_seed(0)
    device = Device(build_ffn(FFNConfig(D_MODEL, D_FF, "gelu", gated=True, dropout=0.25)))
    metrics = Metrics()
    with ThreadPoolExecutor(max_workers=1) as executor:
        batcher = Batcher(
            device.forward,
            name="m",
            max_batch_rows=4,
            max_queue_rows=40,
            executor=executor,
            metrics=metrics,
            monte_carlo=device.start,
        )
        await batcher.start()
        yield Setup(batcher, device, metrics)
        device.release.set()
        await batcher.stop()


def rows(n: int) -> torch.Tensor:
    return torch.randn(n, D_MODEL, generator=torch.Generator().manual_seed(n))


async def until_queued(batcher: Batcher, work: int) -> None:
    while batcher.queued_work != work:
        await asyncio.sleep(0.001)


async def test_the_answer_is_mc_dropout_of_the_rows_and_is_counted_as_one_pass(setup: Setup) -> None:
    x = rows(2)
    result = await setup.batcher.submit_monte_carlo(x, ASK)
    mean, std = mc_dropout(setup.device.model, x, passes=6, p=0.25, seed=11)
    assert torch.equal(result.mean, mean) and torch.equal(result.std, std)
    # 4 row-passes a slice (max_batch_rows) over 2 rows: 2 passes at a time.
    assert setup.device.calls == [("mc", 2), ("mc", 2), ("mc", 2)]
    assert setup.count("ffn_compute_seconds_count") == 1 and setup.count("ffn_batch_rows_sum") == 2
    assert setup.count("ffn_request_seconds_count") == 1 and setup.count("ffn_queue_seconds_count") == 1
    assert setup.count("ffn_request_compute_seconds_total") > 0
    assert setup.batcher.queued_work == 0


async def test_plain_rows_take_turns_with_the_slices(setup: Setup) -> None:
    """A plain request that arrives during a long Monte Carlo request waits one slice, not the whole request."""
    setup.device.hold()
    long = asyncio.create_task(setup.batcher.submit_monte_carlo(rows(2), MonteCarloRequest(8, 0.25, 1)))
    await setup.held()  # the first slice runs, held
    plain = [asyncio.create_task(setup.batcher.submit(rows(1))) for _ in range(2)]
    await until_queued(setup.batcher, 2 * 8 + 2)
    setup.device.release.set()
    await asyncio.gather(*plain, long)
    assert setup.device.calls == [("mc", 2), ("plain", 2), ("mc", 2), ("mc", 2), ("mc", 2)]


async def test_admitted_by_rows_times_passes(setup: Setup) -> None:
    with pytest.raises(
        errors.RequestTooLarge, match="4 rows × 12 passes = 48; this model queues at most 40 row-passes"
    ):
        await setup.batcher.submit_monte_carlo(rows(4), MonteCarloRequest(12, 0.25, 1))
    with pytest.raises(errors.RequestTooLarge, match="at most 4 rows"):
        await setup.batcher.submit_monte_carlo(rows(5), ASK)
    setup.device.hold()
    first = asyncio.create_task(setup.batcher.submit(rows(1)))
    await setup.held()
    waiting = asyncio.create_task(setup.batcher.submit_monte_carlo(rows(4), MonteCarloRequest(9, 0.25, 1)))
    await until_queued(setup.batcher, 36)
    with pytest.raises(errors.Overloaded, match="36 of 40 rows waiting"):
        await setup.batcher.submit(rows(5))
    setup.device.release.set()
    await first
    assert (await waiting).mean.shape == (4, D_MODEL)
    assert setup.count("ffn_failed_request_seconds_count") == 3


async def test_a_deadline_passed_before_its_turn_is_504_and_never_computed(setup: Setup) -> None:
    setup.device.hold()
    first = asyncio.create_task(setup.batcher.submit(rows(1)))
    await setup.held()
    deadline = asyncio.get_running_loop().time() + 0.05
    with pytest.raises(errors.DeadlineExceeded, match="queued"):
        await setup.batcher.submit_monte_carlo(rows(2), ASK, deadline=deadline)
    setup.device.release.set()
    await first
    await setup.batcher.submit(rows(1))  # runs after the collector has passed the expired entry
    assert [kind for kind, _ in setup.device.calls] == ["plain", "plain"]
    assert setup.batcher.queued_work == 0


async def test_a_deadline_passed_between_slices_stops_the_passes(setup: Setup) -> None:
    setup.device.hold()
    # Long enough for the batcher to take the request into its first slice on a loaded machine
    # (with 50 ms, a run beside other work once saw the deadline pass while it still queued).
    deadline = asyncio.get_running_loop().time() + 1.0
    task = asyncio.create_task(
        setup.batcher.submit_monte_carlo(rows(2), MonteCarloRequest(8, 0.25, 1), deadline=deadline)
    )
    await setup.held()  # in its first slice; the deadline passes meanwhile
    with pytest.raises(errors.DeadlineExceeded, match="after 0 of 8 Monte Carlo passes"):
        await task
    setup.device.release.set()
    await setup.batcher.submit(rows(1))
    assert setup.device.calls == [("mc", 2), ("plain", 1)]  # no slice after the deadline
    assert setup.batcher.queued_work == 0


async def test_a_client_gone_between_slices_stops_the_passes(setup: Setup) -> None:
    setup.device.hold()
    task = asyncio.create_task(setup.batcher.submit_monte_carlo(rows(2), MonteCarloRequest(8, 0.25, 1)))
    await setup.held()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert setup.batcher.queued_work == 0  # released at once, not when its slice ends
    setup.device.release.set()
    await setup.batcher.submit(rows(1))
    assert setup.device.calls == [("mc", 2), ("plain", 1)]
    assert setup.count("ffn_compute_seconds_count") == 1  # the plain batch only
    assert setup.count("ffn_failed_request_seconds_count") == 1


async def test_stop_answers_the_running_and_the_waiting_503(setup: Setup) -> None:
    setup.device.hold()
    running = asyncio.create_task(setup.batcher.submit_monte_carlo(rows(2), ASK))
    await setup.held()  # mid-slice
    waiting = asyncio.create_task(setup.batcher.submit_monte_carlo(rows(1), ASK))
    await until_queued(setup.batcher, 12 + 6)
    await setup.batcher.stop()
    for task in (running, waiting):
        with pytest.raises(errors.Unavailable, match="shutting down"):
            await task
    setup.device.release.set()
    assert setup.device.calls == [("mc", 2)]


async def test_drain_waits_for_the_accepted_and_refuses_new_ones(setup: Setup) -> None:
    setup.device.hold()
    task = asyncio.create_task(setup.batcher.submit_monte_carlo(rows(2), ASK))
    await setup.held()
    assert await setup.batcher.drain(0.05) is False  # the device thread is held: not finished yet
    with pytest.raises(errors.Unavailable):
        await setup.batcher.submit_monte_carlo(rows(1), ASK)
    setup.device.release.set()
    assert await setup.batcher.drain(60) is True
    assert (await task).std.shape == (2, D_MODEL)


@pytest.mark.parametrize(
    ("raised", "answered", "message"),
    [
        (MemoryError, errors.InsufficientMemory, "6 passes over 2 rows do not fit"),
        (RuntimeError, errors.ModelError, "the Monte Carlo dropout passes failed: RuntimeError"),
    ],
)
async def test_a_failing_pass_is_answered_and_the_batcher_goes_on(
    setup: Setup, raised: type[Exception], answered: type[Exception], message: str
) -> None:
    setup.device.fail_with = raised
    with pytest.raises(answered, match=message):
        await setup.batcher.submit_monte_carlo(rows(2), ASK)
    setup.device.fail_with = None
    assert (await setup.batcher.submit_monte_carlo(rows(2), ASK)).mean.shape == (2, D_MODEL)
    assert torch.equal(await setup.batcher.submit(rows(1)), setup.device.forward([rows(1)]))
    assert setup.batcher.queued_work == 0
    assert setup.count("ffn_failed_request_seconds_count") == 1
