"""Who a request is, whichever door it came through: its API key, its request id, its context.

- The key: `Authorization: Bearer <key>` over HTTP, the `authorization` metadata over gRPC; the
  scheme is case-insensitive (RFC 7235), the token compared in constant time.
- The request id: a client's `X-Request-Id` (header or metadata) is kept when it is 1 to 200
  characters among letters, digits and `-_.:+/=@` (a UUID, nginx's $request_id, Heroku's ids all
  fit), since it lands in log lines and spans. Anything else, or the header twice, is replaced by
  an id of the server's, as Envoy and nginx do: an optional tracing header never costs a request.
  The replacement is logged, at most once a minute (with how many were replaced since), so that
  a client sending bad ids cannot fill the log either.
- The request the current task serves (RequestContext): its id, its V2 `id` and its trace when it
  is traced, in a context variable. Each door sets it for the request it serves (uvicorn and
  grpc.aio run each request in a task of its own), so that whatever runs for that request (a
  handler, the error table, the access log, the batcher's submit) reads the same one without it
  being passed along. The tracing hooks below are plain calls that return at once for a request
  nobody traces. No web, no OpenTelemetry: the logging setup and the tracing import this too.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import os
import re
import secrets
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any, Protocol

from app.observe.throttle import Throttle

log = logging.getLogger("ffn_serve")
MAX_REQUEST_ID_LENGTH = 200  # a client's X-Request-Id lands in log lines and spans (the protocol's limit)


class StageMarks(Protocol):
    """What a traced request records at the handler's stage boundaries (app/tracing/spans.py: RequestTrace),
    and what crosses to an engine process and back with it (app/handoff)."""

    def decoded(self, shape: tuple[int, ...], dtype: str) -> None: ...

    def resumed(self) -> None: ...

    def handed_off(self) -> tuple[int, int, int]:
        """Its span's trace id, span id and trace flags: what an engine process links its batches to."""
        ...

    def rode_in_engine(self, rides: Sequence[tuple[Any, ...]]) -> None:
        """What an engine process reported of the batches (or Monte Carlo slices) its rows ran in."""
        ...


class RequestContext:
    """One request's ids, and its trace (None unless this request is traced)."""

    __slots__ = ("computed_by", "request_id", "trace", "v2_id")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.v2_id: str | None = None  # the V2 request's `id`, once its body is decoded
        self.trace: StageMarks | None = None
        # Where another process computed the answer (a front's engine, app/handoff): the model copy
        # that did, (name, version, digest), which the answer names even if a reload raced it there.
        self.computed_by: tuple[str, int, str] | None = None


class RequestGroup(RequestContext):
    """Several requests computed as one (an engine process's group of a front's requests): their ids,
    None for one that came with none (at least one has one). `request_id` is the first id, for what reads one."""

    __slots__ = ("request_ids",)

    def __init__(self, request_ids: list[str | None]) -> None:
        super().__init__(next(rid for rid in request_ids if rid is not None))
        self.request_ids = request_ids


CURRENT: ContextVar[RequestContext | None] = ContextVar("ffn_request", default=None)

# A request id is this process's random prefix and a counter: unique across processes and
# restarts with overwhelming odds, and ~10x cheaper than a uuid4 on every request. The workers are
# forked from a fork server that imported this module (app/process/supervisor.py): each child draws its own.
_PREFIX = ""
_COUNTER = itertools.count(1)


def _draw_prefix() -> None:
    global _PREFIX, _COUNTER
    _PREFIX, _COUNTER = secrets.token_hex(6), itertools.count(1)


_draw_prefix()
os.register_at_fork(after_in_child=_draw_prefix)


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


REQUEST_ID_HEADER = b"x-request-id"  # HTTP's header and gRPC's metadata key alike
_VALID_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:+/=@-]{1,%d}" % MAX_REQUEST_ID_LENGTH)


def bearer_matches(given: bytes, key: bytes) -> bool:
    """Whether an Authorization value (HTTP header or gRPC metadata) is `Bearer <key>`."""
    scheme, _, token = given.partition(b" ")
    return hmac.compare_digest(token, key) and scheme.lower() == b"bearer"


def request_id_problem(values: list[bytes]) -> str | None:
    """Why the X-Request-Id values given cannot be the request's id; None if they can (or there are none)."""
    if len(values) > 1:
        return f"send at most one X-Request-Id header, not {len(values)}"
    if values and _VALID_REQUEST_ID.fullmatch(values[0]) is None:
        return (
            f"X-Request-Id must be 1 to {MAX_REQUEST_ID_LENGTH} characters among letters, digits and -_.:+/=@ "
            f"(got {len(values[0])} bytes)"
        )
    return None


def request_id_from(values: list[bytes]) -> tuple[bytes, bool]:
    """The request's id (ASCII): the client's when it follows the rule, else a fresh one; and whether it was replaced."""
    problem = request_id_problem(values) if values else None
    if values and problem is None:
        return values[0], False
    if problem is not None and (count := _REPLACED.due()):
        log.warning(
            "replaced a client's X-Request-Id with one of the server's (%d since the last line): %s", count, problem
        )
    return new_request_id().encode("ascii"), problem is not None


_REPLACED = Throttle()  # replaced request ids: a client can send a bad one with every request
