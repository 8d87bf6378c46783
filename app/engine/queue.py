"""WorkQueue: one model's waiting work, counted in rows × passes, with deadlines enforced.

Like TEI's queue.rs beside its batching loop: the queue only holds, counts, expires and hands
out entries; the Batcher decides what runs next and runs it. Two kinds of entries wait here:
plain rows, batched together, and Monte Carlo dropout requests, each run alone in slices of
passes. Both count against one budget in units of work, a row's forward pass: a plain entry
costs its rows, a Monte Carlo one its rows × passes, so admission bounds what the device owes.

One timer covers the earliest deadline in the queue, not one per entry (a timer per request
costs more than the rest of the queueing). An entry whose deadline passes while it waits is
answered `DeadlineExceeded` and not computed further: a Monte Carlo request that has begun
waits between its slices, so it expires too, with the passes it has run dropped.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from app.engine.errors import DeadlineExceeded
from app.engine.montecarlo import MonteCarloRequest
from ffn_core import MonteCarloPasses
from ffn_core.dtypes import DType


@dataclass(eq=False, slots=True)
class Entry:
    """A queued slice of one request: its rows and the future its answer goes to.

    A Monte Carlo entry also carries what it asked for and, once its first slice ran, its passes so far.
    """

    rows: torch.Tensor | np.ndarray  # (n, d_model), on the host: a tensor, or an array (bfloat16 as uint16)
    future: asyncio.Future[Any]  # a torch.Tensor, or the Moments of a Monte Carlo entry
    enqueued_at: float  # loop.time(), for max_wait
    arrived: float  # time.perf_counter(), for metrics (uvloop's loop.time() counts whole milliseconds)
    deadline: float | None
    monte_carlo: MonteCarloRequest | None = None
    passes: MonteCarloPasses | None = None  # set on the device thread by the first slice
    compute_s: float = 0.0  # a Monte Carlo entry's forward time over its slices so far
    queued: bool = True  # still counted in the queue's work
    tag: object | None = None  # the batch observer's mark of its request (app/engine/observe.py)
    requests: int = 1  # how many requests its rows are (the hand-off's engine queues a frame's as one entry)
    # An entry of numpy rows (Batcher.submit_array) is answered an array carrying this dtype; None: a tensor.
    answer: DType | None = None
    # Batcher.submit_array's: told when the entry's future is done (its batch tells it at once), and
    # the batcher's own done-callback, which its batch takes off the future first.
    settled: Callable[[asyncio.Future[Any]], None] | None = None
    watch: Callable[[asyncio.Future[Any]], None] | None = None
    n: int = field(init=False)  # rows.shape[0], read several times per batch: kept, not asked of torch each time

    def __post_init__(self) -> None:
        self.n = self.rows.shape[0]

    @property
    def cost(self) -> int:
        """Rows × passes: the forward passes of one row this entry owes the device."""
        return self.n * (self.monte_carlo.passes if self.monte_carlo is not None else 1)


def fail(entry: Entry, error: Exception) -> None:
    """Answer `error` to an entry nobody has answered yet."""
    if not entry.future.done():
        entry.future.set_exception(error)


def _expired(entry: Entry) -> DeadlineExceeded:
    if entry.passes is not None and entry.monte_carlo is not None:
        return DeadlineExceeded(
            f"deadline passed after {entry.passes.done} of {entry.monte_carlo.passes} Monte Carlo passes"
        )
    return DeadlineExceeded("deadline passed while the request was queued")


class WorkQueue:
    """Plain entries in arrival order, Monte Carlo entries in theirs; `on_work(total)` hears every change of the work."""

    def __init__(self, on_work: Callable[[int], None]) -> None:
        self._plain: deque[Entry] = deque()
        self._monte_carlo: deque[Entry] = deque()
        self._work = 0
        self._on_work = on_work
        self._reaper: asyncio.TimerHandle | None = None
        self._reaper_at = math.inf

    @property
    def work(self) -> int:
        """Rows × passes waiting: entries taken, finished, expired or given up on no longer count."""
        return self._work

    @property
    def has_plain(self) -> bool:
        return bool(self._plain)

    @property
    def has_monte_carlo(self) -> bool:
        return bool(self._monte_carlo)

    def __bool__(self) -> bool:
        return bool(self._plain) or bool(self._monte_carlo)

    def lone_plain(self) -> bool:
        """Exactly one plain entry waits, and no Monte Carlo one: a batch now would hold one request."""
        return len(self._plain) == 1 and not self._monte_carlo

    def first_plain(self) -> Entry:
        return self._plain[0]

    def plain_count(self) -> int:
        """Plain entries in the deque (some may be cancelled or expired, not yet skipped)."""
        return len(self._plain)

    def first_enqueued_at(self) -> float:
        return self._plain[0].enqueued_at

    def push(self, entries: list[Entry], deadline: float | None) -> None:
        """Queue one request's entries (they share its deadline)."""
        for entry in entries:
            (self._plain if entry.monte_carlo is None else self._monte_carlo).append(entry)
        if deadline is not None and deadline < self._reaper_at:
            self._schedule_reaper(deadline)
        self._count(sum(entry.cost for entry in entries))

    def release(self, entry: Entry) -> None:
        """Stop counting an entry's work (once); it may still sit in its deque until taken."""
        if entry.queued:
            entry.queued = False
            self._count(-entry.cost)

    def take(self, batch: list[Entry], ceiling: int) -> None:
        """Pop plain entries into `batch` up to `ceiling` rows, skipping the ones nobody waits for any more.

        Filled in place, so that if anything goes wrong the caller still holds every popped entry.
        """
        rows = 0
        released = 0  # the work of the entries popped: counted once for the whole batch, not entry by entry
        now = asyncio.get_running_loop().time()
        try:
            while self._plain:
                entry = self._plain[0]
                waited_for = not entry.future.done()  # not cancelled, nor expired by the reaper
                expired = waited_for and entry.deadline is not None and entry.deadline <= now  # before the reaper ran
                if waited_for and not expired and batch and rows + entry.n > ceiling:
                    break
                self._plain.popleft()
                if entry.queued:
                    entry.queued = False
                    released += entry.cost
                if expired:
                    entry.future.set_exception(_expired(entry))
                elif waited_for:
                    batch.append(entry)
                    rows += entry.n
        finally:
            if released:
                self._count(-released)

    def next_monte_carlo(self) -> Entry | None:
        """The Monte Carlo entry whose slice runs next, or None; it stays queued (and counted) until `finish`."""
        now = asyncio.get_running_loop().time()
        while self._monte_carlo:
            entry = self._monte_carlo[0]
            if not entry.future.done() and entry.deadline is not None and entry.deadline <= now:
                entry.future.set_exception(_expired(entry))
            if entry.future.done():  # cancelled, expired, or failed by a slice
                self.finish(entry)
                continue
            return entry
        return None

    def finish(self, entry: Entry) -> None:
        """A Monte Carlo entry leaves the queue: answered, failed, or nobody waits for it."""
        if self._monte_carlo and self._monte_carlo[0] is entry:
            self._monte_carlo.popleft()
        elif entry in self._monte_carlo:
            self._monte_carlo.remove(entry)
        entry.passes = None  # its hidden layer and accumulators are freed now, not when its waiter goes
        self.release(entry)

    def fail_all(self, make_error: Callable[[], Exception]) -> None:
        """Empty the queue, answering one `make_error()` to every entry still waiting; stop the deadline timer.

        The error is made only when an entry waits: a queue stopped empty (every reload's old copy) makes none.
        """
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper, self._reaper_at = None, math.inf
        if not self._plain and not self._monte_carlo:
            return
        error = make_error()
        while self._plain:
            fail(self._pop_plain(), error)
        while self._monte_carlo:
            entry = self._monte_carlo[0]
            fail(entry, error)
            self.finish(entry)

    def _entries(self) -> Iterator[Entry]:
        yield from self._plain
        yield from self._monte_carlo

    def _pop_plain(self) -> Entry:
        entry = self._plain.popleft()
        self.release(entry)
        return entry

    def _count(self, delta: int) -> None:
        self._work += delta
        self._on_work(self._work)

    def _schedule_reaper(self, at: float) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        self._reaper_at = at
        self._reaper = asyncio.get_running_loop().call_at(at, self._reap)

    def _reap(self) -> None:
        """Answer 504 to every queued entry whose deadline has passed; they will never be computed further."""
        self._reaper, self._reaper_at = None, math.inf
        now = asyncio.get_running_loop().time()
        earliest = math.inf
        for entry in self._entries():
            if entry.deadline is None or entry.future.done():
                continue
            if entry.deadline <= now:
                self.release(entry)
                entry.future.set_exception(_expired(entry))
            else:
                earliest = min(earliest, entry.deadline)
        if earliest < math.inf:
            self._schedule_reaper(earliest)
