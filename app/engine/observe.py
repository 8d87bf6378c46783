"""BatchObserver: what the batcher tells an observer (the tracing, app/tracing/spans.py) about its work.

The engine knows nothing of traces: it asks the observer for an opaque tag when a request is
submitted (the observer reads whatever marks the current request as traced), keeps it on the
request's entries, and reports each batch and each Monte Carlo slice with its entries and times
(`time.perf_counter()` seconds, the clock of `Entry.arrived`). Without an observer the batcher
calls nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from app.engine.queue import Entry

__all__ = ["BatchObserver", "Entry"]  # what an observer sees: itself, and the entries it is told of


class BatchObserver(Protocol):
    def tag(self) -> object | None:
        """The tag of the request being submitted now (None: nothing to report about it)."""

    def batch(self, entries: Sequence[Entry], started: float, ended: float, rows: int) -> None:
        """A batch of `rows` rows over `entries` ran on the device from `started` to `ended`."""

    def monte_carlo_slice(self, entry: Entry, started: float, ended: float) -> None:
        """One slice of a Monte Carlo entry's passes ran from `started` to `ended` (`entry.passes.done` so far)."""
