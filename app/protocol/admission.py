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
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
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
