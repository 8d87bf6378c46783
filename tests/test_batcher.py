"""Batcher unit tests: plain asyncio with a fake forward that records the batches it sees."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from app.engine.batcher import Batcher
from app.engine.errors import DeadlineExceeded, ModelError, NotTogether, Overloaded, RequestTooLarge, Unavailable
from app.observe.identity import CURRENT, RequestContext
from app.observe.logs import RequestIds
from app.observe.metrics import Metrics
from ffn_core.dtypes import DTYPES

D = 4


class RecordingForward:
    """y = 2x + 1 on the concatenated rows; records each batch's part sizes. Can be held or made to fail."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.release = threading.Event()
        self.release.set()
        self.started = threading.Event()
        self.fail_with: Exception | None = None

    def __call__(self, parts):
        self.batches.append([p.shape[0] for p in parts])
        self.started.set()
        self.release.wait(5)
        if self.fail_with is not None:
            raise self.fail_with
        return torch.cat(list(parts)) * 2 + 1


def rows(n: int, start: float = 0.0) -> torch.Tensor:
    return torch.arange(start, start + n * D, dtype=torch.float32).view(n, D)


@pytest.fixture
def executor():
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool


async def make(forward, executor, **kwargs) -> Batcher:
    batcher = Batcher(forward, executor=executor, metrics=Metrics(), **kwargs)
    await batcher.start()
    return batcher


async def answers_right(batcher: Batcher, x: torch.Tensor) -> None:
    """The batcher still answers 2x + 1 for `x` (computed here by hand): its collector is alive."""
    out = await asyncio.wait_for(batcher.submit(x), 2)
    assert torch.equal(out, x * 2 + 1)


async def hold(forward: RecordingForward, batcher: Batcher, first: torch.Tensor) -> asyncio.Task[torch.Tensor]:
    """Submit `first` and return once its forward pass runs, held there until forward.release is set."""
    forward.release.clear()
    task = asyncio.create_task(batcher.submit(first))
    await asyncio.to_thread(forward.started.wait, 5)
    return task


async def test_lone_request_waits_max_wait(executor):
    forward = RecordingForward()
    batcher = await make(forward, executor, max_batch_rows=64, max_wait_s=0.3)
    loop = asyncio.get_running_loop()
    began = loop.time()
    task = asyncio.create_task(batcher.submit(rows(1)))
    await asyncio.sleep(0.15)
    assert forward.batches == [], "a partial batch must wait for max_wait"
    out = await task
    assert loop.time() - began >= 0.29
    assert torch.equal(out, rows(1) * 2 + 1)
    await batcher.stop()


async def test_greedy_lone_request_goes_at_once(executor):
    forward = RecordingForward()
    batcher = await make(forward, executor, max_batch_rows=64, max_wait_s=0.0)
    out = await asyncio.wait_for(batcher.submit(rows(3)), 2)
    assert forward.batches == [[3]]
    assert torch.equal(out, rows(3) * 2 + 1)
    await batcher.stop()


async def test_full_batch_goes_at_once_despite_long_wait(executor):
    forward = RecordingForward()
    batcher = await make(forward, executor, max_batch_rows=8, max_wait_s=30.0)
    results = await asyncio.wait_for(asyncio.gather(*(batcher.submit(rows(4, 100 * i)) for i in range(2))), 5)
    assert forward.batches == [[4, 4]]
    for i, out in enumerate(results):
        assert torch.equal(out, rows(4, 100 * i) * 2 + 1)
    await batcher.stop()


async def test_arrivals_during_a_forward_form_the_next_batch(executor):
    forward = RecordingForward()
    batcher = await make(forward, executor, max_batch_rows=64, max_wait_s=0.0)
    first = await hold(forward, batcher, rows(2))
    later = [asyncio.create_task(batcher.submit(rows(n, 10 * n))) for n in (1, 2, 3)]
    await asyncio.sleep(0.05)
    forward.release.set()
    outs = await asyncio.wait_for(asyncio.gather(first, *later), 5)
    assert forward.batches == [[2], [1, 2, 3]]
    for n, out in zip((1, 2, 3), outs[1:], strict=True):
        assert torch.equal(out, rows(n, 10 * n) * 2 + 1)
    await batcher.stop()


async def test_oversized_request_is_chunked_and_reassembled_in_order(executor):
    forward = RecordingForward()
    batcher = await make(forward, executor, max_batch_rows=8, max_wait_s=0.0)
    x = rows(21)
    out = await asyncio.wait_for(batcher.submit(x), 5)
    assert sum(sum(b) for b in forward.batches) == 21
    assert all(sum(b) <= 8 for b in forward.batches)
    assert sorted(n for b in forward.batches for n in b) == [5, 8, 8]
    assert torch.equal(out, x * 2 + 1)
    await batcher.stop()


async def test_cancelled_entry_is_skipped(executor):
    forward = RecordingForward()
    batcher = await make(forward, executor, max_batch_rows=64, max_wait_s=0.0)
    blocker = await hold(forward, batcher, rows(1))
    gone = asyncio.create_task(batcher.submit(rows(5)))
    kept = asyncio.create_task(batcher.submit(rows(7)))
    await asyncio.sleep(0.02)
    gone.cancel()
    await asyncio.sleep(0.02)
    assert batcher.queued_work == 7, "a cancelled entry no longer counts against the queue"
    forward.release.set()
    await asyncio.wait_for(asyncio.gather(blocker, kept), 5)
    assert forward.batches == [[1], [7]]
    with pytest.raises(asyncio.CancelledError):
        await gone
    await batcher.stop()


async def test_deadline_passed_in_queue_gives_504_and_no_compute(executor):
    forward = RecordingForward()
    batcher = await make(forward, executor, max_batch_rows=64, max_wait_s=0.0)
    blocker = await hold(forward, batcher, rows(1))
    loop = asyncio.get_running_loop()
    late = asyncio.create_task(batcher.submit(rows(3), deadline=loop.time() + 0.05))
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(late, 2)
    forward.release.set()
    await blocker
    assert forward.batches == [[1]]
    await batcher.stop()


async def test_queue_full_is_overloaded_and_too_big_is_413(executor):
    forward = RecordingForward()
    batcher = await make(forward, executor, max_batch_rows=4, max_wait_s=0.0, max_queue_rows=10)
    blocker = await hold(forward, batcher, rows(1))
    waiting = asyncio.create_task(batcher.submit(rows(8)))
    await asyncio.sleep(0.01)
    with pytest.raises(Overloaded) as info:
        await batcher.submit(rows(3))
    assert info.value.retry_after_s == 1
    with pytest.raises(RequestTooLarge):
        await batcher.submit(rows(11))
    forward.release.set()
    await asyncio.wait_for(asyncio.gather(blocker, waiting), 5)
    await batcher.stop()


async def test_stop_answers_every_pending_entry(executor):
    forward = RecordingForward()
    batcher = await make(forward, executor, max_batch_rows=4, max_wait_s=10.0)
    pending = [asyncio.create_task(batcher.submit(rows(1))) for _ in range(3)]
    await asyncio.sleep(0.02)
    await batcher.stop()
    for task in pending:
        with pytest.raises(Unavailable):
            await asyncio.wait_for(task, 2)
    with pytest.raises(Unavailable):
        await batcher.submit(rows(1))


@pytest.mark.parametrize("inline_rows", [0, 64], ids=["on the model thread", "on the loop's thread"])
async def test_forward_error_fails_only_that_batch(executor, inline_rows):
    forward = RecordingForward()
    batcher = await make(forward, executor, max_batch_rows=64, max_wait_s=0.0)
    batcher.inline_rows = inline_rows
    forward.fail_with = RuntimeError("boom")
    with pytest.raises(ModelError):
        await asyncio.wait_for(batcher.submit(rows(2)), 2)
    forward.fail_with = None
    await answers_right(batcher, rows(2))
    await batcher.stop()


async def test_drain_finishes_accepted_work_then_refuses(executor):
    forward = RecordingForward()
    batcher = await make(forward, executor, max_batch_rows=2, max_wait_s=0.0)
    tasks = [asyncio.create_task(batcher.submit(rows(2, i))) for i in range(5)]
    await asyncio.sleep(0)
    assert await batcher.drain(5.0)
    # Every request was computed by the time the drain returned; each task takes its answer at its
    # next turn of the loop (reading `task.result()` at once failed a busy CI run).
    assert [size for batch in forward.batches for size in batch] == [2] * 5
    for i, answer in enumerate(await asyncio.gather(*tasks)):
        assert torch.equal(answer, rows(2, i) * 2 + 1)
    with pytest.raises(Unavailable):
        await batcher.submit(rows(1))
    await batcher.stop()


async def test_an_already_expired_entry_is_never_computed(executor):
    forward = RecordingForward()
    batcher = await make(forward, executor, max_batch_rows=64, max_wait_s=0.0)
    loop = asyncio.get_running_loop()
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(batcher.submit(rows(2), deadline=loop.time() - 0.001), 2)
    assert forward.batches == []
    await batcher.stop()


# ----- launched batches in flight (the staged GPU runner's way) ----------------------------------


class HeldAnswer:
    """A launched batch's answer, held until `release` is set (a GPU still computing)."""

    def __init__(self, output: torch.Tensor) -> None:
        self.output = output
        self.release = threading.Event()

    def done(self) -> bool:
        return self.release.is_set()

    def wait(self) -> torch.Tensor:
        assert self.release.wait(5), "the test never released this batch"
        return self.output


class RecordingLaunch:
    """launch(parts) -> HeldAnswer of 2x + 1; records each batch's part sizes when it is launched."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.answers: list[HeldAnswer] = []

    def __call__(self, parts):
        answer = HeldAnswer(torch.cat(list(parts)) * 2 + 1)
        self.answers.append(answer)  # before the batch is counted: launched() then sees its answer too
        self.batches.append([p.shape[0] for p in parts])
        return answer

    async def launched(self, count: int) -> None:
        for _ in range(500):
            if len(self.batches) >= count:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{count} batches never launched: {self.batches}")


async def make_launched(executor, max_in_flight: int) -> tuple[Batcher, RecordingLaunch]:
    launch = RecordingLaunch()
    batcher = await make(
        lambda parts: launch(parts).wait(), executor, max_batch_rows=64, launch=launch, max_in_flight=max_in_flight
    )
    return batcher, launch


async def test_the_next_batch_is_launched_while_the_last_one_computes(executor):
    batcher, launch = await make_launched(executor, max_in_flight=2)
    first = asyncio.create_task(batcher.submit(rows(2)))
    await launch.launched(1)
    second = asyncio.create_task(batcher.submit(rows(3, 100)))
    await launch.launched(2)  # launched although the first answer is still held
    assert not first.done() and launch.batches == [[2], [3]]
    third = asyncio.create_task(batcher.submit(rows(1, 200)))
    await asyncio.sleep(0.05)
    assert len(launch.batches) == 2, "two in flight at most"
    launch.answers[1].release.set()  # answers may land out of order
    assert torch.equal(await asyncio.wait_for(second, 2), rows(3, 100) * 2 + 1)
    await launch.launched(3)
    for answer in launch.answers:
        answer.release.set()
    assert torch.equal(await asyncio.wait_for(first, 2), rows(2) * 2 + 1)
    assert torch.equal(await asyncio.wait_for(third, 2), rows(1, 200) * 2 + 1)
    await batcher.stop()


async def test_one_in_flight_launches_after_the_last_answer(executor):
    batcher, launch = await make_launched(executor, max_in_flight=1)
    first = asyncio.create_task(batcher.submit(rows(2)))
    await launch.launched(1)
    second = asyncio.create_task(batcher.submit(rows(3, 100)))
    await asyncio.sleep(0.05)
    assert launch.batches == [[2]]
    launch.answers[0].release.set()
    await launch.launched(2)
    launch.answers[1].release.set()
    await asyncio.wait_for(asyncio.gather(first, second), 2)
    await batcher.stop()


async def test_stop_fails_the_batches_in_flight_and_drain_waits_for_them(executor):
    batcher, launch = await make_launched(executor, max_in_flight=2)
    held = [asyncio.create_task(batcher.submit(rows(1, i))) for i in range(2)]
    await launch.launched(1)
    draining = asyncio.create_task(batcher.drain(0.2))
    assert not await draining, "drain must wait for the batch in flight"
    await batcher.stop()
    for task in held:
        with pytest.raises(Unavailable):
            await asyncio.wait_for(task, 2)
    for answer in launch.answers:
        answer.release.set()  # let the executor threads finish


# ----- supervision: the collector outlives bugs, and says so when it cannot ---------------------


class RowDroppingForward(RecordingForward):
    """Breaks the batcher's invariant (rows out = rows in) on demand, as a buggy model could."""

    def __init__(self) -> None:
        super().__init__()
        self.drop_a_row = False

    def __call__(self, parts):
        out = super().__call__(parts)
        return out[1:] if self.drop_a_row else out


async def test_a_broken_invariant_fails_that_batch_and_the_collector_lives_on(executor, caplog):
    forward = RowDroppingForward()
    batcher = await make(forward, executor, max_batch_rows=64, max_wait_s=0.0)
    forward.drop_a_row = True
    with caplog.at_level("ERROR", logger="ffn_serve.batcher"):
        with pytest.raises(ModelError):
            await asyncio.wait_for(batcher.submit(rows(3)), 2)
    assert sum("failed unexpectedly" in r.getMessage() for r in caplog.records) == 1  # logged once
    forward.drop_a_row = False
    await answers_right(batcher, rows(2, 5.0))
    assert batcher.accepting and batcher.failure is None
    await batcher.stop()


async def test_a_bug_while_taking_a_batch_fails_the_taken_entries_not_the_collector(executor, monkeypatch):
    forward = RecordingForward()
    batcher = await make(forward, executor, max_batch_rows=64, max_wait_s=0.0)
    taken: list = []
    queue = batcher._queue
    real_take = queue.take

    def take_then_break(batch, ceiling):
        real_take(batch, ceiling)
        taken.extend(batch)
        raise KeyError("a bug after popping")

    monkeypatch.setattr(queue, "take", take_then_break)
    with pytest.raises(ModelError):
        await asyncio.wait_for(batcher.submit(rows(2)), 2)
    assert len(taken) == 1 and forward.batches == []
    monkeypatch.setattr(queue, "take", real_take)
    await answers_right(batcher, rows(1))
    await batcher.stop()


async def test_a_dead_collector_stops_accepting_fails_the_queue_and_says_why(executor):
    forward = RecordingForward()
    batcher = await make(forward, executor, max_batch_rows=1, max_wait_s=0.0)
    first = await hold(forward, batcher, rows(1))
    queued = asyncio.create_task(batcher.submit(rows(1, 9.0)))
    await asyncio.sleep(0.01)
    batcher._collector.cancel()  # killed from outside: not a stop()
    await asyncio.sleep(0.01)
    forward.release.set()
    # The batch in the dead collector's hands is answered 503; what waited in the queue, 500.
    with pytest.raises(Unavailable):
        await asyncio.wait_for(first, 2)
    with pytest.raises(ModelError, match="stopped unexpectedly"):
        await asyncio.wait_for(queued, 2)
    assert not batcher.accepting
    assert batcher.failure is not None and "stopped unexpectedly" in batcher.failure
    with pytest.raises(Unavailable, match="stopped unexpectedly"):
        await batcher.submit(rows(1))
    await batcher.stop()


async def test_after_inline_passes_the_loop_gets_more_turns_only_while_requests_come_together(executor):
    """Lone requests: one turn after each inline pass (under a flood each turn is long); concurrent ones: three."""
    batch_entries: list[int] = []

    def forward(parts):
        batch_entries.append(len(parts))
        return torch.cat(list(parts)) * 2 + 1

    batcher = await make(forward, executor, max_batch_rows=64)
    batcher.inline_rows = 64
    for n in (1, 2, 1):  # one client at a time
        x = rows(n, start=float(n))
        assert torch.equal(await asyncio.wait_for(batcher.submit(x), 5), x * 2 + 1)
    assert batch_entries == [1, 1, 1] and not batcher._concurrent
    # Several clients at once: they share a batch, and the batcher expects more of them.
    xs = [rows(1, start=10.0 * i) for i in range(4)]
    answers = await asyncio.wait_for(asyncio.gather(*(batcher.submit(x) for x in xs)), 5)
    assert all(torch.equal(y, x * 2 + 1) for x, y in zip(xs, answers, strict=True))
    assert batch_entries[3] > 1 and batcher._concurrent
    await batcher.stop()


async def test_batches_within_inline_rows_run_on_the_loops_thread_and_larger_ones_on_the_model_thread(executor):
    threads: list[tuple[int, str]] = []

    def forward(parts):
        threads.append((sum(p.shape[0] for p in parts), threading.current_thread().name))
        return torch.cat(list(parts)) * 2 + 1

    batcher = await make(forward, executor, max_batch_rows=64)
    batcher.inline_rows = 4
    for n in (1, 4, 5, 3):
        x = rows(n, start=10.0 * n)
        assert torch.equal(await asyncio.wait_for(batcher.submit(x), 5), x * 2 + 1)
    loop_thread = threading.current_thread().name
    assert [(n, name == loop_thread) for n, name in threads] == [(1, True), (4, True), (5, False), (3, True)]
    await batcher.stop()


def counter(metrics: Metrics) -> Callable[[str], float]:
    """A reader of the batcher's model series by name (0 where none was recorded yet)."""
    return lambda name: metrics.registry.get_sample_value(name, {"model": "model"}) or 0.0


async def test_requests_offered_together_are_one_entry_and_counted_one_by_one(executor):
    forward = RecordingForward()
    metrics = Metrics()
    batcher = Batcher(forward, executor=executor, metrics=metrics, max_batch_rows=64)
    await batcher.start()
    count = counter(metrics)
    x = rows(6)
    out = await asyncio.wait_for(batcher.submit_soon(x, requests=[1, 3, 2]), 5)
    assert torch.equal(out, x * 2 + 1)
    assert forward.batches == [[6]]  # one entry
    assert count("ffn_request_rows_count") == 3 and count("ffn_request_rows_sum") == 6
    assert count("ffn_request_seconds_count") == 3
    assert count("ffn_queue_seconds_count") == 3
    assert count("ffn_failed_request_seconds_count") == 0
    await batcher.stop()


async def test_requests_that_do_not_fit_together_are_refused_uncounted_and_fit_one_by_one(executor):
    forward = RecordingForward()
    metrics = Metrics()
    batcher = Batcher(forward, executor=executor, metrics=metrics, max_batch_rows=4, max_queue_rows=10)
    await batcher.start()
    count = counter(metrics)
    with pytest.raises(NotTogether):
        batcher.submit_soon(rows(12), requests=[4, 4, 4])  # 12 rows: the queue holds 10, each request fits
    assert batcher.queued_work == 0
    assert count("ffn_request_rows_count") == 0 and count("ffn_failed_request_seconds_count") == 0
    for i in range(3):  # offered one by one, each gets its own verdict: here, its answer
        assert torch.equal(await asyncio.wait_for(batcher.submit(rows(4, 16 * i)), 5), rows(4, 16 * i) * 2 + 1)
    assert count("ffn_request_rows_count") == 3 and count("ffn_failed_request_seconds_count") == 0
    with pytest.raises(RequestTooLarge):  # one request past the queue is still 413, as a lone request is
        batcher.submit_soon(rows(11))
    await batcher.stop()


async def test_a_group_refused_for_all_counts_each_request_failed(executor):
    forward = RecordingForward()
    metrics = Metrics()
    batcher = Batcher(forward, executor=executor, metrics=metrics)
    count = counter(metrics)
    with pytest.raises(Unavailable):  # not started: nothing is accepted, for any of them
        batcher.submit_soon(rows(3), requests=[1, 2])
    assert count("ffn_failed_request_seconds_count") == 2


async def test_cancelling_a_future_from_submit_soon_withdraws_its_rows(executor):
    forward = RecordingForward()
    metrics = Metrics()
    batcher = Batcher(forward, executor=executor, metrics=metrics, max_batch_rows=4)
    await batcher.start()
    count = counter(metrics)
    blocker = await hold(forward, batcher, rows(1))
    waiting = batcher.submit_soon(rows(3), requests=[1, 2])
    assert batcher.queued_work == 3
    waiting.cancel()
    await asyncio.sleep(0)  # its callback runs
    assert batcher.queued_work == 0
    assert count("ffn_failed_request_seconds_count") == 2
    forward.release.set()
    await asyncio.wait_for(blocker, 5)
    assert forward.batches == [[1]]  # the withdrawn rows were never computed
    await batcher.stop()


async def test_a_batcher_started_while_a_request_is_served_stamps_none_of_its_lines_with_that_requests_id(executor):
    # A model loaded through model control starts its batcher inside the load request. Its collector
    # task took that request's context with it, and every line it logged afterwards (a failed forward
    # pass, an OOM split) carried the load request's id, as the batch spans would its trace.
    forward = RecordingForward()
    token = CURRENT.set(RequestContext("the-load-request"))
    try:
        batcher = await make(forward, executor, max_batch_rows=64, max_wait_s=0.0)
    finally:
        CURRENT.reset(token)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.addFilter(RequestIds())
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("ffn_serve.batcher")
    logger.addHandler(handler)
    try:
        forward.fail_with = RuntimeError("boom")
        with pytest.raises(ModelError):
            await asyncio.wait_for(batcher.submit(rows(2)), 2)
    finally:
        logger.removeHandler(handler)
        await batcher.stop()
    assert [record.request_id for record in records if "forward pass failed" in record.getMessage()] == [None]


async def test_request_rows_and_the_queue_gauge_are_exact_once_the_turn_ends(executor):
    """Observed once per turn of the loop (PerTurnCounts), every request's rows are counted and the
    gauge shows the queue's work as the turn left it, before the next turn (a scrape's) can read them."""
    forward = RecordingForward()
    metrics = Metrics()
    batcher = Batcher(forward, executor=executor, metrics=metrics, max_batch_rows=64)
    await batcher.start()
    count = counter(metrics)
    first = await hold(forward, batcher, rows(1))  # its pass runs, held: what follows waits in the queue
    assert count("ffn_request_rows_count") == 1 and count("ffn_queue_rows") == 0
    queued = [batcher.submit_array(rows(n).numpy(), DTYPES["float32"]) for n in (2, 3, 4)]  # one turn
    await asyncio.sleep(0)
    assert count("ffn_request_rows_count") == 4 and count("ffn_request_rows_sum") == 1 + 2 + 3 + 4
    buckets = {
        bound: metrics.registry.get_sample_value("ffn_request_rows_bucket", {"model": "model", "le": bound})
        for bound in ("1.0", "2.0", "4.0")
    }
    assert buckets == {"1.0": 1, "2.0": 2, "4.0": 4}
    assert count("ffn_queue_rows") == 9
    queued[1].cancel()  # its client left: its rows leave the queue's work as its callback runs, a turn later
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert count("ffn_queue_rows") == 6
    forward.release.set()
    assert torch.equal(await asyncio.wait_for(first, 5), rows(1) * 2 + 1)
    for n, future in ((2, queued[0]), (4, queued[2])):
        np.testing.assert_array_equal(await asyncio.wait_for(future, 5), rows(n).numpy() * 2 + 1)
    await asyncio.sleep(0)
    assert count("ffn_queue_rows") == 0 and count("ffn_request_rows_count") == 4
    await batcher.stop()


async def test_array_entries_are_told_their_end_once_and_a_failing_callback_harms_no_other(executor, caplog):
    """submit_array's `settled`: told its answer by its batch, its cancellation or failure as a callback;
    once each; a callback that raises is logged, and the batch's other requests still get theirs."""
    forward = RecordingForward()
    batcher = await make(forward, executor, max_batch_rows=64)
    first = await hold(forward, batcher, rows(1))  # what follows waits for one batch together
    told: dict[str, list[object]] = {}

    def settled(name: str, *, fails: bool = False) -> Callable[[asyncio.Future[np.ndarray]], None]:
        def tell(future: asyncio.Future[np.ndarray]) -> None:
            outcome = "cancelled" if future.cancelled() else future.exception() or future.result().copy()
            told.setdefault(name, []).append(outcome)
            if fails:
                raise RuntimeError("a caller's bug")

        return tell

    float32 = DTYPES["float32"]
    a = batcher.submit_array(rows(2, 1.0).numpy(), float32, settled=settled("a"))
    b = batcher.submit_array(rows(1, 2.0).numpy(), float32, settled=settled("b", fails=True))
    c = batcher.submit_array(rows(3, 3.0).numpy(), float32, settled=settled("c"))
    d = batcher.submit_array(rows(1, 4.0).numpy(), float32, settled=settled("d"))
    expired = batcher.submit_array(rows(1, 5.0).numpy(), float32, deadline=0.0, settled=settled("expired"))
    c.cancel()
    with caplog.at_level(logging.ERROR, logger="ffn_serve.batcher"):
        forward.release.set()
        await asyncio.wait_for(first, 5)
        for future in (a, b, d):
            await asyncio.wait_for(future, 5)
        with pytest.raises(DeadlineExceeded):
            await asyncio.wait_for(expired, 5)
        await asyncio.sleep(0)
    for name, x in (("a", rows(2, 1.0)), ("b", rows(1, 2.0)), ("d", rows(1, 4.0))):
        (answer,) = told[name]
        np.testing.assert_array_equal(answer, x.numpy() * 2 + 1)
    assert told["c"] == ["cancelled"]
    (error,) = told["expired"]
    assert isinstance(error, DeadlineExceeded)
    assert forward.batches == [[1], [2 + 1 + 1]]  # one part of a, b and d's rows: c withdrawn, expired never computed
    assert "answer callback failed" in caplog.text
    await answers_right(batcher, rows(2))
    await batcher.stop()


async def test_an_answered_batch_lets_its_rows_go_while_the_collector_waits_for_the_next(executor):
    """A batch's rows go with its answers, not when the next request comes: the layout's engine reads a
    request's rows in place in a front's slot memory, which it can unmap only once no array views it."""
    batcher = await make(RecordingForward(), executor, max_batch_rows=64)
    # On the loop's thread: a pass on the model thread leaves its arguments to the executor's worker,
    # which lets them go when that thread next runs, whenever a loaded machine schedules it.
    batcher.inline_rows = 64
    gc.disable()
    try:
        x = rows(2, 3.0).numpy()
        held = weakref.ref(x)
        future = batcher.submit_array(x, DTYPES["float32"])
        np.testing.assert_array_equal(await asyncio.wait_for(future, 5), rows(2, 3.0).numpy() * 2 + 1)
        del x, future
        for _ in range(10):  # the collector's turns after the pass; then it waits, with no request to come
            await asyncio.sleep(0)
        assert held() is None
    finally:
        gc.enable()
    await batcher.stop()


async def test_an_answered_array_entry_and_its_batch_are_freed_without_the_garbage_collector(executor):
    """Nothing of an answered request (its entry, its future, the batch's output) waits for a collection:
    a cycle among them would keep every batch's input and output alive until the collector ran."""
    batcher = await make(RecordingForward(), executor, max_batch_rows=64)
    outputs: list[weakref.ref[np.ndarray]] = []

    def keep(future: asyncio.Future[np.ndarray]) -> None:
        outputs.append(weakref.ref(future.result().base))

    gc.disable()
    try:
        for i in range(3):  # each batch's list of entries goes once it is answered
            future = batcher.submit_array(rows(2, 10.0 * i).numpy(), DTYPES["float32"], settled=keep)
            np.testing.assert_array_equal(await asyncio.wait_for(future, 5), rows(2, 10.0 * i).numpy() * 2 + 1)
            del future
        await answers_right(batcher, rows(1))
        assert len(outputs) == 3 and all(output() is None for output in outputs)
    finally:
        gc.enable()
    await batcher.stop()
