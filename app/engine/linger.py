"""Linger: when a batch would hold one request, whether to wait a moment for others, learnt from what waiting caught.

Greedy batching (`max_wait_ms` 0) forms batches from what arrived together. Over HTTP many
requests arrive in one read of the event loop, and batches form by themselves. A gRPC server
accepts its calls one at a time, each after the last was handled, so at any concurrency a greedy
batcher there computes every call alone: a whole batch's fixed cost (wake-up, forward call,
metrics) per call, 3.3× the CPU of a bare servicer at 16 callers (docs/benchmarks.md). Waiting a
little for the next arrival is then worth it; for one client calling in sequence it never is,
since its next request comes only after this answer.

So the batcher lingers (up to `cap_s`, ending after `quiet_s` with no arrival) while lingering
catches requests, and stops as soon as one linger catches none. After that it tries again now
and then (a probe), backing off the longer nothing is caught: a lone client pays one quiet
interval on one batch in PROBE_MOST once it has backed off.

A door that receives a request in several steps tells the batchers of its process that it is on
its way (`Arrivals`): a gRPC call is announced when it starts, before its message is read, and
counted until its rows are queued. A batch about to form while calls are on their way lingers
for them too, whatever it holds, and ends its linger as soon as none is left: at 16 callers the
batches formed went from 2.6 calls to 5.4, and a call's CPU from 2.4x a bare grpc.aio servicer's
to 1.5x (docs/benchmarks.md). The same learning applies: calls announced that never come (a client
that stalls its message) make lingers catch nothing, and then they stop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

PROBE_FIRST = 8  # lone batches computed at once after a linger that caught nothing, before the next probe
PROBE_MOST = 1024  # ... doubling after each probe that catches nothing, up to this many


class Linger:
    """The batcher's policy for a lone request: linger or not, and what each linger caught."""

    def __init__(self, cap_s: float) -> None:
        if cap_s <= 0:
            raise ValueError("cap_s must be > 0 (a batcher that never lingers has no Linger)")
        self.cap_s = cap_s
        self.quiet_s = cap_s / 2  # a linger ends after this long with no arrival
        self._paying = False  # the last linger caught a request
        self._skip = 0  # lone batches still to compute at once before the next probe
        self._backoff = PROBE_FIRST

    def worth_it(self) -> bool:
        """Whether to linger for this lone request: lingering pays lately, or it is time to probe."""
        if self._paying:
            return True
        if self._skip:
            self._skip -= 1
            return False
        return True

    def caught(self, requests: int) -> None:
        """A linger ended, having caught `requests` more."""
        if requests:
            self._paying, self._backoff = True, PROBE_FIRST
            return
        self._paying = False
        self._skip, self._backoff = self._backoff, min(2 * self._backoff, PROBE_MOST)


class Arrival:
    """One request on its way to a batcher (Arrivals.announced): `arrived` once it is queued, or given up."""

    __slots__ = ("_arrivals",)

    def __init__(self, arrivals: Arrivals) -> None:
        self._arrivals: Arrivals | None = arrivals
        arrivals.on_the_way += 1

    def arrived(self) -> None:
        """Its rows are queued now (or it ended without): no batch waits for it any more. Once."""
        if self._arrivals is not None:
            self._arrivals.one_arrived()
            self._arrivals = None


class Arrivals:
    """Requests the doors of this process have begun to receive and not yet queued, for every batcher to see."""

    def __init__(self) -> None:
        self.on_the_way = 0
        self._lingering: set[Callable[[], None]] = set()  # the wake-ups of the batchers lingering for them

    def one_arrived(self) -> None:
        self.on_the_way -= 1
        if not self.on_the_way:  # a request that ended without its rows queued wakes nobody else
            for wake in list(self._lingering):
                wake()

    @contextmanager
    def lingering(self, wake: Callable[[], None]) -> Iterator[None]:
        """For the block, `wake` is called when no request is on its way any more."""
        self._lingering.add(wake)
        try:
            yield
        finally:
            self._lingering.discard(wake)

    @contextmanager
    def announced(self) -> Iterator[Arrival]:
        """A request on its way for the block, or until its `arrived` is called (before its rows are queued)."""
        arrival = Arrival(self)
        try:
            yield arrival
        finally:
            arrival.arrived()
