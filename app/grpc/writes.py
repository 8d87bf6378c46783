"""Answers written with a deadline: an answer a client does not take within send_timeout_s ends its connection.

The HTTP door drops an answer not taken within `send_timeout_s` (app/http/transport/protocol.py);
over gRPC the tensor methods' answers are given the same deadline: a stream's writes each
(app/grpc/stream.py), ModelInfer's answer from the method's return to the call's end
(`answered_within`). One not taken in time ends the connection at its socket (connections.py):
grpc core then frees what it held for it. The client's other calls on that connection end too, as an HTTP client's would.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from app.grpc.connections import close_connection
from app.grpc.wire import InferMessage
from app.observe.throttle import Throttle
from app.protocol.admission import Watch

log = logging.getLogger("ffn_serve")


async def send_within(context: grpc.aio.ServicerContext, response: Any, send_timeout_s: float) -> bool:
    """Write `response`, or end the client's connection if it has not taken it within `send_timeout_s`."""
    try:
        async with asyncio.timeout(send_timeout_s):  # no task per write, as wait_for would make
            await context.write(response)
        return True
    except TimeoutError:
        closed = close_connection(context.peer())
        _log_unread(context.peer(), send_timeout_s, closed)
        return False


def answered_within(answer: Callable[[Any, Any], Awaitable[Any]], send_timeout_s: float) -> Callable[..., Any]:
    """A unary method whose answer must be taken within `send_timeout_s`, its bytes held until it has been.

    grpc sends a unary answer, its status with it, in one operation once the method returns, and
    calls the call's done callbacks when that operation is complete: when the client's window has
    taken the answer. A deadline started at the return (every answer's on one timer,
    app/protocol/admission.py: Watch) ends the client's connection if that has not happened within
    `send_timeout_s`; the call's end ends the wait and gives the request's and answer's bytes back. (Writing the answer from the method, as a unary-stream method, gives the
    write itself a deadline too, but costs grpc a second operation a call: 26 % more of the
    server's CPU per call at 16 clients, measured.)
    """

    watch = Watch(send_timeout_s)  # every answer's send_timeout_s, on one timer

    async def answer_watched(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            response = await answer(request, context)
        except BaseException:
            _release(request)
            raise
        if response is None:  # refused, its status set
            _release(request)
        else:
            _AnswerWatch(context, request, watch)
        return response

    return answer_watched


def _release(request: Any) -> None:
    if isinstance(request, InferMessage):
        request.release()


class _AnswerWatch:
    """Ends the connection of a call whose answer is not taken within `send_timeout_s`; releases its bytes at its end."""

    __slots__ = ("_context", "_ended", "_request", "_send_timeout_s", "_ticket")

    def __init__(self, context: grpc.aio.ServicerContext, request: Any, watch: Watch) -> None:
        self._context, self._request, self._send_timeout_s = context, request, watch.length_s
        self._ended = False  # not context.done(): that is true once the method has returned
        self._ticket = watch.start(self._late)
        context.add_done_callback(self._end)

    def _end(self, _context: object) -> None:
        self._ended = True
        self._ticket.end()
        _release(self._request)
        self._request = None

    def _late(self) -> None:
        if not self._ended:
            peer = self._context.peer()
            _log_unread(peer, self._send_timeout_s, close_connection(peer))


def _log_unread(peer: str, send_timeout_s: float, closed: bool) -> None:
    if count := _UNREAD.due():
        log.warning(
            "a gRPC client (%s) took no answer within send_timeout_s (%g s): %s (%d since the last line)",
            peer[:64],
            send_timeout_s,
            "ended its connection" if closed else "could not find its connection to end",
            count,
        )


_UNREAD = Throttle()  # connections ended for answers not taken
