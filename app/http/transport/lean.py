"""The lean path: a plain tensor request served inside the HTTP protocol, below ASGI.

For a request the model answers in microseconds, ASGI's machinery costs more than the rest: a
scope dict, a task and a contextvars copy per request, receive and send messages, Starlette's
Request and Response, the edge's middleware calls. Here the protocol (protocol.py) hands each
plain `POST /v1/models/{name}/transform` and `POST /v2/models/{name}[/versions/{v}]/infer` to the
`LeanDoor` as soon as its head is parsed (and KServe V1's `POST /v1/models/{name}:predict`). For a transform the door decides once per distinct head
what it means (a plan, app/protocol/plans.py); a V2 request's meaning is in its body, decoded by
the V2 infer step both paths call (app/protocol/v2/infer.py). The door collects the body as the
parser delivers it, and when it is whole decodes it, queues its rows (`infer_soon`: an entry and a
future, no task) and writes the answer from the future's callback, head and body in one write.
FastAPI still declares the routes (OpenAPI, /docs) and serves every other one.

Every rule of the full path holds, taken from the same code: the guard's head size, Transfer-
Encoding, metrics-port and API-key checks; the model's state; the plan's checks (415, 406, the
raw shape and dtype); the deadline; the body's declared size against `max_body_bytes` and the
process's held bytes; the decode's and the batcher's refusals; the client hanging up; the request
id (and a V2 request's `id` in its error bodies); the outcome in ffn_requests_total and the whole
time in ffn_http_request_seconds. The door takes only what it can answer exactly as the full path
would, and leaves everything else to it (`admit` returns None): a head the full path would refuse
(its answer is then the full path's own), a compressed body or answer, a traced server, a CORS
request, a pipelined request behind another, a chunked body, `Expect: 100-continue`, a query
string (native Monte Carlo), a path with escapes.
tests/test_lean.py sends the suite's bad-input and hostile cases through both and compares them.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
from prometheus_client import Histogram
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from app.http.errors import error_body
from app.observe.identity import CURRENT, RequestContext, bearer_matches, request_id_from
from app.observe.metrics import observe_many
from app.protocol import kserve_v1
from app.protocol.admission import Hold, deadline_from
from app.protocol.digest import DIGEST_HEADER
from app.protocol.errors import INTERNAL, ClientDisconnected, error_type_of, kind_of, message_of
from app.protocol.fields import answer_coding
from app.protocol.native import DecodedInput
from app.protocol.plans import NativePlan, PlanCache, native_plan
from app.protocol.state import ServiceState
from app.protocol.v2 import codec as v2_codec
from app.protocol.v2 import infer as infer_step

log = logging.getLogger("ffn_serve")

ROUTE = "/v1/models/{name}/transform"
V2_ROUTE = "/v2/models/{name}/infer"
V2_VERSION_ROUTE = "/v2/models/{name}/versions/{version}/infer"
PREDICT_ROUTE = "/v1/models/{name}:predict"  # KServe V1
ROUTES = (ROUTE, V2_ROUTE, V2_VERSION_ROUTE, PREDICT_ROUTE)
# The tensor routes' paths with plain names: no escapes, query or fragment (those go the full way,
# which decodes them as Starlette does). A name's characters are a path segment's unreserved and sub-delims.
_SEGMENT = rb"[A-Za-z0-9._~!$&'()*+,;=:@-]+"
_PATHS = re.compile(
    rb"/v1/models/(?:(?P<native>%s)/transform|(?P<kserve>%s):predict)"
    rb"|/v2/models/(?P<v2>%s)(?:/versions/(?P<version>%s))?/infer" % (_SEGMENT, _SEGMENT, _SEGMENT, _SEGMENT)
)
MAX_LENGTH_DIGITS = 18  # a Content-Length past this is no body this service takes (and int() stays cheap)
HUNG_UP = error_type_of(ClientDisconnected(""))  # how a request whose client left is counted
_PLANNED = (b"content-type", b"x-shape", b"x-dtype", b"accept", b"accept-encoding", b"inference-header-content-length")
# What admit does with a header field, found with one lookup (most of a request's fields, Host
# and User-Agent, are none of these): a planned one's index in _PLANNED, or one of the kinds below.
_LENGTH, _AUTHORIZATION, _REQUEST_ID, _TIMEOUT, _FULL_WAY, _ORIGIN = range(len(_PLANNED), len(_PLANNED) + 6)
_FIELDS: dict[bytes, int] = {field: at for at, field in enumerate(_PLANNED)} | {
    b"content-length": _LENGTH,
    b"authorization": _AUTHORIZATION,
    b"x-request-id": _REQUEST_ID,
    b"x-timeout-ms": _TIMEOUT,
    b"transfer-encoding": _FULL_WAY,
    b"content-encoding": _FULL_WAY,
    b"origin": _ORIGIN,  # the full way where CORS is on: its middleware answers it
}


class LeanProtocol(Protocol):
    """What the door reads of the connection's protocol (app/http/transport/protocol.py)."""

    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    parser: Any
    url: bytes
    headers: list[tuple[bytes, bytes]]
    server: tuple[str, int | None] | None
    client: tuple[str, int] | None
    server_state: Any
    expect_100_continue: bool
    access_log: bool
    access_logger: logging.Logger

    def on_response_complete(self) -> None: ...


class HttpPlan:
    """A head's plan with what the HTTP door adds: the answer's fixed header lines, preformatted."""

    __slots__ = ("compressed", "core", "fixed_head", "head")

    def __init__(self, core: NativePlan, head: tuple[str | None, ...], compressed: bool) -> None:
        self.core = core
        self.head = head  # Content-Type, X-Shape, X-Dtype, Accept: what the plan was made from
        self.compressed = compressed  # the client takes a coding: the full path compresses, this one does not
        self.fixed_head = b"".join(_header_line(name, value) for name, value in core.answer_headers)

    def for_copy(self, served: Any) -> HttpPlan:
        """The same head planned for another copy of the model (a reload swapped it); its error if it does not fit."""
        content_type, shape, dtype, accept = self.head
        return HttpPlan(native_plan(served, content_type, shape, dtype, accept), self.head, self.compressed)


def _header_line(name: str, value: str) -> bytes:
    return f"{name}: {value}\r\n".encode("latin-1")


_PREDICTIONS_HEAD = f"content-type: {kserve_v1.MEDIA_TYPE}\r\n".encode()


class _NoEvent:
    """uvicorn's `connection_lost` sets the cycle's message event; a lean request waits on none."""

    def set(self) -> None:
        return None


_NO_EVENT = _NoEvent()


class LeanDoor:
    """One app's lean path: its checks' settings, its plans, and its metrics' children."""

    def __init__(
        self,
        state: ServiceState,
        *,
        api_key: str | None,
        metrics_port: int | None,
        cors: bool,
        histogram: Histogram,
        protocols: dict[str, str],
    ) -> None:
        """`histogram`: ffn_http_request_seconds; `protocols`: its `protocol` label for each of ROUTES (the edge's protocol_of)."""
        settings = state.settings
        self.state = state
        self.engine = state.engine
        self._key = api_key.encode() if api_key else None
        self._metrics_port = metrics_port
        self._cors = cors
        self._max_header_bytes = settings.max_header_bytes
        self.max_body_bytes = settings.max_body_bytes
        self.max_queue_rows = settings.max_queue_rows
        self._default_timeout_ms = settings.default_timeout_ms
        # The paths it serves: the protocol matches them before it calls `admit`, so that a request
        # on any other route never enters this module.
        self.paths = _PATHS
        self._plans: PlanCache[HttpPlan] = PlanCache()
        self._timers = {
            (route, status_class): histogram.labels(protocol=protocols[route], route=route, status=f"{status_class}xx")
            for route in ROUTES
            for status_class in (2, 4, 5)
        }
        self._head_date: tuple[object, bytes] = (None, b"")
        # Each request's outcome and time, kept as plain values and observed once per turn of the loop.
        self._outcomes: dict[tuple[str, str], int] = {}
        self._times: dict[tuple[str, int], list[float]] = {key: [] for key in self._timers}
        self._flush_due = False

    # ----- the head: take the request, or leave it to the full path ----------------------------

    def admit(self, protocol: LeanProtocol, match: re.Match[bytes]) -> LeanRequest | None:
        """The lean request for the head just parsed, whose path `paths` matched; or None: the full path answers it."""
        parser = protocol.parser
        if parser.get_method() != b"POST" or protocol.expect_100_continue or parser.should_upgrade():
            return None
        server = protocol.server
        if self._metrics_port is not None and server is not None and server[1] == self._metrics_port:
            return None
        # One pass over the headers: the guard's size of the head, and the values that matter.
        size = 16 + len(protocol.url)  # the guard's estimate: the method, path and 12 bytes of framing
        planned: list[bytes | None] = [None] * len(_PLANNED)
        length = authorization = timeout = None
        request_ids: list[bytes] = []
        for field, value in protocol.headers:
            size += len(field) + len(value) + 4
            kind = _FIELDS.get(field)
            if kind is None:
                continue
            if kind < _LENGTH:
                if planned[kind] is None:  # the first, as Starlette's Headers.get reads it
                    planned[kind] = value
            elif kind == _LENGTH:
                length = value if length is None else b"twice"  # two: not digits, so the full way
            elif kind == _AUTHORIZATION:
                if authorization is None:  # the first, as the guard reads it
                    authorization = value
            elif kind == _REQUEST_ID:
                request_ids.append(value)
            elif kind == _TIMEOUT:
                if timeout is None:
                    timeout = value
            elif kind == _FULL_WAY or (kind == _ORIGIN and self._cors):
                return None
        if size > self._max_header_bytes:
            return None
        if self._key is not None and not bearer_matches(authorization or b"", self._key):
            return None
        # Content-Length as llhttp took it: digits alone (anything else, or none, goes the full way).
        if length is None or not length.isdigit() or len(length) > MAX_LENGTH_DIGITS:
            return None
        declared = int(length)
        if declared > self.max_body_bytes:
            return None
        try:
            native, kserve = match["native"], match["kserve"]
            timeout_ms = None if timeout is None else timeout.decode("latin-1")
            if native is not None:
                route, name, version = ROUTE, native.decode("ascii"), None
                served = self.engine.model(name)
                served.check_serving()
                plan = self._plan(name, served, planned)
                if plan is None:
                    return None
                deadline = deadline_from(timeout_ms, self._default_timeout_ms)
            elif kserve is not None:  # KServe V1 predict: JSON instances, answered JSON predictions
                route, name, version, plan = PREDICT_ROUTE, kserve.decode("ascii"), None, None
                served = self.engine.model(name)
                served.check_serving()
                if not self._predict_head(served, planned):
                    return None
                deadline = deadline_from(timeout_ms, self._default_timeout_ms)
            else:  # V2 infer: its deadline, like the rest of what it asks, is in its body
                name = match["v2"].decode("ascii")
                version = None if match["version"] is None else match["version"].decode("ascii")
                route = V2_ROUTE if version is None else V2_VERSION_ROUTE
                served = self.engine.model(name, version)
                served.check_serving()
                if not self._v2_head(served, planned):
                    return None
                plan, deadline = None, None
            hold = Hold(self.state.held)
            hold.grow(declared)
        except Exception:  # the full path answers this head, and its error, itself
            return None
        request_id, _ = request_id_from(request_ids)
        keep_alive = parser.should_keep_alive() and not getattr(protocol, "closing", False)
        header_length = planned[5]
        return LeanRequest(
            self,
            protocol,
            route,
            name,
            plan,
            request_id,
            deadline,
            hold,
            keep_alive,
            version=version,
            header_length=None if header_length is None else header_length.decode("latin-1"),
        )

    @staticmethod
    def _predict_head(served: Any, planned: Sequence[bytes | None]) -> bool:
        """Whether the lean path takes a KServe V1 predict head (else the full path answers it); its 415 raised."""
        content_type, accept_encoding = planned[0], planned[4]
        kserve_v1.check_content(None if content_type is None else content_type.decode("latin-1"))
        return answer_coding(None if accept_encoding is None else accept_encoding.decode("latin-1")) is None

    @staticmethod
    def _v2_head(served: Any, planned: Sequence[bytes | None]) -> bool:
        """Whether the lean path takes a V2 infer head (else the full path answers it); its 415 raised."""
        content_type, accept_encoding, header_length = planned[0], planned[4], planned[5]
        if header_length is None:  # with the binary extension the body is not JSON, whatever its Content-Type
            v2_codec.check_content(None if content_type is None else content_type.decode("latin-1"))
        return answer_coding(None if accept_encoding is None else accept_encoding.decode("latin-1")) is None

    def _plan(self, name: str, served: Any, planned: Sequence[bytes | None]) -> HttpPlan | None:
        """The head's plan for the copy serving now: cached, or made (raising the head's own error)."""
        key = (name, *planned[:5])
        plan = self._plans.get(key)
        if plan is None or not plan.core.is_for(served):
            content_type, shape, dtype, accept, accept_encoding, _ = (
                None if value is None else value.decode("latin-1") for value in planned
            )
            core = native_plan(served, content_type, shape, dtype, accept)
            head = (content_type, shape, dtype, accept)
            plan = HttpPlan(core, head, compressed=answer_coding(accept_encoding) is not None)
            self._plans.put(key, plan)
        return None if plan.compressed else plan

    # ----- the answer -----------------------------------------------------------------------------

    def head(self, protocol: LeanProtocol, status: int, lines: bytes, length: int, keep_alive: bool) -> bytes:
        """An answer's head: status line, the server's default headers (its Date), `lines`, the length."""
        defaults = protocol.server_state.default_headers
        cached_for, date = self._head_date
        if cached_for is not defaults:  # uvicorn renews the list (its Date) every second
            date = b"".join(name + b": " + value + b"\r\n" for name, value in defaults)
            self._head_date = (defaults, date)
        close = b"" if keep_alive else b"connection: close\r\n"
        return b"%s%s%scontent-length: %d\r\n%s\r\n" % (STATUS_LINE[status], date, lines, length, close)

    def ended(
        self, loop: asyncio.AbstractEventLoop, route: str, model: str, outcome: str, status: int, started: float
    ) -> None:
        """A request ended: its outcome (ffn_requests_total) and time (ffn_http_request_seconds), counted at
        the end of this turn of the loop with every other request's, before anything can read them."""
        self._times[route, status // 100].append(time.perf_counter() - started)
        key = (model, outcome)
        self._outcomes[key] = self._outcomes.get(key, 0) + 1
        if not self._flush_due:
            self._flush_due = True
            loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        outcomes, self._outcomes = self._outcomes, {}
        for (model, outcome), count in outcomes.items():
            self.state.outcomes.counter(model, outcome).inc(count)
        for key, times in self._times.items():
            if times:
                observe_many(self._timers[key], times)
                times.clear()


class LeanRequest:
    """One request the lean path serves; the protocol keeps it as its `cycle` until it is answered.

    It answers to what the protocol and uvicorn read of a cycle (`response_complete`,
    `keep_alive`, `disconnected`, `scope`, `message_event`, `transport`), so that the connection's
    budgets, drain and refusals treat it as any other request.
    """

    message_event = _NO_EVENT
    response_started = False

    def __init__(
        self,
        door: LeanDoor,
        protocol: LeanProtocol,
        route: str,
        name: str,
        plan: HttpPlan | None,
        request_id: bytes,
        deadline: float | None,
        hold: Hold,
        keep_alive: bool,
        *,
        version: str | None = None,
        header_length: str | None = None,
    ) -> None:
        """`plan`: a native transform's (with its `deadline`); None for KServe V1 (with its `deadline`) and V2 infer
        (`version`, `header_length`; its deadline is in its body)."""
        self.door = door
        self.protocol = protocol
        self.transport = protocol.transport
        self.route = route
        self.name = name
        self.plan = plan
        self.version = version
        self.header_length = header_length
        self.request_id = request_id
        self.context = RequestContext(request_id.decode("ascii"))  # what log lines and error bodies name
        self.deadline = deadline
        self.hold = hold
        self.keep_alive = keep_alive
        self.started = time.perf_counter()
        self.response_complete = False
        self.disconnected = False
        self.scope: dict[str, Any] = {}  # the protocol marks a refusal here (REFUSED)
        # The body as it arrived: views of the protocol's reads, or copies (protocol.py: _take_lean_body).
        self.chunks: list[bytes | memoryview] = []
        # uvicorn's access line, when its log is on: what it says of the request, read before a
        # pipelined request's head replaces the protocol's url.
        self.logged = (
            (protocol.url.decode("ascii"), protocol.parser.get_http_version()) if protocol.access_log else None
        )
        self.decoded: DecodedInput | None = None
        self.call: infer_step.InferCall | None = None
        self.served: Any = None
        self.future: asyncio.Future[Any] | None = None

    def body(self, chunk: bytes | memoryview) -> None:
        if not self.response_complete:
            self.chunks.append(chunk)

    def body_so_far(self) -> list[bytes | memoryview]:
        """The body's chunks read so far, handed over to the buffer its rest is read into (direct_body.py)."""
        chunks, self.chunks = self.chunks, []
        return chunks

    def complete(self) -> None:
        """The body is whole: decode it and queue its rows, or answer why not."""
        if self.response_complete:
            return
        chunks, self.chunks = self.chunks, []
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        del chunks
        if isinstance(body, memoryview) and (self.plan is None or self.plan.core.raw is None):
            # Only a raw body is viewed: the other decoders read bytes. Copied here, the view goes now,
            # and with it a large body's buffer (direct_body.py), before the decoder's parse holds more.
            body = bytes(body)
        token = CURRENT.set(self.context)
        try:
            # Looked up again: a reload may have swapped the copy while the body arrived. From here to
            # the batcher nothing awaits, so the copy the rows are checked against is the one they reach.
            served = self.door.engine.model(self.name, self.version)
            if self.plan is not None:
                future = self._queue_native(served, body)
            else:  # KServe V1's and V2's decoders read bytes (the body is, above)
                assert not isinstance(body, memoryview), "a body not viewed is made bytes above; this is a bug."
                queue = self._queue_predict if self.route == PREDICT_ROUTE else self._queue_v2
                future = queue(served, body)
        except Exception as exc:
            self._fail(exc)
            return
        finally:
            CURRENT.reset(token)
        self.future = future  # told its end through _computed, which each _queue_* hands on

    def _queue_native(self, served: Any, body: bytes | memoryview) -> asyncio.Future[np.ndarray]:
        assert self.plan is not None and self.deadline is not None, "a native request has its plan; this is a bug."
        if not self.plan.core.is_for(served):
            self.plan = self.plan.for_copy(served)
        plan = self.plan.core
        decoded = plan.decode(body, self.door.max_queue_rows)
        del body  # binary rows are a view of it: those bytes stay held, and counted
        if plan.encoding_in == "json":  # the body is gone, parsed into an array of its own
            self.hold.resize(decoded.rows.nbytes)
        self.decoded, self.served = decoded, served
        future: asyncio.Future[np.ndarray] = served.infer_soon(
            decoded.rows, plan.answer_dtype(decoded), deadline=self.deadline, settled=self._computed
        )
        return future

    def _queue_predict(self, served: Any, body: bytes) -> asyncio.Future[np.ndarray]:
        assert self.deadline is not None, "a KServe V1 request has its deadline from its head; this is a bug."
        decoded = kserve_v1.decode(body, served.d_model, self.door.max_queue_rows)
        del body
        self.hold.resize(decoded.rows.nbytes)  # the body is gone, parsed into an array of its own
        self.decoded = decoded
        future: asyncio.Future[np.ndarray] = served.infer_soon(
            decoded.rows, decoded.dtype, deadline=self.deadline, settled=self._computed
        )
        return future

    def _queue_v2(self, served: Any, body: bytes) -> asyncio.Future[Any]:
        call = infer_step.decoded(self.door.state, served, body, self.header_length)
        if not call.request.binary_input:  # JSON data or shared memory: the body is dropped, its tensor kept
            self.hold.resize(call.request.rows.nbytes)
        del body  # a binary input is a view of the body: those bytes stay held, and counted
        self.call, self.served = call, served
        rows, dtype = call.request.rows, call.request.dtype
        if call.monte_carlo is None:
            future: asyncio.Future[Any] = served.infer_soon(rows, dtype, deadline=call.deadline, settled=self._computed)
            return future
        # Monte Carlo dropout: rare and long (passes in slices), it runs as the full path runs it, in a task.
        task = asyncio.ensure_future(served.infer_monte_carlo(rows, call.monte_carlo, dtype, deadline=call.deadline))
        task.add_done_callback(self._computed)
        return task

    def _computed(self, future: asyncio.Future[Any]) -> None:
        if self.response_complete:  # the client left (or was refused) meanwhile: nobody reads an answer
            return
        token = CURRENT.set(self.context)
        try:
            error = future.exception()
            if error is not None:
                self._fail(error)
                return
            try:
                body, lines = self._encoded(future.result())
            except Exception as exc:
                self._fail(exc)
                return
            self._answer(200, lines, body, "ok")
        finally:
            CURRENT.reset(token)

    def _encoded(self, answer: Any) -> tuple[bytes | memoryview, bytes]:
        """The answer's body and its header lines beyond the server's own."""
        if self.plan is not None:
            assert self.decoded is not None, "a computed native request was decoded; this is a bug."
            body, extra = self.plan.core.encode(answer, self.decoded)
            # The digest of the copy that computed it: a front's model names the engine's copy (a reload may race).
            extra += ((DIGEST_HEADER, self.served.digest),)
            return body, self.plan.fixed_head + b"".join(_header_line(name, value) for name, value in extra)
        if self.route == PREDICT_ROUTE:
            assert self.decoded is not None, "a computed KServe V1 request was decoded; this is a bug."
            return kserve_v1.encode(answer, self.decoded), _PREDICTIONS_HEAD
        assert self.call is not None, "a computed V2 request was decoded; this is a bug."
        content, headers = infer_step.encoded(self.name, self.served, self.call, answer)
        return content, b"".join(_header_line(name, value) for name, value in headers.items())

    def _fail(self, exc: BaseException) -> None:
        """Answer `exc` as the one error table says (the full path's body, status and headers)."""
        assert isinstance(exc, Exception), "only Exceptions reach a lean request's answer; this is a bug."
        kind = kind_of(exc)
        request_id = self.request_id.decode("ascii")
        if kind is INTERNAL:  # a bug: keep its traceback; the client learns nothing internal
            log.exception("unhandled error in POST %s", self.route.replace("{name}", self.name), exc_info=exc)
            body = error_body("internal server error", "internal", request_id)
            headers: dict[str, str] = {}
        else:
            body = error_body(message_of(exc, "http"), kind.error_type, request_id)
            headers = kind.headers(exc)
        lines = b"content-type: application/json\r\n" + b"".join(
            _header_line(name, value) for name, value in headers.items()
        )
        if any(name.lower() == "connection" and value.lower() == "close" for name, value in headers.items()):
            self.keep_alive = False
        self._answer(kind.status, lines, body, error_type_of(exc))

    def _answer(self, status: int, lines: bytes, body: bytes | memoryview, outcome: str) -> None:
        """Write the answer, head and body in one vectored write (the body not copied), and end the request."""
        self.response_complete = True
        self._forget()
        transport = self.transport
        door = self.door
        if self.logged is not None:  # as uvicorn logs an answer it starts (app/observe/logs.py reads these five args)
            client = self.protocol.client
            path, version = self.logged
            address = f"{client[0]}:{client[1]}" if client else ""
            self.protocol.access_logger.info('%s - "%s %s HTTP/%s" %d', address, "POST", path, version, status)
        if not transport.is_closing():
            lines += b"x-request-id: " + self.request_id + b"\r\n"
            head = door.head(self.protocol, status, lines, len(body), self.keep_alive)
            transport.writelines((head, body))
            if not self.keep_alive:
                transport.close()
        self.hold.resize(0)
        door.ended(self.protocol.loop, self.route, self.name, outcome, status, self.started)
        self.protocol.on_response_complete()

    def abandon(self) -> None:
        """The client left, or the protocol refused the request: its rows are withdrawn, nothing is written.

        Counted as the full path counts a hang-up: client_closed_request, and a 4xx request time."""
        if self.response_complete:
            return
        self.response_complete = self.disconnected = True
        if self.future is not None:
            self.future.cancel()
        self._forget()
        self.chunks = []
        self.hold.resize(0)
        self.door.ended(self.protocol.loop, self.route, self.name, HUNG_UP, 499, self.started)

    def _forget(self) -> None:
        """Let the request's rows and answer go now (the request object lives on with its connection)."""
        self.future = self.decoded = self.call = self.served = None
