"""The spans of a traced request and of the batches it rode in, exported over OTLP/HTTP.

Imported only when tracing is on (app/tracing/__init__.py: start_tracing), with the OpenTelemetry
SDK and exporter it needs. What one traced request leaves:

    POST /v2/models/{name}/infer      SERVER span: the whole request, from the fast path's start
    ├── decode                        headers, body read and decoded to rows
    ├── queue                         from the batcher's submit to its batch's start
    ├── compute                       its batch on the device (several, for a request cut into chunks;
    │                                 for Monte Carlo dropout, every slice of passes, one event each)
    └── encode                        from the handler's resuming to the answer's bytes
    links ──▶ batch                   one span per batch a traced request rode in, its own trace
                                      (rows, bucket, device, every request id in it), linking back

With a shared engine (app/handoff) the request span and its stages are the front's, the batch
spans the engine process's: a traced request crosses with its id and its span's context
(`RequestTrace.handed_off`), the engine links its batches to that context (`HandedOffTrace`), and
the answer brings back each batch's span context and times, which the front's span links to and
times its queue and compute stages by (`RequestTrace.rode_in_engine`). Only traced requests
cross with an id: a batch span there names the traced requests in it.

Every request span and stage span carries the request id (X-Request-Id) and the V2 `id` when
the request has one. The trace's parent is the request's `traceparent` when it names a valid
one (W3C trace context, read by OpenTelemetry's propagator; an invalid one starts a new trace,
as the specification says), and the answer carries the request span's `traceparent`.

The stage spans are made when the request ends, from times recorded on the way (one clock read
per stage), so the request path itself does no span work; nothing here runs for a request that
is not traced but a look at its Policy. Spans are never made current in OpenTelemetry's context
and no global provider is set: FastAPI's own instrumentation, which turns on when one is, stays
off.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import (
    Link,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    get_current_span,
)
from opentelemetry.trace import set_span_in_context as in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from app import __version__
from app.config.tracing import Export
from app.engine.observe import Entry
from app.engine.service import ServedModel
from app.observe.identity import RequestContext, RequestGroup, current
from app.tracing.trace_settings import Policy, TraceSettings

SCOPE_NAME = "ffn_serve"
MAX_ID_LENGTH = 256  # a V2 `id` is any string the client sent: a span holds this much of it
MAX_SLICE_EVENTS = 128  # OpenTelemetry's default event limit per span: more would be dropped anyway
BATCH_RIDE, SLICE_RIDE = "batch", "slice"  # what HandedOffTrace records, by kind
_EMPTY = Context()  # the parent of a request with no traced parent: never whatever is current
_PROPAGATOR = TraceContextTextMapPropagator()


class Tracing:
    """This process's tracers, its one span processor and exporter, and the trace settings they follow."""

    def __init__(self, export: Export, settings: TraceSettings, exporter: SpanExporter | None = None) -> None:
        """`exporter`: OTLP/HTTP to `export.endpoint` unless given (its headers, timeout, compression from OTEL_*)."""
        self.export = export
        self.settings = settings
        resource = Resource.create({"service.version": __version__, "service.instance.id": _instance()})
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": "ffn-serve"}))  # unless OTEL_SERVICE_NAME says
        self._processor = BatchSpanProcessor(exporter or OTLPSpanExporter(endpoint=export.endpoint))
        # Requests follow OTEL_TRACES_SAMPLER; a batch is recorded whenever a recorded request rode in it,
        # which only a provider of its own, always on, can say (the batch starts a trace of its own).
        requests = TracerProvider(resource=resource, shutdown_on_exit=False)
        batches = TracerProvider(resource=resource, sampler=ALWAYS_ON, shutdown_on_exit=False)
        for provider in (requests, batches):
            provider.add_span_processor(self._processor)
        self.tracer = requests.get_tracer(SCOPE_NAME, __version__)
        self.batch_tracer = batches.get_tracer(SCOPE_NAME, __version__)
        self._sending: set[asyncio.Future[bool]] = set()

    def begin(
        self, name: str, headers: Sequence[tuple[bytes, bytes]], attributes: dict[str, Any], model: str | None
    ) -> RequestTrace | None:
        """The trace of the current request, named `name`, if it is traced; None (and nothing started) if not.

        Either door calls it: `headers` are the request's (HTTP headers or gRPC metadata, names in
        lower case), where a `traceparent` joins the caller's trace; `attributes` are the door's
        own (HTTP's method, route and path; gRPC's service and method).
        """
        context = current()
        if context is None:
            return None
        policy = self.settings.policy(model)
        if not policy.level:
            return None
        parent = remote_parent(headers)
        if parent is None and not policy.take_turn():
            return None
        span = self.tracer.start_span(name, context=parent or _EMPTY, kind=SpanKind.SERVER)
        if not span.is_recording():  # the sampler said no: nothing to end, nothing to export
            return None
        # Set once recorded, not given to the sampler: OpenTelemetry's samplers decide on the trace
        # id and the parent, and a request the sampler drops should cost as little as can be.
        span.set_attributes(
            {
                **attributes,
                "ffn.request_id": context.request_id,
                **({} if model is None else {"ffn.model_name": model}),
            }
        )
        if parent is None:
            policy.traced_one()
        trace = RequestTrace(self, span, policy, context)
        context.trace = trace
        return trace

    def observer(self, served: ServedModel) -> ModelObserver:
        return ModelObserver(self, served)

    @staticmethod
    def handed_off(request_id: str, trace_id: int, span_id: int, flags: int) -> HandedOffRequest:
        """In an engine process: the context of a front's traced request, for the batcher to tag its entries with."""
        span = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags))
        return HandedOffRequest(request_id, HandedOffTrace(span))

    def observe(self, served: ServedModel) -> None:
        """Trace the batches of `served` (each copy of a model its own observer)."""
        served.set_observer(self.observer(served))

    def send_now(self) -> None:
        """Export what has been collected, off the event loop (log_frequency's turn came)."""
        future = asyncio.get_running_loop().run_in_executor(None, self._processor.force_flush)
        self._sending.add(future)
        future.add_done_callback(self._sending.discard)

    async def shutdown(self) -> None:
        """Export what is left and stop the exporter (bounded by the exporter's own timeout)."""
        await asyncio.to_thread(self._processor.shutdown)


def remote_parent(headers: Sequence[tuple[bytes, bytes]]) -> Context | None:
    """The context a valid `traceparent` (with its `tracestate`) names; None without one.

    Two traceparent headers are invalid (W3C trace context, 3.2): the request starts a new trace.
    """
    parent: str | None = None
    states: list[str] = []
    for name, value in headers:
        if name == b"traceparent":
            if parent is not None:
                return None
            parent = value.decode("latin-1")
        elif name == b"tracestate":
            states.append(value.decode("latin-1"))
    if parent is None:
        return None
    carrier = {"traceparent": parent}
    if states:
        carrier["tracestate"] = ",".join(states)
    context = _PROPAGATOR.extract(carrier)
    return context if get_current_span(context).get_span_context().is_valid else None


class RequestTrace:
    """One traced request: its span, and the times of its stages until it ends."""

    __slots__ = (
        "_answered",
        "_arrived",
        "_batches",
        "_compute",
        "_context",
        "_decoded",
        "_input",
        "_output",
        "_passes",
        "_policy",
        "_resumed",
        "_slices",
        "_started",
        "_tracing",
        "span",
    )

    def __init__(self, tracing: Tracing, span: Span, policy: Policy, context: RequestContext) -> None:
        self._tracing, self.span, self._policy, self._context = tracing, span, policy, context
        self._started = time.time_ns()
        self._decoded = self._resumed = self._answered = 0
        self._arrived = 0  # when its rows were submitted to the batcher
        self._compute: list[int] = []  # [first batch's start, last batch's end]
        self._batches = 0
        self._slices: list[tuple[int, int]] = []  # Monte Carlo: (end, passes done) of each slice
        self._passes = 0
        self._input: dict[str, Any] = {}
        self._output: dict[str, Any] = {}

    @property
    def request_id(self) -> str:
        return self._context.request_id

    # ----- the stages, as they happen ----------------------------------------------------------

    def decoded(self, shape: tuple[int, ...], dtype: str) -> None:
        self._decoded = time.time_ns()
        if self._policy.tensors:
            self._input = {"ffn.input.shape": list(shape), "ffn.input.dtype": dtype}

    def resumed(self) -> None:
        self._resumed = time.time_ns()

    def span_context(self) -> SpanContext:
        return self.span.get_span_context()

    def handed_off(self) -> tuple[int, int, int]:
        context = self.span.get_span_context()
        return context.trace_id, context.span_id, int(context.trace_flags)

    def rode_in_engine(self, rides: Sequence[tuple[Any, ...]]) -> None:
        """What `HandedOffTrace` recorded in the engine process, as if its batches had run here."""
        for ride in rides:
            if ride[0] == BATCH_RIDE:
                _, trace_id, span_id, arrived, started, ended = ride
                self.rode(SpanContext(trace_id, span_id, is_remote=True), arrived, started, ended)
            else:
                _, arrived, started, ended, passes_done = ride
                self.sliced(arrived, started, ended, passes_done)

    def rode(self, batch: SpanContext, arrived: int, started: int, ended: int) -> None:
        """Its rows (or a chunk of them) ran in `batch` from `started` to `ended` (epoch ns)."""
        self.span.add_link(batch)
        self._batches += 1
        self._ran(arrived, started, ended)

    def sliced(self, arrived: int, started: int, ended: int, passes_done: int) -> None:
        """A slice of its Monte Carlo passes ran; `passes_done` in all so far."""
        self._passes = passes_done
        if len(self._slices) < MAX_SLICE_EVENTS:
            self._slices.append((ended, passes_done))
        self._ran(arrived, started, ended)

    def _ran(self, arrived: int, started: int, ended: int) -> None:
        if not self._compute:
            self._arrived = arrived
            self._compute = [started, ended]
        else:
            self._compute[1] = max(self._compute[1], ended)

    def answered(
        self, attributes: dict[str, Any], *, failed: bool, error_type: str | None, output_bytes: int, content_type: str
    ) -> dict[str, str]:
        """The answer is ready to send: its status on the span; what to add to the answer (its `traceparent`).

        `attributes`: the door's status (http.response.status_code, rpc.grpc.status_code); `failed`:
        the server's failure, not a client's mistake (its semantic conventions say which).
        """
        self._answered = time.time_ns()
        self.span.set_attributes(attributes)
        if error_type is not None:
            self.span.set_attribute("error.type", error_type)
        if failed:
            self.span.set_status(Status(StatusCode.ERROR, error_type))
        if self._policy.tensors:
            self._output = {"ffn.output.bytes": output_bytes, "ffn.output.content_type": content_type}
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=in_context(self.span))
        return carrier

    # ----- the end: its stage spans, then its own --------------------------------------------

    def end(self) -> None:
        ids = {"ffn.request_id": self._context.request_id}
        v2_id = self._context.v2_id
        if v2_id is not None:
            ids["ffn.v2_id"] = v2_id[:MAX_ID_LENGTH]
            self.span.set_attribute("ffn.v2_id", ids["ffn.v2_id"])
        if self._decoded:
            self._stage("decode", self._started, self._decoded, {**ids, **self._input})
        if self._compute:
            started, ended = self._compute
            self._stage("queue", self._arrived, started, ids)
            compute = self._stage("compute", started, ended, {**ids, **self._compute_attributes()}, end_now=False)
            for at, done in self._slices:
                compute.add_event("slice", {"ffn.mc.passes_done": done}, timestamp=at)
            compute.end(end_time=ended)
        if self._resumed and self._answered:
            self._stage("encode", self._resumed, self._answered, {**ids, **self._output})
        self.span.end()
        if self._policy.collected_one():
            self._tracing.send_now()

    def _compute_attributes(self) -> dict[str, Any]:
        if self._slices:
            return {"ffn.mc.passes": self._passes, "ffn.mc.slices": len(self._slices)}
        return {"ffn.batches": self._batches}

    def _stage(self, name: str, start: int, end: int, attributes: dict[str, Any], *, end_now: bool = True) -> Span:
        span = self._tracing.tracer.start_span(
            name, context=in_context(self.span), start_time=start, attributes=attributes
        )
        if end_now:
            span.end(end_time=max(start, end))
        return span


class ModelObserver:
    """The batch observer of one model (app/engine/observe.py): a span for each batch a traced request rode in."""

    def __init__(self, tracing: Tracing, served: ServedModel) -> None:
        self._tracing = tracing
        self._model = served.name
        self._device = str(served.device)
        self._computed_rows = served.computed_rows

    def tag(self) -> RequestContext | None:
        """Every request's context, traced or not: a batch span names every request that rode in it."""
        return current()

    def batch(self, entries: Sequence[Entry], started: float, ended: float, rows: int) -> None:
        traces = [_trace_of(entry) for entry in entries]
        traced = {id(trace): trace for trace in traces if trace is not None}
        if not traced:
            return
        to_epoch = time.time_ns() - time.perf_counter_ns()
        start, end = _ns(started, to_epoch), _ns(ended, to_epoch)
        named: list[str] = []
        untagged = 0  # requests with no id to list (an engine's caller that gave none): counted all the same
        for entry in entries:
            tag = entry.tag
            if isinstance(tag, RequestGroup):  # an engine process's group of a front's requests
                ids = [rid for rid in tag.request_ids if rid is not None]
                named += ids
                untagged += entry.requests - len(ids)
            elif isinstance(tag, RequestContext):
                named.append(tag.request_id)
            else:
                untagged += entry.requests
        request_ids = list(dict.fromkeys(named))
        span = self._tracing.batch_tracer.start_span(
            "batch",
            context=_EMPTY,
            kind=SpanKind.INTERNAL,
            links=[Link(trace.span_context()) for trace in traced.values()],
            start_time=start,
            attributes={
                "ffn.model_name": self._model,
                "ffn.batch.rows": rows,
                "ffn.batch.bucket": self._computed_rows(rows),
                "ffn.batch.device": self._device,
                "ffn.batch.requests": len(request_ids) + untagged,
                "ffn.request_ids": request_ids,
            },
        )
        span.end(end_time=end)
        batch = span.get_span_context()
        for entry, trace in zip(entries, traces, strict=True):
            if trace is not None:
                trace.rode(batch, _ns(entry.arrived, to_epoch), start, end)

    def monte_carlo_slice(self, entry: Entry, started: float, ended: float) -> None:
        trace = _trace_of(entry)
        if trace is None or entry.passes is None:
            return
        to_epoch = time.time_ns() - time.perf_counter_ns()
        trace.sliced(_ns(entry.arrived, to_epoch), _ns(started, to_epoch), _ns(ended, to_epoch), entry.passes.done)


class HandedOffTrace:
    """In an engine process, a front's traced request: its span's context, which the batches it rides in
    link to, and what it rode in, for the answer to carry back (the front's `RequestTrace.rode_in_engine`)."""

    __slots__ = ("_context", "rides")

    def __init__(self, context: SpanContext) -> None:
        self._context = context
        self.rides: list[tuple[Any, ...]] = []

    def span_context(self) -> SpanContext:
        return self._context

    def rode(self, batch: SpanContext, arrived: int, started: int, ended: int) -> None:
        self.rides.append((BATCH_RIDE, batch.trace_id, batch.span_id, arrived, started, ended))

    def sliced(self, arrived: int, started: int, ended: int, passes_done: int) -> None:
        self.rides.append((SLICE_RIDE, arrived, started, ended, passes_done))


class HandedOffRequest(RequestContext):
    """An engine process's context of a front's traced request: its id, and its HandedOffTrace."""

    __slots__ = ("handed_off",)

    def __init__(self, request_id: str, handed_off: HandedOffTrace) -> None:
        super().__init__(request_id)
        self.handed_off = handed_off


def _trace_of(entry: Entry) -> RequestTrace | HandedOffTrace | None:
    """The trace of the request an entry belongs to, if that request is traced."""
    tag = entry.tag
    if isinstance(tag, HandedOffRequest):
        return tag.handed_off
    if isinstance(tag, RequestContext) and isinstance(tag.trace, RequestTrace):
        return tag.trace
    return None


def _ns(perf_counter_s: float, to_epoch: int) -> int:
    """A time.perf_counter() reading as nanoseconds since the epoch."""
    return round(perf_counter_s * 1e9) + to_epoch


def _instance() -> str:
    """service.instance.id: this serving process, told apart from its siblings and from other hosts'."""
    return f"{socket.gethostname()}:{os.getpid()}"
