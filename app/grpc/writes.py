"""Answers written with a deadline: an answer a client does not take within send_timeout_s ends its connection.

The HTTP door drops an answer not taken within `send_timeout_s` (app/http/transport/protocol.py);
over gRPC a write is the one step a servicer can give a deadline, so the tensor methods write their
own answers (app/grpc/server.py: ModelInfer as a unary-stream method, app/grpc/stream.py), and one
that times out ends the connection at its socket (connections.py): grpc core then frees what it
held for it. The client's other calls on that connection end too, as an HTTP client's would.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from app.grpc.connections import close_connection
from app.grpc.wire import InferMessage

log = logging.getLogger("ffn_serve")


async def send_within(context: grpc.aio.ServicerContext, response: Any, send_timeout_s: float) -> bool:
    """Write `response`, or end the client's connection if it has not taken it within `send_timeout_s`."""
    try:
        async with asyncio.timeout(send_timeout_s):  # no task per write, as wait_for would make
            await context.write(response)
        return True
    except TimeoutError:
        closed = close_connection(context.peer())
        _UNREAD.note(context.peer(), send_timeout_s, closed)
        return False


def written_within(answer: Callable[[Any, Any], Awaitable[Any]], send_timeout_s: float) -> Callable[..., Any]:
    """A unary method's answer written by the handler itself, within `send_timeout_s`; its bytes held until then."""

    async def answer_and_write(request: Any, context: grpc.aio.ServicerContext) -> None:
        try:
            response = await answer(request, context)
            if response is not None:  # None: refused, its status set
                await send_within(context, response, send_timeout_s)
        finally:
            if isinstance(request, InferMessage):
                request.release()

    return answer_and_write


class _UnreadAnswers:
    """Logs the connections ended for answers not taken: the first at once, then one line a minute with the count."""

    def __init__(self, every_s: float = 60.0) -> None:
        self._every_s, self._next, self._since = every_s, 0.0, 0

    def note(self, peer: str, send_timeout_s: float, closed: bool) -> None:
        self._since += 1
        now = time.monotonic()
        if now >= self._next:
            what = "ended its connection" if closed else "could not find its connection to end"
            log.warning(
                "a gRPC client (%s) took no answer within send_timeout_s (%g s): %s (%d since the last line)",
                peer[:64],
                send_timeout_s,
                what,
                self._since,
            )
            self._since, self._next = 0, now + self._every_s


_UNREAD = _UnreadAnswers()
