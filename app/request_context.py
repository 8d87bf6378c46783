"""The request the current task serves: its request id, its V2 `id`, and its trace when it is traced.

Every HTTP request gets a RequestContext from the outermost middleware (app/http/request_ids.py),
held in a context variable: uvicorn runs each request in a task of its own, so whatever runs
for that request (a handler, the error table, the access log, the batcher's submit) reads the
same one without it being passed along. The error body and the log lines read the ids here;
the tracing hooks below are plain calls that return at once for a request nobody traces.

No web, no OpenTelemetry: the logging setup and the engine's side of tracing import this too.
"""

from __future__ import annotations

import itertools
import secrets
from contextvars import ContextVar
from typing import Protocol


class StageMarks(Protocol):
    """What a traced request records at the handler's stage boundaries (app/tracing/spans.py: RequestTrace)."""

    def decoded(self, shape: tuple[int, ...], dtype: str) -> None: ...

    def resumed(self) -> None: ...


class RequestContext:
    """One request's ids, and its trace (None unless this request is traced)."""

    __slots__ = ("request_id", "trace", "v2_id")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.v2_id: str | None = None  # the V2 request's `id`, once its body is decoded
        self.trace: StageMarks | None = None


CURRENT: ContextVar[RequestContext | None] = ContextVar("ffn_request", default=None)

# A request id is this process's random prefix and a counter: unique across processes and
# restarts with overwhelming odds, and ~10x cheaper than a uuid4 on every request. Workers are
# spawned (not forked), so each imports this module afresh and draws its own prefix.
_PREFIX = secrets.token_hex(6)
_COUNTER = itertools.count(1)


def new_request_id() -> str:
    """A fresh request id: 12 random hex digits of this process, then a per-process counter in hex."""
    return f"{_PREFIX}{next(_COUNTER):08x}"


def current() -> RequestContext | None:
    return CURRENT.get()


def named(v2_id: str | None) -> None:
    """The V2 request's `id`, as soon as its body has been parsed (None: it sent none)."""
    context = CURRENT.get()
    if context is not None:
        context.v2_id = v2_id


def decoded(shape: tuple[int, ...], dtype: str) -> None:
    """The request's body is decoded to rows: `shape` and `dtype` as sent."""
    context = CURRENT.get()
    if context is not None and context.trace is not None:
        context.trace.decoded(shape, dtype)


def resumed() -> None:
    """The handler has its answer from the engine and starts encoding it."""
    context = CURRENT.get()
    if context is not None and context.trace is not None:
        context.trace.resumed()
