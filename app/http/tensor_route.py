"""The one skeleton of the HTTP tensor routes served through FastAPI: native transform, V2 infer, KServe V1 predict.

Each route says how it reads its head and decodes its body (a TensorRoute); `serve` does the
rest, the same for all three: the model looked up and checked serving, the outcome counted, the
content codings read, the body read within its budgets and held, and then the rule that matters
most: the model looked up *again* once the body is in, since a reload may have swapped the copy
while it arrived (from there to the batcher nothing awaits, so the copy the rows are checked
against is the one they reach). The work is cancelled if the client leaves, the answer
compressed as asked. The lean path (app/http/transport/lean.py) serves the same requests below
ASGI; tests/test_lean.py holds the two to the same answers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from app.engine.facade import ModelFacade
from app.http.endpoints import TIMEOUT_HEADER, compressed, read_body, service_state, unless_disconnected
from app.protocol.admission import deadline_from
from app.protocol.fields import answer_coding, request_coding
from app.protocol.state import ServiceState

Head = TypeVar("Head")
Answer = TypeVar("Answer")
Encoded = tuple[bytes | memoryview, dict[str, str]]


@dataclass(frozen=True)
class TensorCall(Generic[Answer]):
    """A body decoded against the copy serving now: the work queued, and how its answer is written."""

    work: Awaitable[Answer]  # the engine's answer, awaited next: nothing awaits between the lookup and the queue
    encode: Callable[[Answer], Encoded]  # the answer's body and headers
    parsed_bytes: int | None  # the body was parsed into arrays of this size (held instead); None: they view it


class TensorRoute(Protocol[Head]):
    """How one tensor route reads its request; `serve` does everything the three routes share."""

    reads_timeout_header: bool  # X-Timeout-Ms sets the deadline (V2 reads its `timeout` from the body)

    def head(self, request: Request, state: ServiceState, served: ModelFacade) -> Head:
        """What the request's head and query say, checked before its body is read (400, 406, 415)."""
        ...

    def decode(
        self, body: bytes | bytearray, head: Head, state: ServiceState, served: ModelFacade, deadline: float | None
    ) -> TensorCall[Any]:
        """The body's rows for `served` (the copy serving now), queued; refused here if anything is wrong."""
        ...


async def serve(route: TensorRoute[Head], request: Request, name: str, version: str | None = None) -> Response:
    """One tensor request through FastAPI, from its head to its answer."""
    state = service_state(request)
    served = state.engine.model(name, version)
    with state.outcomes.count(name):
        served.check_serving()
        head = route.head(request, state, served)
        headers = request.headers
        coding_in = request_coding(headers.get("content-encoding"))
        coding_out = answer_coding(headers.get("accept-encoding"))
        deadline = None
        if route.reads_timeout_header:
            deadline = deadline_from(headers.get(TIMEOUT_HEADER), state.settings.default_timeout_ms)
        with state.held.request() as hold:
            body = await read_body(request, state.settings.max_body_bytes, hold, coding_in)
            served = state.engine.model(name, version)  # looked up again: see the module's docstring
            call = route.decode(body, head, state, served, deadline)
            del body  # rows that view it keep its bytes, held and counted; parsed rows take its place
            if call.parsed_bytes is not None:
                hold.resize(call.parsed_bytes)
            answer = await unless_disconnected(request, call.work)
            content, answer_headers = call.encode(answer)
            content, answer_headers = await compressed(content, answer_headers, coding_out)
        return Response(content, headers=answer_headers)
