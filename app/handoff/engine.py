"""EngineServer: the engine process's side of the hand-off, on any EngineFacade.

It listens on a Unix socket. Each front that connects says which arena is its own (HELLO); each
SUBMIT is then a call of the named model's `infer` (or `infer_monte_carlo`) on the request's rows,
copied out of the arena (or read from the message), and its answer is written into the same slot
under the request's generation, or sent in the message where it does not fit. The models batch
every front's requests together, as they batch one process's.

A CANCEL cancels its request's call (the batcher drops the rows if they are still queued) and is
answered FAILED, after which the front may take the slot again: the call has its own copy of the
rows, and only a call that finished writes into the slot, before it answers.

A front that goes away takes its requests with it: their calls are cancelled and its arena is
unmapped.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from pathlib import Path

import numpy as np

from app.engine.errors import EngineError
from app.engine.facade import EngineFacade
from app.engine.montecarlo import MonteCarloRequest
from app.handoff.arena import Arena
from app.handoff.frames import FrameTooLarge, FrameWriter, Message, read_frame
from app.handoff.messages import CANCEL, DONE, FAILED, HELLO, SUBMIT, error_as_data
from ffn_core.dtypes import DTYPES

log = logging.getLogger("ffn_serve.handoff")


class EngineServer:
    """The hand-off's engine side: serves `engine`'s models to every front that connects on `path`."""

    def __init__(self, engine: EngineFacade, path: Path) -> None:
        self.engine = engine
        self.path = path
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._connected, path=str(self.path))

    async def close(self) -> None:
        """Stop listening and end every front's connection, cancelling what they had in flight."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        frames = FrameWriter(writer)
        arena: Arena | None = None
        calls: dict[int, asyncio.Task[None]] = {}
        try:
            while True:
                for message in await read_frame(reader):
                    if message[0] == SUBMIT and arena is not None:
                        ask: int = message[1]
                        calls[ask] = asyncio.create_task(self._serve(arena, frames, message))
                        calls[ask].add_done_callback(functools.partial(_forget, calls, ask))
                    elif message[0] == CANCEL:
                        if (asked := calls.get(message[1])) is not None:
                            asked.cancel()
                    elif message[0] == HELLO and arena is None:
                        arena = Arena.attach(message[1], message[2], message[3])
                    else:
                        raise ValueError(f"unexpected message {message[0]!r} from a front")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the front went away (it exited, or closed this connection): what it asked is moot
        except (FrameTooLarge, ValueError) as exc:
            log.error("hand-off: a front's connection ended: %s", exc)
        finally:
            for call in list(calls.values()):
                call.cancel()
            await asyncio.gather(*calls.values(), return_exceptions=True)
            writer.close()
            if arena is not None:
                arena.close()
            self._connections.discard(task)

    async def _serve(self, arena: Arena, frames: FrameWriter, message: Message) -> None:
        _, ask, slot, generation, name, version, shape, rows_dtype, answer_dtype, deadline, monte_carlo, inline = (
            message
        )
        try:
            model = self.engine.model(name, version)
            dtype = np.dtype(DTYPES[rows_dtype].array)
            if slot >= 0:
                rows = _copied(arena, slot, shape, dtype)
            else:
                rows = np.frombuffer(inline, dtype=dtype).reshape(shape)
            loop = asyncio.get_running_loop()
            # time.monotonic() is one clock for every process of a host; the loop may keep its own epoch.
            until = None if deadline is None else loop.time() + (deadline - time.monotonic())
            answer = DTYPES[answer_dtype]
            if monte_carlo is None:
                parts = [await model.infer(rows, answer, deadline=until)]
            else:
                result = await model.infer_monte_carlo(rows, MonteCarloRequest(*monte_carlo), answer, deadline=until)
                parts = [result.mean, result.std]
        except asyncio.CancelledError:
            frames.send((FAILED, ask, generation, "ModelError", "cancelled", {}))
            return
        except EngineError as exc:
            frames.send((FAILED, ask, generation, *error_as_data(exc)))
            return
        except Exception as exc:  # a bug: the front hears ModelError (500), the log says where
            log.exception("hand-off: request %d of model %r failed", ask, name)
            frames.send((FAILED, ask, generation, *error_as_data(exc)))
            return
        if slot >= 0 and arena.write_answer(slot, generation, parts):
            frames.send((DONE, ask, generation, tuple(parts[0].shape), None))
        else:
            frames.send((DONE, ask, generation, tuple(parts[0].shape), b"".join(part.tobytes() for part in parts)))


def _copied(arena: Arena, slot: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The slot's rows, copied out: nothing of the arena outlives the call (a batch may keep its
    rows past a cancellation), and the slot is the answer's to write."""
    view = arena.payload(slot, math.prod(shape) * dtype.itemsize)
    try:
        return np.frombuffer(view, dtype=dtype).reshape(shape).copy()
    finally:
        view.release()


def _forget(calls: dict[int, asyncio.Task[None]], ask: int, _: asyncio.Task[None]) -> None:
    calls.pop(ask, None)
