"""RowQueue: one model's waiting entries, bounded by the batcher in rows, with deadlines enforced.

Like TEI's queue.rs beside its batching loop: the queue only holds, counts, expires and hands
out entries; the Batcher decides when to cut a batch and runs it. One timer covers the earliest
deadline in the queue, not one per entry (a timer per request costs more than the rest of the
queueing). An entry whose deadline passes is answered `DeadlineExceeded` and never computed.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from app.engine.errors import DeadlineExceeded


@dataclass(eq=False)
class Entry:
    """A queued slice of one request: its rows and the future its answer goes to."""

    rows: torch.Tensor  # (n, d_model), on the host
    future: asyncio.Future[torch.Tensor]
    enqueued_at: float  # loop.time(), for max_wait
    arrived: float  # time.perf_counter(), for metrics (uvloop's loop.time() counts whole milliseconds)
    deadline: float | None
    queued: bool = True  # still counted in the queue's rows

    @property
    def n(self) -> int:
        return self.rows.shape[0]


def fail(entry: Entry, error: Exception) -> None:
    """Answer `error` to an entry nobody has answered yet."""
    if not entry.future.done():
        entry.future.set_exception(error)


def _expired() -> DeadlineExceeded:
    return DeadlineExceeded("deadline passed while the request was queued")


class RowQueue:
    """Entries in arrival order, their rows counted; `on_rows(total)` hears every change of the count."""

    def __init__(self, on_rows: Callable[[int], None]) -> None:
        self._entries: deque[Entry] = deque()
        self._rows = 0
        self._on_rows = on_rows
        self._reaper: asyncio.TimerHandle | None = None
        self._reaper_at = math.inf

    @property
    def rows(self) -> int:
        """Rows waiting: entries taken, expired or given up on no longer count."""
        return self._rows

    def __bool__(self) -> bool:
        return bool(self._entries)

    def first_enqueued_at(self) -> float:
        return self._entries[0].enqueued_at

    def push(self, entries: list[Entry], deadline: float | None) -> None:
        """Queue one request's entries (they share its deadline)."""
        self._entries.extend(entries)
        if deadline is not None and deadline < self._reaper_at:
            self._schedule_reaper(deadline)
        self._count(sum(entry.n for entry in entries))

    def release(self, entry: Entry) -> None:
        """Stop counting an entry's rows (once); it may still sit in the deque until taken."""
        if entry.queued:
            entry.queued = False
            self._count(-entry.n)

    def release_all(self, entries: Iterable[Entry]) -> None:
        for entry in entries:
            self.release(entry)

    def take(self, batch: list[Entry], ceiling: int) -> None:
        """Pop entries into `batch` up to `ceiling` rows, skipping the ones nobody waits for any more.

        Filled in place, so that if anything goes wrong the caller still holds every popped entry.
        """
        rows = 0
        now = asyncio.get_running_loop().time()
        while self._entries:
            entry = self._entries[0]
            if entry.future.done():  # cancelled, or expired by the reaper
                self._pop()
                continue
            if entry.deadline is not None and entry.deadline <= now:  # expired before the reaper ran
                self._pop()
                entry.future.set_exception(_expired())
                continue
            if batch and rows + entry.n > ceiling:
                break
            batch.append(self._pop())
            rows += entry.n

    def fail_all(self, error: Exception) -> None:
        """Empty the queue, answering `error` to every entry still waiting; stop the deadline timer."""
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper, self._reaper_at = None, math.inf
        while self._entries:
            fail(self._pop(), error)

    def _pop(self) -> Entry:
        entry = self._entries.popleft()
        self.release(entry)
        return entry

    def _count(self, delta: int) -> None:
        self._rows += delta
        self._on_rows(self._rows)

    def _schedule_reaper(self, at: float) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        self._reaper_at = at
        self._reaper = asyncio.get_running_loop().call_at(at, self._reap)

    def _reap(self) -> None:
        """Answer 504 to every queued entry whose deadline has passed; they will never be computed."""
        self._reaper, self._reaper_at = None, math.inf
        now = asyncio.get_running_loop().time()
        earliest = math.inf
        for entry in self._entries:
            if entry.deadline is None or entry.future.done():
                continue
            if entry.deadline <= now:
                self.release(entry)
                entry.future.set_exception(_expired())
            else:
                earliest = min(earliest, entry.deadline)
        if earliest < math.inf:
            self._schedule_reaper(earliest)
