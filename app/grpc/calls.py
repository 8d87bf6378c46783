"""A gRPC call's identity and trace: what RequestIds and the fast path give an HTTP request, for the gRPC door.

Every call of the inference service runs in a RequestContext (app/observe/identity.py) whose id is
the client's `x-request-id` metadata when it follows the protocol core's rule, else one of the
server's (app/observe/identity.py), so that log lines name it as they name an HTTP request's.
Its answer carries that id in the trailing metadata, with the error's type and retry hint when it
failed (app/grpc/status.py). An infer call is traced as an HTTP infer request is: with a
`traceparent` in its metadata it joins the caller's trace; its span is named after the method
and carries OpenTelemetry's RPC attributes, and its own `traceparent` goes back in the trailers.
A stream's messages are each a request of their own: `<the call's id>.<n>`, each traced.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import grpc

from app.grpc.status import GrpcError
from app.observe.identity import CURRENT, REQUEST_ID_HEADER, RequestContext, request_id_from

if TYPE_CHECKING:  # the OpenTelemetry SDK is imported only when tracing is on
    from app.tracing.spans import RequestTrace, Tracing

SERVICE = "inference.GRPCInferenceService"
REQUEST_ID_KEY = REQUEST_ID_HEADER.decode("ascii")
# The codes that are the server's failure, not the caller's: a span's error status (OpenTelemetry's RPC conventions).
_SERVER_FAILURES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)


def metadata_of(context: grpc.aio.ServicerContext) -> list[tuple[bytes, bytes]]:
    """The call's metadata as HTTP headers are read: lower-case names and values, in bytes."""
    pairs: list[tuple[bytes, bytes]] = []
    for key, value in context.invocation_metadata() or ():
        raw = value if isinstance(value, bytes) else value.encode("latin-1", "replace")
        pairs.append((key.encode("latin-1", "replace"), raw))
    return pairs


def call_request_id(metadata: Sequence[tuple[bytes, bytes]]) -> str:
    """The call's request id: the client's x-request-id when it follows the rule, else one of the server's."""
    given, _ = request_id_from([value for key, value in metadata if key == REQUEST_ID_HEADER])
    return given.decode("ascii")


class Call:
    """One request of the gRPC door, from its arrival to its answer: its context, its trace, its trailers.

    with Call(context, tracing, "ModelInfer") as call:
        call.trace(model_name)          # infer requests only
        ...
        call.answered(error)            # None: it succeeded
    """

    __slots__ = ("_context", "_metadata", "_method", "_token", "_trace", "_tracing", "request_id")

    def __init__(
        self,
        context: grpc.aio.ServicerContext,
        tracing: Tracing | None,
        method: str,
        *,
        metadata: list[tuple[bytes, bytes]] | None = None,
        request_id: str | None = None,
    ) -> None:
        self._context = context
        self._tracing = tracing
        self._method = method
        self._metadata = metadata if metadata is not None else metadata_of(context)
        self.request_id = request_id or call_request_id(self._metadata)
        self._token: Any = None
        self._trace: RequestTrace | None = None

    def __enter__(self) -> Call:
        self._token = CURRENT.set(RequestContext(self.request_id))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._trace is not None:
            self._trace.end()
        CURRENT.reset(self._token)

    @property
    def traced(self) -> bool:
        return self._trace is not None

    def trace(self, model: str | None) -> None:
        """Begin this request's trace if it is traced (its model's trace settings, its caller's traceparent)."""
        if self._tracing is None:
            return
        attributes = {"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": self._method}
        self._trace = self._tracing.begin(f"{SERVICE}/{self._method}", self._metadata, attributes, model)

    def answered(self, error: GrpcError | None, output_bytes: int = 0) -> list[tuple[str, str]]:
        """The request's outcome on its span; the trailing metadata that says who it was (and its trace)."""
        trailers = [(REQUEST_ID_KEY, self.request_id)]
        if self._trace is not None:
            code = grpc.StatusCode.OK if error is None else error.code
            carrier = self._trace.answered(
                {"rpc.grpc.status_code": code.value[0]},
                failed=code in _SERVER_FAILURES,
                error_type=None if error is None else error.error_type,
                output_bytes=output_bytes,
                content_type="application/grpc",
            )
            trailers.extend(carrier.items())
        return trailers
