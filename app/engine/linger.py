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
its way (`Arrivals`): a gRPC call is announced from the moment it holds a room until its
message is read, and its rows are queued in that same step. A batch about to form while calls are on their way lingers
for them too, whatever it holds, and ends its linger as soon as none is left: at 16 callers the
batches formed went from 2.6 calls to 4.5, and a call's CPU from 2.3x a bare grpc.aio servicer's
to 2.0x (docs/benchmarks.md). A call on its way for longer than MAX_ARRIVAL_AGE_S is not waited for
(a client that stalls its message holds batches back for that long once, however long it stalls),
and the learning applies: lingers that catch nothing stop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

PROBE_FIRST = 8  # lone batches computed at once after a linger that caught nothing, before the next probe
PROBE_MOST = 1024  # ... doubling after each probe that catches nothing, up to this many
# A request announced this long ago and still on its way may never come (a client that stalls its
# message): batches stop waiting for it. Under load a message can take milliseconds to be read,
# longer than a linger's cap; a tenth of a second lets a stalled call hold batches back for that
# long once, however long it stalls.
MAX_ARRIVAL_AGE_S = 0.1


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

    __slots__ = ("_arrivals", "at")

    def __init__(self, arrivals: Arrivals) -> None:
        self._arrivals: Arrivals | None = arrivals
        self.at = time.monotonic()  # when it was announced

    def arrived(self) -> None:
        """Its rows are queued now (or it ended without): no batch waits for it any more. Once."""
        if self._arrivals is not None:
            self._arrivals.one_arrived(self)
            self._arrivals = None


class Arrivals:
    """Requests the doors of this process have begun to receive and not yet queued, for every batcher to see.

    Only those announced within `max_age_s` count: one on its way for longer may never come (a client
    that stalls its message), and a batch does not wait for it. Stalled ones are few (a gRPC call is
    announced once it holds one of the door's rooms), so skipping them, the oldest first, costs a
    few steps at most.
    """

    def __init__(self, max_age_s: float = MAX_ARRIVAL_AGE_S) -> None:
        self.max_age_s = max_age_s
        self._pending: dict[Arrival, None] = {}  # in the order announced (a dict keeps it; removal is O(1))
        self._lingering: set[Callable[[], None]] = set()  # the wake-ups of the batchers lingering for them

    @property
    def on_the_way(self) -> int:
        """Requests announced within max_age_s and not yet arrived."""
        horizon = time.monotonic() - self.max_age_s
        stale = 0
        for arrival in self._pending:
            if arrival.at >= horizon:
                break
            stale += 1
        return len(self._pending) - stale

    def one_arrived(self, arrival: Arrival) -> None:
        del self._pending[arrival]
        if self._lingering and not self.on_the_way:  # one that ended without its rows queued wakes them too
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
        self._pending[arrival] = None
        try:
            yield arrival
        finally:
            arrival.arrived()
