"""ModelStreamInfer: a bidirectional stream of infer requests, each answered as soon as it is computed.

The requests of one stream are decoded and queued concurrently, so they batch with each other
and with every other request, and each answer (or error, in `error_message`, as Triton sends
it, with the error_type in the parameter `error_type`) carries its request's id. What a stream may hold is bounded: requests in flight and answers
not yet written count against `max_rows` rows (a batch's worth; one request alone may be larger),
and while the budget is spent the stream is not read, so a client that sends without reading its
answers is held back by HTTP/2 flow control instead of filling the server's memory. When the
client half-closes, every request still in flight is answered before the stream ends; when it
cancels, they are dropped (their rows leave the queue uncomputed).

Each message is read only with a room from the streams' rooms (app/grpc/receive.py: from the one
budget for what grpc core receives at the door, apart from ModelInfer's, so that quiet streams never
hold up unary calls), taken right before the read, once the previous
message's rows are counted, and given back as soon as the message has arrived, which then holds its
own size (wire.py) until its answer is written. A message that gets no room ends the stream, once
the requests before it are answered: RESOURCE_EXHAUSTED with the retry hint. (A stream refused a room while requests
of its own are in flight first waits for their answers, which may hold what it lacks, and asks again.
Its end is a read too: a stream refused a room after its last answer ends RESOURCE_EXHAUSTED though
its client had half-closed, which only a read would have shown.) Not a per-message error: the message
cannot be skipped without receiving it whole (the very bytes the room bounds), nor named (its id is
in it, unread); and a Triton client sees a stream's end with its status code (its callback gets an
InferenceServerException naming RESOURCE_EXHAUSTED, and it starts a new stream), where a per-message
`error_message` reaches it without one. A stream waiting for its next message holds a room while it
waits (a pending read lets grpc core take a whole message in), for as long as it likes; but once it
has waited QUIET_S, it gives the room up when another call finds none, and ends UNAVAILABLE with the
retry hint (receive.py), the stream quiet longest first, as the HTTP door closes the connection idle
longest to admit a new one. A stream whose messages keep coming is never the one asked.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import grpc
from tritonclient.grpc import service_pb2 as pb

from app.errors import drop_frames
from app.grpc.calls import REQUEST_ID_KEY, Call, call_request_id, metadata_of
from app.grpc.malformed import Malformed
from app.grpc.receive import Rooms, receive
from app.grpc.status import grpc_error, log_if_internal, set_status
from app.grpc.wire import InferMessage
from app.grpc.writes import send_within
from app.protocol.errors import QuietStreamClosed, RequestTimeout, TooManyBytesHeld

if TYPE_CHECKING:  # the OpenTelemetry SDK is imported only when tracing is on
    from app.tracing.spans import Tracing

Infer = Callable[[InferMessage, grpc.aio.ServicerContext], Awaitable[pb.ModelInferResponse]]
Parse = Callable[[bytes], InferMessage | Malformed]


class RowBudget:
    """Rows held by one stream's requests, at most `limit` (one request alone may hold more)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._used = 0
        self._changed = asyncio.Condition()

    async def take(self, rows: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self._used == 0 or self._used + rows <= self._limit)
            self._used += rows

    async def give(self, rows: int) -> None:
        async with self._changed:
            self._used -= rows
            self._changed.notify_all()


def rows_claimed(message: InferMessage | Malformed, limit: int) -> int:
    """The rows a request will hold, read from its shape before it is decoded (at most `limit`; 1 if unreadable)."""
    inputs: Any = message.request.inputs if isinstance(message, InferMessage) else ()
    shape = inputs[0].shape if len(inputs) == 1 else ()
    if not 2 <= len(shape) <= 3 or min(shape) < 1:
        return 1  # refused as soon as it is decoded
    return min(limit, math.prod(shape[:-1]))


async def _next_message(context: grpc.aio.ServicerContext) -> bytes | None:
    """The stream's next message, raw (its handler has no deserializer: server.py); None once the client half-closed."""
    message = await context.read()
    return None if message is grpc.aio.EOF else message


class StreamInfer:
    """Serves ModelStreamInfer calls with `infer`, the unary infer's own path, each message read with a room of
    `rooms` and parsed by `parse` (wire.tolerant: its bytes held against max_held_bytes, its failures a Malformed)."""

    def __init__(
        self,
        infer: Infer,
        rooms: Rooms,
        parse: Parse,
        *,
        max_rows: int,
        send_timeout_s: float,
        tracing: Tracing | None = None,
    ) -> None:
        self._infer = infer
        self._rooms = rooms
        self._parse = parse
        self._max_rows = max_rows
        self._send_timeout_s = send_timeout_s
        self._tracing = tracing

    async def serve(self, context: grpc.aio.ServicerContext) -> None:
        budget = RowBudget(self._max_rows)
        writing = asyncio.Lock()  # one write at a time on a call
        in_flight: set[asyncio.Task[None]] = set()
        metadata = metadata_of(context)
        call_id = call_request_id(metadata)
        context.set_trailing_metadata(((REQUEST_ID_KEY, call_id),))
        read = partial(_next_message, context)
        ended: TooManyBytesHeld | RequestTimeout | QuietStreamClosed | None = None
        try:
            for n in itertools.count(1):
                # The room only now: the previous message's rows are counted, so no room waits on them.
                try:
                    request = await self._receive(read, in_flight)
                except (TooManyBytesHeld, RequestTimeout, QuietStreamClosed) as exc:
                    ended = exc
                    break
                if request is None:
                    break
                rows = rows_claimed(request, self._max_rows)
                await budget.take(rows)
                call = Call(context, self._tracing, "ModelStreamInfer", metadata=metadata, request_id=f"{call_id}.{n}")
                task = asyncio.create_task(self._answer(request, call, rows, context, budget, writing))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            while in_flight:  # half-closed, or a message refused: answer what was read before ending the stream
                await asyncio.gather(*in_flight)
        finally:
            for task in in_flight:  # the client left or the call was cancelled: nobody reads these answers
                task.cancel()
        if ended is not None:
            error = grpc_error(ended)
            drop_frames(ended)
            set_status(context, error, ((REQUEST_ID_KEY, call_id),))

    async def _receive(
        self, read: Callable[[], Awaitable[bytes | None]], in_flight: set[asyncio.Task[None]]
    ) -> InferMessage | Malformed | None:
        """The stream's next message, read with a room (None: the client half-closed).

        Refused a room while requests of its own are in flight, which may hold what it lacks (always so
        when max_held_bytes is max_body_bytes), the stream waits for them to be answered and asks once more.
        """
        try:
            return await receive(read, self._parse, self._rooms, "ModelStreamInfer", may_be_quiet=True)
        except TooManyBytesHeld:
            if not in_flight:
                raise
        await asyncio.gather(*in_flight)
        return await receive(read, self._parse, self._rooms, "ModelStreamInfer", may_be_quiet=True)

    async def _answer(
        self,
        request: InferMessage | Malformed,
        call: Call,
        rows: int,
        context: grpc.aio.ServicerContext,
        budget: RowBudget,
        writing: asyncio.Lock,
    ) -> None:
        try:
            with call:
                if isinstance(request, InferMessage):
                    call.trace(request.request.model_name)
                try:
                    if isinstance(request, Malformed):  # a message of this stream that did not parse
                        raise request.error
                    answer = await self._infer(request, context)
                    call.answered(None, answer.ByteSize() if call.traced else 0)
                    response = pb.ModelStreamInferResponse(infer_response=answer)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log_if_internal(exc)
                    error = grpc_error(exc)
                    drop_frames(exc)
                    call.answered(error)
                    fields = request.request if isinstance(request, InferMessage) else pb.ModelInferRequest()
                    infer_response = pb.ModelInferResponse(id=fields.id, model_name=fields.model_name)
                    # The error_type a unary call gets in its trailers: a stream's answers have none of their own.
                    infer_response.parameters["error_type"].string_param = error.error_type
                    response = pb.ModelStreamInferResponse(error_message=error.details, infer_response=infer_response)
            async with writing:
                # An answer not taken within send_timeout_s ends the stream's connection (app/grpc/connections.py).
                await send_within(context, response, self._send_timeout_s)
        finally:
            if isinstance(request, InferMessage):
                request.release()  # its bytes, then its answer's, were held until now
            await budget.give(rows)
