"""Admission: the budgets a request takes, whichever door it came through (bytes held, its deadline), and its outcome.

The bytes that a process's accepted, unanswered requests hold are bounded as one budget (`max_held_bytes`).

Admission counts rows, but memory is bytes: a request holds its body while it is read and
decoded, then its tensor until it is answered. Every request takes its bytes from one budget per
process before it stores them (a body's declared length before its first byte is read, a chunked
body's bytes as they arrive), trades its body for its tensor once decoded (a JSON body is dropped
once parsed; a binary body's tensor is a view of its bytes), and gives everything back when it is
answered. Past the budget: 429 `too_many_bytes_held` with Retry-After, before the bytes are read.

    with state.held.request() as hold:
        body = await read_body(request, limit, hold)
        decoded = decode(body)
        hold.resize(decoded.rows.nbytes)  # the body is dropped, the tensor kept

**Watch**: many waits of one fixed length on one timer, so that a wait costs an append and a flag.

A gRPC message must arrive within `read_timeout_s` of its room, and an answer be taken within
`send_timeout_s` of its return. As a timer each (asyncio.wait's timeout, a call_later), every call
armed and cancelled two: with uvloop some 2.3 µs a pair, and asyncio.wait's own bookkeeping on top.
Waits of one length end due in the order they start, so they queue in that order, and one timer,
armed for the oldest wait still running, serves them all. Ending a wait marks its ticket; ended
tickets leave the queue from its head (as waits start, and when the timer fires), and the queue is
compacted when ended ones behind a long wait outnumber the live ones, so that it holds about as
many tickets as waits are running.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prometheus_client import Counter

from app.protocol.errors import ERRORS, INTERNAL, InvalidInput, TooManyBytesHeld, TooManyCalls, error_type_of
from app.protocol.fields import header_number


class HeldBytes:
    """One process's budget of bytes held by requests, and what is held now."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    @contextmanager
    def request(self) -> Iterator[Hold]:
        """What one request holds, given back when the block ends, however it ends."""
        hold = Hold(self)
        try:
            yield hold
        finally:
            hold.resize(0)

    def _take(self, size: int) -> None:
        if self.held + size > self.limit:
            raise TooManyBytesHeld(
                f"the requests this process is answering hold {self.held} bytes; {size} more would pass "
                f"max_held_bytes ({self.limit}); retry shortly"
            )
        self.held += size


class Hold:
    """The bytes one request holds against its process's budget."""

    def __init__(self, budget: HeldBytes) -> None:
        self._budget = budget
        self.size = 0

    def grow(self, size: int) -> None:
        """Take `size` more bytes, or TooManyBytesHeld (429) before they are stored."""
        self._budget._take(size)
        self.size += size

    def resize(self, size: int) -> None:
        """Hold `size` bytes from now on (a body traded for its smaller tensor; 0 when answered)."""
        if size > self.size:
            self.grow(size - self.size)
        else:
            self._budget.held -= self.size - size
            self.size = size


def deadline_from(timeout_ms: str | float | None, default_ms: float) -> float:
    """Absolute loop-time deadline from a per-request timeout in ms (the X-Timeout-Ms header, or a number)."""
    if timeout_ms is None:
        ms = default_ms
    else:
        parsed = header_number(timeout_ms, "X-Timeout-Ms") if isinstance(timeout_ms, str) else timeout_ms
        assert parsed is not None, "header_number returns a number for a string; this is a bug."
        ms = parsed
        if not 0 < ms <= 3_600_000:
            raise InvalidInput(f"timeout must be in (0, 3600000] milliseconds, got {ms:g}")
    return asyncio.get_running_loop().time() + ms / 1000.0


class CallsInFlight:
    """The calls one door runs at once, at most `limit`: past it, TooManyCalls (429, RESOURCE_EXHAUSTED), retry shortly.

    A call counts from when its handler starts (its message arrived) until it ends, a stream for
    its whole life. Each kind of call that must not starve another has a budget of its own: the
    probes any client may open without a key (health Watch streams) cannot take the slots of
    authenticated calls.

        with calls.call():
            ...
    """

    def __init__(self, limit: int, what: str) -> None:
        self.limit = limit
        self.running = 0
        self._what = what  # "calls", "health streams": what the refusal says is full

    @contextmanager
    def call(self) -> Iterator[None]:
        if self.running >= self.limit:
            raise TooManyCalls(f"this process runs {self.limit} {self._what} at once (max_connections); retry shortly")
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1


# Every outcome ffn_requests_total can count: ok, and each error_type of the one error table.
OUTCOMES = ("ok", *sorted({kind.error_type for kind in ERRORS.values()} | {INTERNAL.error_type}))
PROTOCOLS = ("http", "grpc")  # ffn_requests_total's protocol label: the two doors


class Outcomes:
    """Every request's outcome in ffn_requests_total{model, outcome, protocol}, counted once: ok or its error_type.

    with state.outcomes.count(model, "grpc"):
        ...  # the block's outcome: ok, or the error_type of what it raised
    """

    def __init__(self, requests: Counter) -> None:
        self._requests = requests
        # The children by (model, outcome, protocol), each looked up once (a lookup costs µs).
        self._children: dict[tuple[str, str, str], Counter] = {}

    def count_from_zero(self, model: str) -> None:
        """Create the model's ffn_requests_total series for every outcome and door, at 0.

        Labelled series appear on first use otherwise, and `increase()` over the first error of a
        kind reads 0: an alert on it would never fire. (The model's histograms are created with it.)
        Called for a name's first copy: after a model was forgotten (its series removed), the
        children this keeps of it are stale, and are made again.
        """
        for key in [key for key in self._children if key[0] == model]:
            del self._children[key]
        for outcome in OUTCOMES:
            for protocol in PROTOCOLS:
                self.counter(model, outcome, protocol)

    def count(self, model: str, protocol: str = "http") -> Counting:
        """Count one request's outcome in ffn_requests_total{model, outcome, protocol}: ok or its error_type (`with`)."""
        return Counting(self, model, protocol)

    def counter(self, model: str, outcome: str, protocol: str = "http") -> Counter:
        """The ffn_requests_total child of (model, outcome, protocol)."""
        child = self._children.get((model, outcome, protocol))
        if child is None:
            child = self._requests.labels(model=model, outcome=outcome, protocol=protocol)
            self._children[model, outcome, protocol] = child
        return child


class Counting:
    """`with outcomes.count(model):` counts the block's outcome once: ok, or the error_type of what it raised."""

    __slots__ = ("model", "outcomes", "protocol")

    def __init__(self, outcomes: Outcomes, model: str, protocol: str) -> None:
        self.outcomes, self.model, self.protocol = outcomes, model, protocol

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: object) -> None:
        if error is None:
            self.outcomes.counter(self.model, "ok", self.protocol).inc()
        elif isinstance(error, Exception):
            self.outcomes.counter(self.model, error_type_of(error), self.protocol).inc()


# A timer may fire up to the loop's clock resolution early (asyncio's, uvloop's: a millisecond): a
# wait due that soon is late, so that the timer is not armed again for a moment's wait. The HTTP
# door's per-connection deadlines (app/http/transport/budgets.py: Deadlines) take the same margin.
TIMER_EARLY_S = 0.002
COMPACT_AT = 64  # tickets queued before the queue is looked at for ended ones behind its head


class Ticket:
    """One wait: `end()` it when what it waited for came; else its `on_late` is called once, when it is due."""

    __slots__ = ("due", "ended", "on_late")

    def __init__(self, due: float, on_late: Callable[[], None]) -> None:
        self.due = due
        self.on_late = on_late
        self.ended = False

    def end(self) -> None:
        self.ended = True


class Watch:
    """Waits of `length_s` each, on one timer of the running loop."""

    def __init__(self, length_s: float) -> None:
        self.length_s = length_s
        self._queue: deque[Ticket] = deque()  # in the order they are due
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        """Tickets queued (ended ones not yet dropped included)."""
        return len(self._queue)

    def start(self, on_late: Callable[[], None]) -> Ticket:
        """A wait from now: `on_late()` in `length_s` unless the ticket is ended first."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a first wait, or a new loop (a test's): the old one's timer is gone
            self._loop, self._timer = loop, None
        ticket = Ticket(loop.time() + self.length_s, on_late)
        queue = self._queue
        while queue and queue[0].ended:
            queue.popleft()
        if len(queue) >= COMPACT_AT and not len(queue) & (len(queue) - 1):  # at 64, 128, 256, ...: rarely
            live = [waiting for waiting in queue if not waiting.ended]
            if 2 * len(live) < len(queue):
                self._queue = queue = deque(live)
        queue.append(ticket)
        if self._timer is None:
            self._timer = loop.call_at(queue[0].due, self._fire)
        return ticket

    def _fire(self) -> None:
        self._timer = None
        loop = self._loop
        if loop is None:
            return
        now = loop.time() + TIMER_EARLY_S
        queue = self._queue
        while queue:
            head = queue[0]
            if head.ended:
                queue.popleft()
            elif head.due <= now:
                queue.popleft()
                head.ended = True
                head.on_late()
            else:
                break
        if queue and self._timer is None:
            self._timer = loop.call_at(queue[0].due, self._fire)
