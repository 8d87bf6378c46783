"""Monte Carlo dropout requests: N stochastic passes over one request's rows, on the model's device thread.

Kept apart from the Batcher, whose hot path never looks at one: an MC request is never batched
with others (its masks are drawn for its own rows from its own seed, so company would change
its answer), and it takes its turn on the same device thread as the forward passes, between
batches. Waiting rows are bounded (429 beyond `max_queue_rows`); a request whose deadline
passes or whose client leaves before it starts is never computed; one that has started is
finished, as in the batcher. Its queue and compute times count in the model's metrics like a
batch of its rows.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Executor
from dataclasses import dataclass

import torch

from app.engine.batcher import OUT_OF_MEMORY, count_failure
from app.engine.errors import DeadlineExceeded, InsufficientMemory, ModelError, Overloaded, RequestTooLarge, Unavailable
from app.metrics import ModelInstruments
from ffn_core import FeedForward, mc_dropout

log = logging.getLogger("ffn_serve.montecarlo")


@dataclass(frozen=True)
class MonteCarloRequest:
    """What a request asked for, checked at the edge: passes >= 2, 0 <= dropout < 1, a seed."""

    passes: int
    dropout: float
    seed: int


@dataclass(frozen=True)
class MonteCarloResult:
    """Per-element mean and standard deviation (Bessel-corrected) over the passes, on the host."""

    mean: torch.Tensor  # (rows, d_model)
    std: torch.Tensor  # (rows, d_model)


@dataclass(eq=False)
class _Job:
    rows: torch.Tensor  # (n, d_model), on the host
    request: MonteCarloRequest
    answer: asyncio.Future[MonteCarloResult]
    arrived: float  # time.perf_counter()
    started: float | None = None  # set on the device thread, under the lane's lock
    finished: float | None = None
    abandoned: bool = False  # nobody waits any more: the device thread must not start it
    counted: bool = True  # still counted in the waiting rows

    @property
    def n_rows(self) -> int:
        return self.rows.shape[0]


class MonteCarloLane:
    """One model's Monte Carlo dropout requests, run one at a time on its device thread."""

    def __init__(
        self,
        model: FeedForward,
        *,
        executor: Executor | None,
        instruments: ModelInstruments,
        max_rows: int,
        max_queue_rows: int,
    ) -> None:
        self._model = model
        first = next(model.parameters())
        self._device, self._dtype = first.device, first.dtype
        self._executor = executor
        self._instruments = instruments
        self.max_rows = max_rows
        self.max_queue_rows = max_queue_rows
        self._waiting_rows = 0
        self._jobs: set[_Job] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._lock = threading.Lock()  # orders "started" on the device thread against "abandoned" on the loop
        self._accepting = False

    @property
    def waiting_rows(self) -> int:
        """Rows of the requests accepted and not yet answered."""
        return self._waiting_rows

    def start(self) -> None:
        self._accepting = True

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests, then wait up to `timeout_s` for the accepted ones. True if they finished."""
        self._accepting = False
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def stop(self) -> None:
        """Refuse new requests and answer every pending one 503 (the device thread is going away)."""
        self._accepting = False
        for job in self._jobs:
            self._abandon(job)
            if not job.answer.done():
                job.answer.set_exception(Unavailable("the server is shutting down"))

    async def submit(
        self, rows: torch.Tensor, request: MonteCarloRequest, *, deadline: float | None = None
    ) -> MonteCarloResult:
        """Mean and std of `request.passes` dropout passes over `rows` (n, d_model). `deadline`: loop.time()."""
        arrived = time.perf_counter()
        n = rows.shape[0]
        if not self._accepting:
            count_failure(self._instruments, arrived)
            raise Unavailable("the server is not accepting work (starting up or draining)")
        if n > self.max_rows:
            count_failure(self._instruments, arrived)
            raise RequestTooLarge(
                f"a Monte Carlo dropout request may hold at most {self.max_rows} rows "
                f"(max_batch_rows); this one has {n}"
            )
        if self._waiting_rows + n > self.max_queue_rows:
            count_failure(self._instruments, arrived)
            raise Overloaded(
                f"Monte Carlo dropout queue full: {self._waiting_rows} of {self.max_queue_rows} rows waiting"
            )
        loop = asyncio.get_running_loop()
        job = _Job(rows, request, loop.create_future(), arrived)
        self._jobs.add(job)
        self._idle.clear()
        self._waiting_rows += n
        running = loop.run_in_executor(self._executor, self._compute, job)
        running.add_done_callback(lambda done: self._settle(job, done))
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    result = await asyncio.shield(job.answer)
            except TimeoutError:
                if self._abandon(job):
                    raise DeadlineExceeded("deadline passed while the request was queued") from None
                result = await job.answer  # already computing: finish it, as the batcher does
            self._instruments.request_seconds.observe(time.perf_counter() - arrived)
            return result
        except BaseException:
            self._abandon(job)  # client gone or failed: never start it
            count_failure(self._instruments, arrived)
            raise
        finally:
            self._release(job)

    def _abandon(self, job: _Job) -> bool:
        """Mark a job nobody waits for; True if it had not started (so it never will)."""
        with self._lock:
            job.abandoned = True
            return job.started is None

    def _release(self, job: _Job) -> None:
        if job.counted:
            job.counted = False
            self._waiting_rows -= job.n_rows
        self._jobs.discard(job)
        if not self._jobs:
            self._idle.set()

    def _compute(self, job: _Job) -> MonteCarloResult | None:
        """On the device thread: the passes, unless the job was abandoned before its turn."""
        with self._lock:
            if job.abandoned:
                return None
            job.started = time.perf_counter()
        request = job.request
        try:
            x = job.rows.to(device=self._device, dtype=self._dtype)  # (n, d_model)
            mean, std = mc_dropout(self._model, x, passes=request.passes, p=request.dropout, seed=request.seed)
            result = MonteCarloResult(mean.to("cpu"), std.to("cpu"))
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            raise
        job.finished = time.perf_counter()
        return result

    def _settle(self, job: _Job, done: asyncio.Future[MonteCarloResult | None]) -> None:
        """On the loop, when the device thread is done with `job`: answer it and count it."""
        error = None if done.cancelled() else done.exception()
        if job.finished is not None:
            self._count(job)
        if job.answer.done() or job not in self._jobs:  # answered by stop(), or its waiter is gone
            return
        if done.cancelled():  # the executor shut down before its turn
            job.answer.set_exception(Unavailable("the server is shutting down"))
        elif isinstance(error, OUT_OF_MEMORY):
            log.warning(
                "out of memory on a Monte Carlo dropout request of %d rows x %d passes", job.n_rows, job.request.passes
            )
            job.answer.set_exception(
                InsufficientMemory(
                    f"{job.request.passes} passes over {job.n_rows} rows do not fit in the device's memory"
                )
            )
        elif error is not None:
            log.error("Monte Carlo dropout failed (%d rows)", job.n_rows, exc_info=error)
            job.answer.set_exception(ModelError(f"the Monte Carlo dropout passes failed: {type(error).__name__}"))
        else:
            result = done.result()
            # Only an abandoned job is skipped, and abandoning releases it in the same step.
            assert result is not None, "a skipped job still had a waiter; this is a bug."
            job.answer.set_result(result)

    def _count(self, job: _Job) -> None:
        """Count a job that ran like one batch of its rows: queue and compute time, rows, last inference."""
        assert job.started is not None and job.finished is not None, "counted before it ran; this is a bug."
        instruments = self._instruments
        instruments.queue_seconds.observe(job.started - job.arrived)
        instruments.compute_seconds.observe(job.finished - job.started)
        instruments.request_compute_seconds.inc(job.finished - job.started)
        instruments.batch_rows.observe(job.n_rows)
        instruments.last_inference.set(time.time())
