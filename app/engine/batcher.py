"""Batcher: a row-level async micro-batcher in front of one model, with its Monte Carlo requests.

Requests are split into entries of at most `max_batch_rows` rows and queued; a single collector
task cuts a batch when the queued rows reach `max_batch_rows`, or `max_wait_s` after the first
entry arrived (0 = greedy: whatever is queued goes at once, and whatever arrives during a
forward pass forms the next batch). The batch's rows are concatenated (the FFN is
position-wise, so no padding), run on the model's device thread and split back in order.
With a `launch` (the staged GPU runner), up to `max_in_flight` batches are in flight at once:
the next batch is launched on the device thread while the last one's answer is still being
computed, and each batch's answer is waited for off the device thread.

A Monte Carlo dropout request is queued beside the rows, never batched with them, and run in
slices of at most a batch's worth of row-passes; while plain rows wait, the collector takes
turns, a batch then a slice, so that a long Monte Carlo request delays a plain one by one slice
at most. Admission, deadlines, drain and stop are the same for both kinds: written once, here
and in the queue.

The queue is bounded in work (rows × passes): a request that does not fit is refused with
`Overloaded` before it is queued. An entry whose client left (cancelled future) or whose deadline
passed is skipped and never computed (further). Out of memory splits a batch in halves and
retries; only an entry that fails alone gets `InsufficientMemory`, and the batch size ceiling is lowered.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from contextvars import Context
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from app.engine.errors import (
    InsufficientMemory,
    ModelError,
    NotTogether,
    Overloaded,
    RequestTooLarge,
    Unavailable,
)
from app.engine.linger import Arrivals, Linger
from app.engine.montecarlo import MonteCarloRequest
from app.engine.observe import BatchObserver
from app.engine.queue import Entry, WorkQueue, fail
from app.engine.staging import Pending
from app.observe.metrics import Metrics, ModelInstruments, observe_many
from ffn_core import MonteCarloPasses
from ffn_core.dtypes import DType
from ffn_core.torch_dtypes import TORCH

log = logging.getLogger("ffn_serve.batcher")

# Told of a request's future once it is done (Batcher.submit_array's `settled`).
Settled = Callable[[asyncio.Future[np.ndarray]], None]
# forward(parts) -> the FFN of their concatenation, (sum of rows, d_model), on the host.
Forward = Callable[[Sequence[torch.Tensor]], torch.Tensor]

# launch(parts) -> Pending: enqueue the forward pass and return before it finishes.
Launch = Callable[[Sequence[torch.Tensor]], Pending]

# start(rows, request) -> the request's passes, none run yet (on the device thread: it computes the hidden layer).
StartMonteCarlo = Callable[[torch.Tensor, MonteCarloRequest], MonteCarloPasses]

OUT_OF_MEMORY = (MemoryError, torch.cuda.OutOfMemoryError)
# Turns of the loop after a pass on its thread, before the next batch is taken: as many while
# requests come concurrently (the last batch had several, or some arrived in the last turns),
# one while they come alone, when the turns only delay the next one (each turn is long under a
# flood of other connections' work).
INLINE_YIELDS = 3
INLINE_YIELDS_ALONE = 1

T = TypeVar("T")


@dataclass(frozen=True)
class Moments:
    """A Monte Carlo request's per-element mean and standard deviation (Bessel-corrected) over its passes,
    on the host in the compute dtype (ServedModel answers them as a MonteCarloResult, in the answer's dtype)."""

    mean: torch.Tensor  # (rows, d_model)
    std: torch.Tensor  # (rows, d_model)


def count_failure(instruments: ModelInstruments, arrived: float) -> None:
    """Count a request that arrived at `arrived` (perf_counter) and failed now: the statistics' `fail`."""
    instruments.failed_request_seconds.observe(time.perf_counter() - arrived)


class Batcher:
    """Queue, collector task and dispatch to the model thread for one model."""

    def __init__(
        self,
        forward: Forward,
        *,
        name: str = "model",
        max_batch_rows: int = 1024,
        max_wait_s: float = 0.0,
        linger_s: float = 0.0,
        arrivals: Arrivals | None = None,
        max_queue_rows: int = 16384,
        executor: Executor | None = None,
        metrics: Metrics | None = None,
        instruments: ModelInstruments | None = None,
        launch: Launch | None = None,
        max_in_flight: int = 1,
        monte_carlo: StartMonteCarlo | None = None,
    ) -> None:
        """`launch` (with `forward` kept for reference) lets `max_in_flight` batches overlap; without it, one at a time.

        `monte_carlo` starts a Monte Carlo request's passes; without it, such requests are refused.
        `linger_s`: with `max_wait_s` 0, how long a lone request may wait for others while waiting
        catches some (app/engine/linger.py); 0, never. `arrivals`: requests the process's doors have
        begun to receive, which a batch about to form lingers for too (within `linger_s`).
        `instruments`: the model's, bound already (every copy of a name shares them); else `metrics`'.
        """
        if max_batch_rows < 1 or max_queue_rows < 1 or max_wait_s < 0 or linger_s < 0 or max_in_flight < 1:
            raise ValueError(
                "max_batch_rows, max_queue_rows and max_in_flight must be >= 1, max_wait_s and linger_s >= 0"
            )
        self.name = name
        self.max_batch_rows = max_batch_rows
        self.max_wait_s = max_wait_s
        self._linger = Linger(linger_s) if linger_s > 0 and max_wait_s == 0 else None
        self._arrivals = arrivals
        self.max_queue_rows = max_queue_rows
        self._forward = forward
        self._launch = launch
        # Plain batches of at most this many rows run on the event loop's thread (see _compute).
        self.inline_rows = 0
        self._start_monte_carlo = monte_carlo
        self._executor = executor
        # One slot per batch in flight: the collector takes a batch only when it holds one.
        self._slots = asyncio.Semaphore(max_in_flight if launch is not None else 1)
        self._in_flight: set[asyncio.Task[None]] = set()
        self._ceiling = max_batch_rows  # lowered after out-of-memory
        self._instruments = instruments or (metrics or Metrics()).for_model(name)
        self._instruments.batch_ceiling.set(self._ceiling)
        self._per_turn = PerTurnCounts(self._instruments)
        self._queue = WorkQueue(on_work=self._per_turn.queue_work)
        self._plain_went_last = False  # whose turn it is when rows and a Monte Carlo request both wait
        self._concurrent = True  # requests came together lately: the turns after an inline pass are worth it
        self._arrived = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._collector: asyncio.Task[None] | None = None
        self._accepting = False
        self._stopping = False
        self.failure: str | None = None  # why the collector died, if it did
        self.on_failure: Callable[[str], None] | None = None  # told why, if the collector dies
        self.observer: BatchObserver | None = None  # told of every batch and slice (tracing)

    # ----- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        assert self._collector is None, "Batcher.start() called twice; this is a bug."
        self._accepting = True
        # In a context of its own: a model loaded through model control starts here inside the load
        # request, whose ids (and trace) would otherwise stamp every line the collector logs, and
        # every batch span, for the model's life.
        self._collector = asyncio.create_task(self._collect(), name=f"batcher-{self.name}", context=Context())
        self._collector.add_done_callback(self._collector_done)

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new work, then wait up to `timeout_s` for accepted work to finish. True if it did."""
        self._accepting = False
        try:
            async with asyncio.timeout(timeout_s):
                while self._queue.work or not self._idle.is_set():
                    await self._idle.wait()
                    await asyncio.sleep(0.002)  # let the collector take what is queued
        except TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        """Stop the collector and answer every entry still pending with `Unavailable`."""
        self._accepting = False
        self._stopping = True
        if self._collector is not None:
            self._collector.cancel()
            try:
                await self._collector
            except asyncio.CancelledError:
                pass
            self._collector = None
        running = list(self._in_flight)
        for task in running:
            task.cancel()  # each fails its own batch's entries as it ends
        await asyncio.gather(*running, return_exceptions=True)
        self._queue.fail_all(lambda: Unavailable("the server is shutting down"))

    # ----- public API ------------------------------------------------------------------------

    @property
    def queued_work(self) -> int:
        """Rows × passes accepted and not yet computed."""
        return self._queue.work

    @property
    def batch_ceiling(self) -> int:
        return self._ceiling

    @property
    def accepting(self) -> bool:
        return self._accepting

    async def submit(self, rows: torch.Tensor, *, deadline: float | None = None) -> torch.Tensor:
        """The model's output for `rows` (n, d_model), n >= 1. `deadline` is in loop.time() seconds."""
        return await self.submit_soon(rows, deadline=deadline)

    def submit_soon(
        self, rows: torch.Tensor, *, deadline: float | None = None, requests: Sequence[int] | None = None
    ) -> asyncio.Future[torch.Tensor]:
        """`submit` without a coroutine: admitted (or refused, raising) and queued now; the answer's future.

        Cancelling the future withdraws the rows. `requests`: the row counts of several requests
        whose rows `rows` holds back to back (one entry, one future, each counted as a request in
        the metrics and statistics), so that a caller with a turn's worth of requests (the
        hand-off's engine, a frame of a front's) pays neither a task nor an entry per request;
        NotTogether if the queue could take some of them but not all (nothing queued or counted).
        """
        sizes = (rows.shape[0],) if requests is None else tuple(requests)
        assert sum(sizes) == rows.shape[0] and min(sizes) >= 1, "requests must add up to the rows; this is a bug."
        n = rows.shape[0]
        if (
            len(sizes) > 1
            and self._accepting
            and (n > self.max_queue_rows or self._queue.work + n > self.max_queue_rows)
        ):
            raise NotTogether(f"{len(sizes)} requests of {n} rows in all do not fit the queue together")
        arrived = time.perf_counter()
        self._admit(n, 1, arrived, len(sizes))
        loop = asyncio.get_running_loop()
        now = loop.time()
        tag = None if self.observer is None else self.observer.tag()
        if n > self._ceiling:  # rare: more rows than a batch, answered in pieces
            chunks = rows.split(self._ceiling)
            entries = [Entry(chunk, loop.create_future(), now, arrived, deadline, tag=tag) for chunk in chunks]
            return asyncio.ensure_future(self._answer(entries, deadline, arrived, self._joined(entries), sizes))
        entry = Entry(rows, loop.create_future(), now, arrived, deadline, tag=tag, requests=len(sizes))
        self._count_rows(sizes)
        self._queue.push([entry], deadline)
        self._arrived.set()
        entry.future.add_done_callback(lambda future: self._settled(entry, future))
        return entry.future

    def submit_array(
        self,
        rows: np.ndarray,
        answer: DType,
        *,
        deadline: float | None = None,
        settled: Settled | None = None,
    ) -> asyncio.Future[np.ndarray]:
        """`submit_soon` for the doors' numpy rows: the answer's rows as an array carrying `answer`.

        Per request this is an entry, a future and its append; the rows stay numpy until their
        batch, which concatenates them and views them as a tensor once, and answers each entry a
        slice of the batch's output as one array (converted per entry only where a request asks
        for another dtype than the batch computed in). `rows`: (n, d_model), C-contiguous,
        bfloat16 as uint16 patterns; read in place, never written. Cancelling the future withdraws them.

        `settled`: called once with the future when it is done. Answered by its batch, at once,
        from the batch's completion: no turn of the loop and no callback scheduled per request
        between the pass and the answer. Failed, expired or cancelled, as a done-callback.
        """
        n = rows.shape[0]
        if n > self._ceiling:  # rare: more rows than a batch, answered in pieces as tensors
            converted = future_as_array(self.submit_soon(rows_as_tensor(rows), deadline=deadline), answer)
            if settled is not None:
                converted.add_done_callback(settled)
            return converted
        arrived = time.perf_counter()
        self._admit(n, 1, arrived)
        loop = asyncio.get_running_loop()
        tag = None if self.observer is None else self.observer.tag()
        entry = Entry(rows, loop.create_future(), loop.time(), arrived, deadline, tag=tag, answer=answer)
        entry.settled = settled
        self._per_turn.request_rows(n)
        self._queue.push([entry], deadline)
        self._arrived.set()
        entry.watch = functools.partial(self._settled, entry)  # kept: _split takes it off an answered entry
        entry.future.add_done_callback(entry.watch)
        return entry.future

    def _settled(self, entry: Entry, future: asyncio.Future[torch.Tensor]) -> None:
        """An entry's answer: its requests counted (an answered array entry was, with its batch, in _split);
        on failure or cancellation its rows are not wanted any more."""
        answered = not future.cancelled() and future.exception() is None
        if not (answered and entry.answer is not None):
            self._count_ended(entry.requests, entry.arrived, answered=answered)
        if not answered:
            self._queue.release(entry)
        entry.watch = None
        if entry.settled is not None:  # not answered by its batch (which took this callback off)
            settled, entry.settled = entry.settled, None
            settled(future)

    def _count_rows(self, sizes: Sequence[int]) -> None:
        """Requests of `sizes` rows queued: the request-rows histogram."""
        for size in sizes:
            self._per_turn.request_rows(size)

    def _count_ended(self, requests: int, arrived: float, *, answered: bool) -> None:
        """`requests` that arrived at `arrived` (perf_counter) ended now: their latency, or a failure each."""
        if answered:
            seconds = time.perf_counter() - arrived
            for _ in range(requests):
                self._instruments.request_seconds.observe(seconds)
        else:
            for _ in range(requests):
                count_failure(self._instruments, arrived)

    async def submit_monte_carlo(
        self, rows: torch.Tensor, request: MonteCarloRequest, *, deadline: float | None = None
    ) -> Moments:
        """Mean and std of `request.passes` dropout passes over `rows` (n, d_model). `deadline`: loop.time()."""
        arrived = time.perf_counter()
        n = rows.shape[0]
        if self._start_monte_carlo is None or n > self.max_batch_rows:
            count_failure(self._instruments, arrived)
            raise RequestTooLarge(
                f"a Monte Carlo dropout request may hold at most {self.max_batch_rows} rows "
                f"(max_batch_rows); this one has {n}"
            )
        self._admit(n, request.passes, arrived)
        loop = asyncio.get_running_loop()
        tag = None if self.observer is None else self.observer.tag()
        entry = Entry(rows, loop.create_future(), loop.time(), arrived, deadline, monte_carlo=request, tag=tag)
        return await self._answer([entry], deadline, arrived, entry.future)

    def _admit(self, n: int, passes: int, arrived: float, requests: int = 1) -> None:
        """Refuse, before anything is queued, work that cannot be taken now (503), ever (413), or yet (429).

        `requests`: how many requests the `n` rows are, each counted as failed when refused."""
        assert n >= 1, "empty requests must be refused before the batcher; this is a bug."
        error: Exception | None = None
        cost = n * passes
        if not self._accepting:
            error = Unavailable(self.failure or "the server is not accepting work (starting up or draining)")
        elif cost > self.max_queue_rows:
            what, unit = (
                (f"{n} rows", "rows") if passes == 1 else (f"{n} rows × {passes} passes = {cost}", "row-passes")
            )
            error = RequestTooLarge(f"request has {what}; this model queues at most {self.max_queue_rows} {unit}")
        elif self._queue.work + cost > self.max_queue_rows:
            error = Overloaded(
                f"queue full for model {self.name!r}: {self._queue.work} of {self.max_queue_rows} rows waiting",
                retry_after_s=1,
            )
        if error is not None:
            for _ in range(requests):
                count_failure(self._instruments, arrived)
            try:
                raise error
            finally:
                del error  # else this frame, in the error's traceback, holds the error: a cycle holding the request

    async def _answer(
        self,
        entries: list[Entry],
        deadline: float | None,
        arrived: float,
        answer: Awaitable[T],
        sizes: Sequence[int] = (),
    ) -> T:
        """Queue the entries and await `answer`; if it fails or the client goes, the rest is not wanted.

        `sizes`: the row counts of the requests the entries hold (default: one request)."""
        if entries[0].monte_carlo is None:
            self._count_rows(sizes or (sum(entry.n for entry in entries),))
        self._queue.push(entries, deadline)
        self._arrived.set()
        try:
            result = await answer
            self._count_ended(len(sizes) or 1, arrived, answered=True)
            return result
        except BaseException:
            self._count_ended(len(sizes) or 1, arrived, answered=False)
            for entry in entries:
                self._queue.release(entry)
                if entry.future.done() and not entry.future.cancelled():
                    entry.future.exception()  # retrieved: no "never retrieved" warning
                entry.future.cancel()
            raise

    @staticmethod
    async def _joined(entries: list[Entry]) -> torch.Tensor:
        return torch.cat([await entry.future for entry in entries])

    # ----- turns -----------------------------------------------------------------------------

    async def _wait_for_more(self) -> None:
        """With max_wait > 0: wait until the queue holds a full batch or the first entry's wait ends."""
        await self._gather_until(self._queue.first_enqueued_at() + self.max_wait_s, quiet_s=math.inf)

    def _lingers(self, linger: Linger) -> bool:
        """Whether the batch about to form waits for more: it would hold a lone request, or requests are
        on their way (Arrivals), and lingering pays lately (or it is time to probe)."""
        on_the_way = self._arrivals is not None and self._arrivals.on_the_way > 0
        return (on_the_way or self._queue.lone_plain()) and linger.worth_it()

    async def _linger_for_more(self, linger: Linger) -> int:
        """The batch about to form waits for others: until the queue holds a full batch, `linger.quiet_s`
        passes with no arrival, `linger.cap_s` has passed since its first request came (never past its
        deadline), or, where requests were announced on their way, none is left. Returns how many came."""
        first = self._queue.first_plain()
        cut_at = first.enqueued_at + linger.cap_s
        if first.deadline is not None:
            cut_at = min(cut_at, first.deadline - linger.cap_s)  # a tight deadline is not spent waiting
        before = self._queue.plain_count()
        arrivals = self._arrivals
        if arrivals is None or arrivals.on_the_way <= 0:
            await self._gather_until(cut_at, quiet_s=linger.quiet_s)
            return self._queue.plain_count() - before
        # Requests known to be coming: no quiet bound (a gRPC message can take longer than one to arrive
        # while the loop is busy), and woken when the last one is in, or ends without its rows.
        with arrivals.lingering(self._arrived.set):
            await self._gather_until(cut_at, quiet_s=math.inf, announced=arrivals)
        return self._queue.plain_count() - before

    async def _gather_until(self, cut_at: float, *, quiet_s: float, announced: Arrivals | None = None) -> None:
        """Let arrivals join the queue until it holds a full batch, `cut_at` (loop time), or `quiet_s` without
        one; with `announced`, until none of its requests is on its way any more, too."""
        loop = asyncio.get_running_loop()
        while self._queue.work < self._ceiling:
            if announced is not None and announced.on_the_way <= 0:
                return
            remaining = min(cut_at - loop.time(), quiet_s)
            if remaining <= 0:
                return
            self._arrived.clear()
            try:
                async with asyncio.timeout(remaining):
                    await self._arrived.wait()
            except TimeoutError:
                return

    async def _turns_after_inline_pass(self, entries: int) -> None:
        """The pass held the loop: let it read what arrived meanwhile and the requests reach the queue.

        So they join the next batch as they would have joined it during a pass on the model
        thread (a read, a task, its submit).
        """
        turns = INLINE_YIELDS if self._concurrent or entries > 1 else INLINE_YIELDS_ALONE
        for _ in range(turns):
            await asyncio.sleep(0)
        self._concurrent = entries > 1 or bool(self._queue)

    def _monte_carlo_turn(self) -> bool:
        """A Monte Carlo slice runs next if one waits and rows do not, or if the rows went last."""
        return self._queue.has_monte_carlo and (not self._queue.has_plain or self._plain_went_last)

    async def _collect(self) -> None:
        while True:
            if not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
                continue
            if self._monte_carlo_turn():
                await self._slots.acquire()
                self._plain_went_last = False
                entry = self._queue.next_monte_carlo()
                if entry is None:
                    self._slots.release()
                    continue
                await self._in_slot(self._run_slice(entry), [entry])
                del entry  # answered: its rows go now, not when the next request comes (see below)
                continue
            if self.max_wait_s > 0:
                await self._wait_for_more()
            elif self._linger is not None and self._lingers(self._linger):
                self._linger.caught(await self._linger_for_more(self._linger))
            await self._slots.acquire()  # what arrives meanwhile joins this batch
            self._plain_went_last = True
            batch: list[Entry] = []
            try:
                self._queue.take(batch, self._ceiling)
            except Exception as exc:  # a bug: the entries taken so far fail, the collector lives on
                self._slots.release()
                self._fail_after_bug(batch, exc)
                continue
            if not batch:
                self._slots.release()
                continue
            if self._launch is None:  # one batch at a time: run it here, with no task to schedule
                inline = self._runs_inline(sum(entry.n for entry in batch))
                await self._in_slot(self._run(batch), batch)
                taken = len(batch)
                # Answered: the batch's entries, and the rows they hold, go now. Kept in this frame, the
                # last batch's stayed while the collector waited for the next request, and with them a
                # front's slot memory the engine reads rows in place from (app/handoff/engine.py).
                del batch
                if inline:
                    await self._turns_after_inline_pass(taken)
                continue
            self._idle.clear()
            task = asyncio.create_task(self._in_slot(self._run(batch), batch), name=f"batch-{self.name}")
            del batch  # the task holds it, until its batch is answered
            self._in_flight.add(task)
            task.add_done_callback(self._landed)

    async def _in_slot(self, work: Awaitable[None], entries: list[Entry]) -> None:
        """Run `work` (a batch, or a slice) holding a slot; whatever goes wrong fails its entries alone."""
        self._idle.clear()
        try:
            await work
        except asyncio.CancelledError:
            # Stopped mid-pass (shutdown): nothing else would ever answer these entries.
            for entry in entries:
                fail(entry, Unavailable("the server is shutting down"))
            raise
        except Exception as exc:  # a bug (a broken invariant included): that batch fails, nothing else
            self._fail_after_bug(entries, exc)
        finally:
            self._slots.release()
            if not self._in_flight:
                self._idle.set()

    def _fail_after_bug(self, batch: list[Entry], exc: Exception) -> None:
        log.error(
            "model %s: batch of %d entries failed unexpectedly; this is a bug", self.name, len(batch), exc_info=exc
        )
        for entry in batch:
            fail(entry, ModelError(f"the batch failed: {type(exc).__name__}"))

    def _landed(self, task: asyncio.Task[None]) -> None:
        self._in_flight.discard(task)
        if not self._in_flight:
            self._idle.set()

    def _collector_done(self, task: asyncio.Task[None]) -> None:
        """The collector ended. Unless stop() ended it, it died: stop accepting and fail what waits."""
        if self._stopping:
            return
        error = None if task.cancelled() else task.exception()
        self.failure = f"the batcher stopped unexpectedly: {type(error).__name__ if error else 'cancelled'}"
        log.error(
            "model %s: %s; this model refuses work until the server restarts", self.name, self.failure, exc_info=error
        )
        self._accepting = False
        failure = self.failure
        self._queue.fail_all(lambda: ModelError(failure))
        if self.on_failure is not None:
            self.on_failure(self.failure)

    # ----- forward ---------------------------------------------------------------------------

    async def _run(self, batch: list[Entry]) -> None:
        started = time.perf_counter()
        observe_many(
            self._instruments.queue_seconds,
            [started - entry.arrived for entry in batch for _ in range(entry.requests)],
        )
        rows = sum(entry.n for entry in batch)
        try:
            output = await self._compute(_parts(batch))
        except OUT_OF_MEMORY:
            await self._split_after_oom(batch, rows)
            return
        except Exception as exc:
            log.exception("forward pass failed for model %s (%d rows)", self.name, rows)
            for entry in batch:
                fail(entry, ModelError(f"the forward pass failed: {type(exc).__name__}"))
            return
        elapsed = time.perf_counter() - started
        self._count_pass(elapsed, rows, sum(entry.requests for entry in batch))
        assert output.shape[0] == rows, f"forward returned {output.shape[0]} rows for {rows}; this is a bug."
        answered = self._split(batch, output)
        if answered:  # the array entries' latencies, observed together (their _settled counts nothing)
            now = time.perf_counter()
            observe_many(self._instruments.request_seconds, [now - entry.arrived for entry in answered])
        if self.observer is not None:  # before the waiters resume: they see their batch reported
            self.observer.batch(batch, started, started + elapsed, rows)
        self._deliver(answered)

    def _deliver(self, answered: list[Entry]) -> None:
        """Tell the answered entries that have a `settled` callback, now: the answer is written from the batch's
        completion. A caller's bug is logged, and the batch's other entries still get theirs."""
        for entry in answered:
            settled, entry.settled = entry.settled, None  # told once; the entry no longer holds its caller
            if settled is None:
                continue
            try:
                settled(entry.future)
            except Exception:
                log.exception("model %s: a request's answer callback failed; this is a bug", self.name)

    @staticmethod
    def _split(batch: list[Entry], output: torch.Tensor) -> list[Entry]:
        """Answer each entry its rows of the batch's output: views, in order, no copy.

        An array entry (submit_array) gets a slice of the output as one array, made once per batch,
        when it asks for the dtype the batch computed in; else its rows converted alone. Returns
        the array entries answered, to be counted together and those with a `settled` callback
        told: the batcher's own callback is taken off their futures, so none is scheduled for them."""
        offset = 0
        array: np.ndarray | None = None
        answered: list[Entry] = []
        for entry in batch:
            n = entry.n
            future = entry.future
            if not future.done():
                answer = entry.answer
                if answer is None:
                    future.set_result(output[offset : offset + n])
                else:
                    if TORCH[answer.name] == output.dtype:
                        if array is None:
                            array = answer_as_array(output, answer)
                        rows = array[offset : offset + n]
                    else:
                        rows = answer_as_array(output[offset : offset + n], answer)
                    if entry.watch is not None:  # it would find nothing to count or release
                        future.remove_done_callback(entry.watch)
                        entry.watch = None  # it holds the entry: kept, they would wait for the collector
                    future.set_result(rows)
                    answered.append(entry)
            offset += n
        return answered

    def _count_pass(self, seconds: float, rows: int, requests: int) -> None:
        """Count one forward pass (a batch, or a whole Monte Carlo request) of `rows` rows for `requests` requests."""
        self._instruments.compute_seconds.observe(seconds)
        self._instruments.request_compute_seconds.inc(seconds * requests)
        self._instruments.batch_rows.observe(rows)
        self._instruments.last_inference.set(time.time())

    def _runs_inline(self, rows: int) -> bool:
        """Whether a plain batch of `rows` rows runs on the event loop's thread (see _compute)."""
        return self._launch is None and rows <= self.inline_rows

    async def _compute(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The forward pass on the device thread; launched there and waited for elsewhere when it can be."""
        loop = asyncio.get_running_loop()
        if self._runs_inline(sum(part.shape[0] for part in parts)):
            # A pass this short costs less here than the two hand-offs to and from the model
            # thread, each a wait for the GIL and for a core (docs/configuration.md: inline_forward_us).
            return self._forward(parts)
        if self._launch is None:
            return await loop.run_in_executor(self._executor, self._forward, parts)
        pending = await loop.run_in_executor(self._executor, self._launch, parts)
        if pending.done():
            return pending.wait()
        # Not on the device thread, which is free to launch the next batch meanwhile.
        return await loop.run_in_executor(None, pending.wait)

    async def _split_after_oom(self, batch: list[Entry], rows: int) -> None:
        """Out of memory: lower the ceiling, retry each half; an entry alone that fails gets 507."""
        self._ceiling = max(1, min(self._ceiling, math.ceil(rows / 2)))
        self._instruments.batch_ceiling.set(self._ceiling)
        if len(batch) == 1:
            log.warning("model %s: out of memory on a single request of %d rows", self.name, rows)
            fail(batch[0], InsufficientMemory(f"a request of {rows} rows does not fit in the device's memory"))
            return
        self._instruments.oom_splits.inc()
        log.warning(
            "model %s: out of memory at %d rows; splitting the batch, ceiling now %d", self.name, rows, self._ceiling
        )
        middle = len(batch) // 2
        await self._run(batch[:middle])
        await self._run(batch[middle:])

    # ----- Monte Carlo slices ----------------------------------------------------------------

    async def _run_slice(self, entry: Entry) -> None:
        """The next slice of a Monte Carlo entry's passes: at most a batch's worth of row-passes.

        The entry leaves the queue when its last slice has run, or when a slice fails.
        """
        assert entry.monte_carlo is not None, "a plain entry in the Monte Carlo turn; this is a bug."
        started = time.perf_counter()
        if entry.passes is None:
            self._instruments.queue_seconds.observe(started - entry.arrived)
        passes = max(1, self._ceiling // entry.n)
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(self._executor, self._slice, entry, passes)
        except OUT_OF_MEMORY:
            log.warning(
                "out of memory on a Monte Carlo dropout request of %d rows x %d passes",
                entry.n,
                entry.monte_carlo.passes,
            )
            fail(
                entry,
                InsufficientMemory(
                    f"{entry.monte_carlo.passes} passes over {entry.n} rows do not fit in the device's memory"
                ),
            )
            self._queue.finish(entry)
            return
        except Exception as exc:
            log.error("Monte Carlo dropout failed (%d rows)", entry.n, exc_info=exc)
            fail(entry, ModelError(f"the Monte Carlo dropout passes failed: {type(exc).__name__}"))
            self._queue.finish(entry)
            return
        ended = time.perf_counter()
        entry.compute_s += ended - started
        if self.observer is not None:
            self.observer.monte_carlo_slice(entry, started, ended)
        if result is None:
            return  # more slices to go: it keeps its place at the head of the Monte Carlo queue
        self._queue.finish(entry)
        self._count_pass(entry.compute_s, entry.n, 1)
        if not entry.future.done():
            entry.future.set_result(result)

    def _slice(self, entry: Entry, passes: int) -> Moments | None:
        """On the device thread: run `passes` more passes; the result once the last has run."""
        assert self._start_monte_carlo is not None and entry.monte_carlo is not None
        if entry.passes is None:
            assert isinstance(entry.rows, torch.Tensor), "Monte Carlo rows are queued as a tensor; this is a bug."
            entry.passes = self._start_monte_carlo(entry.rows, entry.monte_carlo)
        run = entry.passes
        try:
            run.run(passes)
            if run.remaining:
                return None
            mean, std = run.result()
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            raise
        return Moments(mean.to("cpu"), std.to("cpu"))


class PerTurnCounts:
    """The request-rows histogram and the queue gauge, observed once per turn of the event loop.

    Each submit observed a request's rows (a histogram: its lock and its buckets walked in Python)
    and set the queue's gauge, and each batch set the gauge again: some 4 µs a request. Here a
    turn's values are kept as plain numbers and observed together at the turn's end
    (`loop.call_soon`), before any later turn, a scrape's included, can read them: every count
    stays exact, the gauge shows the queue's work as the turn left it. Outside a running loop
    (a batcher stopped by a test's teardown) each value is observed at once.
    """

    def __init__(self, instruments: ModelInstruments) -> None:
        self._instruments = instruments
        self._rows: list[int] = []
        self._work: int | None = None  # the queue's work as last changed this turn; None: unchanged
        self._due = False

    def request_rows(self, n: int) -> None:
        self._rows.append(n)
        self._flush_soon()

    def queue_work(self, work: int) -> None:
        self._work = work
        self._flush_soon()

    def _flush_soon(self) -> None:
        if self._due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        self._due = True
        loop.call_soon(self.flush)

    def flush(self) -> None:
        self._due = False
        rows, self._rows = self._rows, []
        if rows:
            observe_many(self._instruments.request_rows, rows)
        if self._work is not None:
            work, self._work = self._work, None
            self._instruments.queue_rows.set(work)


# The doors' numpy arrays as the engine's tensors and back: views, no copy unless a dtype changes.


def rows_as_tensor(rows: np.ndarray) -> torch.Tensor:
    """The rows as a tensor in their own memory: a uint16 array holds bfloat16's patterns."""
    tensor = torch.from_numpy(rows)
    return tensor.view(torch.bfloat16) if rows.dtype == np.uint16 else tensor


def answer_as_array(output: torch.Tensor, dtype: DType) -> np.ndarray:
    """A host tensor as a C-contiguous array carrying `dtype`: itself when it is in `dtype` and contiguous
    already (the common case: a batch's own rows), else converted once (rounded to nearest even)."""
    wire = TORCH[dtype.name]
    if output.dtype != wire or not output.is_contiguous():
        output = output.to(wire).contiguous()
    if wire == torch.bfloat16:
        output = output.view(torch.uint16)
    return output.numpy()


def _parts(batch: list[Entry]) -> list[torch.Tensor]:
    """The batch's rows as the runner takes them: array entries of one dtype concatenated and viewed
    as one tensor (one concatenation, one conversion per batch); otherwise a tensor per entry."""
    rows = [entry.rows for entry in batch]
    first = rows[0]
    if isinstance(first, np.ndarray) and all(
        isinstance(part, np.ndarray) and part.dtype == first.dtype for part in rows
    ):
        arrays: list[np.ndarray] = rows  # type: ignore[assignment]
        return [rows_as_tensor(first if len(arrays) == 1 else np.concatenate(arrays))]
    return [rows_as_tensor(part) if isinstance(part, np.ndarray) else part for part in rows]


def future_as_array(computed: asyncio.Future[torch.Tensor], answer: DType) -> asyncio.Future[np.ndarray]:
    """A future of `computed`'s tensor as an array carrying `answer`; cancelling it cancels `computed`."""
    converted: asyncio.Future[np.ndarray] = computed.get_loop().create_future()

    def pass_on(_: object) -> None:
        if converted.done():
            return
        if computed.cancelled():
            converted.cancel()
        elif (error := computed.exception()) is not None:
            converted.set_exception(error)
        else:
            try:
                converted.set_result(answer_as_array(computed.result(), answer))
            except Exception as exc:  # a bug: the caller hears it, as an awaiting caller would
                converted.set_exception(exc)

    computed.add_done_callback(pass_on)
    converted.add_done_callback(lambda _: computed.cancel() if converted.cancelled() else None)
    return converted
