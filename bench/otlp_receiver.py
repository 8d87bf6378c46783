"""A real OTLP/HTTP trace receiver on 127.0.0.1, for tests and benchmarks: what an OpenTelemetry collector takes.

    with OtlpReceiver() as receiver:
        start_server(env={"FFN_OTLP_ENDPOINT": receiver.url})   # spans go to receiver.url + /v1/traces
        spans = receiver.wait_for(lambda spans: len(spans) >= 5)

It answers POST /v1/traces as the OTLP specification says (200 and an ExportTraceServiceResponse,
protobuf; gzip bodies read), decodes each ExportTraceServiceRequest with opentelemetry-proto's
generated classes, and keeps every span as a ReceivedSpan: ids in hex, attributes as Python
values, links, events, status and the resource's attributes. Anything else is a 404 or a 400.
"""

from __future__ import annotations

import gzip
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

PATH = "/v1/traces"


@dataclass
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    name: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind: 2 is SERVER, 1 INTERNAL
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links: list[tuple[str, str]]  # (trace_id, span_id) of each linked span
    events: list[tuple[str, int, dict[str, Any]]]  # (name, time, attributes)
    status_code: int  # 0 unset, 1 ok, 2 error
    resource: dict[str, Any] = field(default_factory=dict)
    scope: str = ""


def value_of(value: AnyValue) -> Any:
    """An OTLP AnyValue as the Python value it holds."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [value_of(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return attributes_of(value.kvlist_value.values)
    return None if kind is None else getattr(value, kind)


def attributes_of(pairs: Any) -> dict[str, Any]:
    return {pair.key: value_of(pair.value) for pair in pairs if isinstance(pair, KeyValue)}


def decode(body: bytes) -> list[ReceivedSpan]:
    """Every span of one ExportTraceServiceRequest."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = attributes_of(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        name=span.name,
                        kind=span.kind,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes=attributes_of(span.attributes),
                        links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                        events=[(e.name, e.time_unix_nano, attributes_of(e.attributes)) for e in span.events],
                        status_code=span.status.code,
                        resource=resource,
                        scope=scope_spans.scope.name,
                    )
                )
    return spans


class OtlpReceiver:
    """A threaded OTLP/HTTP receiver; `spans` holds what it has received, `wait_for` waits on it."""

    def __init__(self, keep: bool = True) -> None:
        """`keep`: keep the decoded spans (tests); False only counts them (benchmarks)."""
        self.spans: list[ReceivedSpan] = []
        self.exports = 0  # ExportTraceServiceRequests received
        self.span_count = 0
        self.by_service: Counter[str] = Counter()  # spans received per resource service.name
        self._keep = keep
        self._changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                if self.path != PATH:
                    self._answer(404, b"")
                    return
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    if self.headers.get("Content-Encoding") == "gzip":
                        body = gzip.decompress(body)
                    spans = decode(body)
                except Exception:  # a receiver answers 400 to what it cannot decode (OTLP/HTTP)
                    self._answer(400, b"")
                    return
                receiver._received(spans)
                self._answer(200, ExportTraceServiceResponse().SerializeToString())

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    @property
    def url(self) -> str:
        """The base URL to give as the OTLP endpoint (the exporter adds /v1/traces)."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def _received(self, spans: list[ReceivedSpan]) -> None:
        with self._changed:
            self.exports += 1
            self.span_count += len(spans)
            self.by_service.update(str(span.resource.get("service.name")) for span in spans)
            if self._keep:
                self.spans.extend(spans)
            self._changed.notify_all()

    def forget(self) -> None:
        """Drop the spans kept so far (a test that reuses this receiver for another server)."""
        with self._changed:
            self.spans.clear()

    def wait_for(self, done: Callable[[list[ReceivedSpan]], bool], timeout: float = 60.0) -> list[ReceivedSpan]:
        """The spans once `done(spans)` holds; AssertionError with what came if it does not within `timeout` s."""
        with self._changed:
            if not self._changed.wait_for(lambda: done(self.spans), timeout):
                names = [span.name for span in self.spans]
                raise AssertionError(f"the spans awaited did not arrive in {timeout:g} s; received {names}")
            return list(self.spans)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()
