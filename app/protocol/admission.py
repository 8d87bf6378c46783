"""Admission: the budgets a request takes, whichever door it came through: bytes held, and its deadline.

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

from app.protocol.errors import InvalidInput, TooManyBytesHeld
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
