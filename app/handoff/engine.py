"""EngineServer: the engine process's side of the hand-off, on the engine (app/engine/service.py).

It listens on a Unix socket. Each front that connects hands over its arena's memory as the
connection begins (its descriptor, frames.py's `receive_memory`) and says how it is cut (Hello); each
Submit is then queued with the named model (`infer_soon`; `infer_monte_carlo` in a task) on the
request's rows, copied out of a small slot or read in place from a large one (`_rows`), in the turn
its frame arrived: no task and no coroutine per request, so that the engine's work per request
stays small beside the model's. The answer is written into the same slot under the request's
generation (the front sized the slot for it): rows and answers never travel in a message, and the
engine holds no copy of a large request's rows while they wait for their batch. The models batch every front's requests together, as they batch one
process's.

A Cancel cancels its request's call (the batcher drops the rows if they are still queued) and is
answered Failed, after which the front may take the slot again: only a call that finished writes
into the slot, before it answers (a batch still reading a large slot's rows computes an answer nobody reads).

A front that goes away takes its requests with it: their calls are cancelled and its arena is
unmapped.

A traced request (its Submit names its span's context) is queued alone, with its context current
as the batcher tags its entries, so that the engine's batch spans link to it (app/tracing/spans.py);
its DONE carries back what it rode in. Every request crosses with its id: while the engine traces,
an untraced request's entry (or a group's) is tagged with its id (their ids), so that a batch span
lists every request that rode in it, as in one process. Tracing is the engine process's when an
OTLP endpoint is set.

Each front also gets the engine's table (its models as listed, their states, the engine's
readiness: `engine_table`) after Hello and whenever it changes, and model control (Control: a
load, an unload, a refused load to count) is applied here, once, for whichever front asked.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from app.engine.errors import EngineError, NotTogether
from app.engine.montecarlo import MonteCarloRequest, MonteCarloResult
from app.engine.service import Engine, ServedModel
from app.handoff.arena import Arena
from app.handoff.frames import FRONT_TO_ENGINE, BadFrame, FrameWriter, read_frame, receive_memory
from app.handoff.messages import (
    Cancel,
    Control,
    Done,
    EngineMessage,
    Gpus,
    Hello,
    ModelCopy,
    ModelEntry,
    Reply,
    Ride,
    Submit,
    Table,
    cancelled,
    failed,
    rides_of,
)
from app.observe.collectors import GpuReading
from app.observe.identity import CURRENT, RequestContext, RequestGroup
from ffn_core.dtypes import DTYPES

if TYPE_CHECKING:
    from app.tracing.spans import Tracing

log = logging.getLogger("ffn_serve.handoff")

Frames = FrameWriter[EngineMessage]  # what the engine writes to one front

# A frame's requests for one model are queued as one entry up to this many rows; past it, as several.
GROUP_ROWS = 1024
# A front hands over its memory as soon as it has connected; a connection that has not within this
# long (no front of ours: the socket's folder is the service user's alone) is closed.
MEMORY_WITHIN_S = 10.0
BACKLOG = 64


# How often the engine looks for a change of its table (a model warm, draining, loaded, unloaded) to
# send every front: the fronts' readiness and model list lag the engine's by at most this much,
# and a front that asked for a load or unload has the new table before the answer.
TABLE_EVERY_S = 0.1
# How often the engine reads its GPUs for the fronts' scrapes (Triton's default metrics interval):
# ffn_gpu_memory_* and nv_gpu_* at a front are at most this old.
GPUS_EVERY_S = 2.0


def engine_table(engine: Engine) -> Table:
    """The engine's models and readiness, for a front's facade (app/handoff/remote.py)."""
    readiness = engine.readiness()
    return Table(
        readiness_state=readiness.state.value,
        readiness_reason=readiness.reason,
        cuda=engine.cuda_available,
        models=[
            ModelEntry(served.description(), served.status.state.value, served.status.reason)
            for served in engine.models()
        ],
        unloaded=[
            ModelEntry(unloaded.description, unloaded.status.state.value, unloaded.status.reason)
            for unloaded in engine.unloaded()
        ],
    )


class EngineServer:
    """The hand-off's engine side: serves `engine`'s models to every front that connects on `path`."""

    def __init__(self, engine: Engine, path: Path, tracing: Tracing | None = None) -> None:
        """`tracing`: the engine process's, where spans are exported (traced requests' batches get spans)."""
        self.engine = engine
        self.path = path
        self._tracing = tracing
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._fronts: set[Frames] = set()  # each connected front's, for the table
        self._table: Table | None = None  # as last sent
        self._gpus: list[GpuReading] = []  # as last read and sent
        self._watching: asyncio.Task[None] | None = None
        self._controls: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(self.path))
            listener.listen(BACKLOG)
        except BaseException:
            listener.close()
            raise
        listener.setblocking(False)
        self._listener = listener
        self._accepting = asyncio.create_task(self._accept(listener), name="handoff-accept")
        self._watching = asyncio.create_task(self._watch_table(), name="handoff-table")

    async def close(self) -> None:
        """Stop listening and end every front's connection, cancelling what they had in flight."""
        if self._watching is not None:
            self._watching.cancel()
        for control in list(self._controls):
            control.cancel()
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:  # out of descriptors, ...: the fronts try again; the log says why
                log.error("hand-off: cannot accept a front's connection: %s", exc.strerror or exc)
                await asyncio.sleep(0.1)
                continue
            sock.setblocking(False)
            task = asyncio.create_task(self._front(sock), name="handoff-front")
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _front(self, sock: socket.socket) -> None:
        """One front's connection: its memory received on the raw socket, then its frames through streams."""
        try:
            async with asyncio.timeout(MEMORY_WITHIN_S):
                fd = await receive_memory(sock)
        except (ConnectionError, TimeoutError, ValueError) as exc:
            sock.close()
            if not isinstance(exc, ConnectionError):  # a front that connected and left at once said nothing
                log.error("hand-off: a connection closed: %s", exc or "no shared memory handed over in time")
            return
        except BaseException:
            sock.close()
            raise
        try:
            reader, writer = await asyncio.open_unix_connection(sock=sock)
        except BaseException:
            os.close(fd)
            sock.close()
            raise
        await self._connected(reader, writer, fd)

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, fd: int | None) -> None:
        """Serve one front; `fd`: its memory, until its Hello says how it is cut and it is mapped (or closed)."""
        frames: Frames = FrameWriter(writer)
        arena: Arena | None = None
        calls: Calls = {}
        try:
            while True:
                submits: list[Submit] = []
                cancels: list[int] = []
                for message in await read_frame(reader, FRONT_TO_ENGINE):
                    if isinstance(message, Submit) and arena is not None:
                        submits.append(message)
                    elif isinstance(message, Cancel):
                        cancels.append(message.ask)
                    elif isinstance(message, Control):
                        self._control(frames, message)
                    elif isinstance(message, Hello) and arena is None and fd is not None:
                        handed, fd = fd, None  # attach takes it, and closes it if it is not an arena
                        arena = Arena.attach(handed, message.slots, message.slot_bytes, message.large_bytes)
                        frames.send(self._current_table())
                        if self._gpus:
                            frames.send(Gpus(self._gpus))
                        self._fronts.add(frames)
                    else:
                        raise ValueError(f"unexpected message {type(message).__name__} from a front")
                if arena is not None:
                    self._submit_frame(arena, frames, calls, submits)
                for ask in cancels:  # after the submits: a request may be asked and cancelled in one frame
                    _cancel(frames, calls, ask)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the front went away (it exited, or closed this connection): what it asked is moot
        except (BadFrame, ValueError) as exc:
            log.error("hand-off: a front's connection ended: %s", exc)
        finally:
            self._fronts.discard(frames)
            pending = {call.call if isinstance(call, Group) else call for call in calls.values()}
            for future in pending:
                future.cancel()
            # Each call's own callback (registered before gather's) has run once this returns: none
            # writes into the arena after it is unmapped.
            await asyncio.gather(*pending, return_exceptions=True)
            writer.close()
            if fd is not None:
                os.close(fd)
            if arena is not None:
                arena.close()

    def _current_table(self) -> Table:
        self._table = engine_table(self.engine)
        return self._table

    async def _watch_table(self) -> None:
        gpus_read_at = -math.inf
        while True:
            await asyncio.sleep(TABLE_EVERY_S)
            if time.monotonic() - gpus_read_at >= GPUS_EVERY_S:
                gpus_read_at = time.monotonic()
                self._read_gpus()
            if not self._fronts:
                continue
            before = self._table
            try:
                table = self._current_table()
            except Exception:  # a bug: the fronts keep the last table; the log says where
                log.exception("hand-off: the engine's table could not be read")
                continue
            if table != before:
                for frames in self._fronts:
                    frames.send(table)

    def _read_gpus(self) -> None:
        """The engine's GPUs read now, and sent to every front if they changed."""
        try:
            gpus = self.engine.gpus()
        except Exception:  # a driver's failure: the fronts keep the last reading; the log says why
            log.exception("hand-off: the engine's GPUs could not be read")
            return
        if gpus != self._gpus:
            self._gpus = gpus
            for frames in self._fronts:
                frames.send(Gpus(gpus))

    def _control(self, frames: Frames, message: Control) -> None:
        """Model control for a front, as the facade's: the answer after the table it changed."""
        if message.what == "refused_load":
            self.engine.count_refused_load(message.arguments["name"])
            return
        task = asyncio.create_task(self._controlled(frames, message.ask, message.what, message.arguments))
        self._controls.add(task)
        task.add_done_callback(self._controls.discard)

    async def _controlled(self, frames: Frames, ask: int, what: str, arguments: dict[str, Any]) -> None:
        try:
            if what == "load":
                result = await self.engine.load(arguments["name"], arguments.get("config"))
            elif what == "unload":
                result = await self.engine.unload(arguments["name"])
            else:
                raise ValueError(f"no model control {what!r}")
        except Exception as exc:
            self._failed(frames, ask, 0, str(arguments.get("name")), exc)
            return
        table = self._current_table()
        for front in self._fronts:  # every front sees the change; the one that asked, before its answer
            front.send(table)
        frames.send(Reply(ask, result))

    def _submit_frame(self, arena: Arena, frames: Frames, calls: Calls, submits: list[Submit]) -> None:
        """A frame's requests: those in slots, for one model and dtypes, without a deadline or a trace,
        queued as one entry (up to GROUP_ROWS rows); the rest one by one."""
        groups: dict[tuple[Any, ...], list[Submit]] = {}
        for message in submits:
            if (
                message.place < arena.large_start
                and message.deadline is None
                and message.monte_carlo is None
                and message.trace is None
                and len(message.shape) == 2
            ):
                key = (message.model, message.version, message.shape[1], message.rows_dtype, message.answer_dtype)
                groups.setdefault(key, []).append(message)
            else:
                self._submit(arena, frames, calls, message)
        for messages in groups.values():
            group: list[Submit] = []
            rows = 0
            for message in messages:
                if group and rows + message.shape[0] > GROUP_ROWS:
                    self._submit_group(arena, frames, calls, group)
                    group, rows = [], 0
                group.append(message)
                rows += message.shape[0]
            self._submit_group(arena, frames, calls, group)

    def _submit_group(self, arena: Arena, frames: Frames, calls: Calls, messages: list[Submit]) -> None:
        """Several requests' rows gathered from their slots into one array and queued as one entry."""
        if len(messages) == 1:
            self._submit(arena, frames, calls, messages[0])
            return
        first = messages[0]
        name = first.model
        try:
            model = self.engine.model(name, first.version)
            dtype = np.dtype(DTYPES[first.rows_dtype].array)
            rows, members = _gathered(arena, messages, dtype)
            # Traced, the entry is tagged with the group's ids (read as the batcher tags it).
            ids = [m.request_id for m in messages]
            tagged = self._tracing is not None and any(rid is not None for rid in ids)
            token = CURRENT.set(RequestGroup(ids)) if tagged else None
            try:
                call = model.infer_soon(
                    rows, DTYPES[first.answer_dtype], deadline=None, requests=[m.stop - m.start for m in members]
                )
            finally:
                if token is not None:
                    CURRENT.reset(token)
        except NotTogether:  # the queue may take some of them: each gets its own verdict
            for message in messages:
                self._submit(arena, frames, calls, message)
            return
        except Exception as exc:  # refused at once (an EngineError: the same for each), or a bug
            for message in messages:
                self._failed(frames, message.ask, message.generation, name, exc)
            return
        group = Group(call, {member.ask: member for member in members})
        for member in members:
            calls[member.ask] = group
        copy = _copy_of(model)
        call.add_done_callback(lambda _: self._group_answered(arena, frames, calls, group, copy))

    def _group_answered(self, arena: Arena, frames: Frames, calls: Calls, group: Group, copy: ModelCopy) -> None:
        """A group's call ended: each member still waiting gets its rows of the answer, or why not."""
        members = list(group.members.values())
        group.members.clear()
        for member in members:
            calls.pop(member.ask, None)
        call = group.call
        if call.cancelled():
            for member in members:
                frames.send(cancelled(member.ask, member.generation))
            return
        if (error := call.exception()) is not None:
            for member in members:
                self._failed(frames, member.ask, member.generation, copy.name, error)
            return
        answer = call.result()
        for member in members:
            part = [answer[member.start : member.stop]]
            _send_answer(arena, frames, member.ask, member.place, member.room, member.generation, part, None, copy)

    def _submit(self, arena: Arena, frames: Frames, calls: Calls, message: Submit) -> None:
        """Queue one Submit with its model, in the turn its frame arrived: no task, no await."""
        context: RequestContext | None = None
        request_id, trace = message.request_id, message.trace
        if self._tracing is not None and request_id is not None:  # read as the batcher tags the entries
            context = (
                RequestContext(request_id) if trace is None else self._tracing.handed_off(request_id, *trace.ids())
            )
        token = None if context is None else CURRENT.set(context)
        try:
            model = self.engine.model(message.model, message.version)
            dtype = np.dtype(DTYPES[message.rows_dtype].array)
            rows = _rows(arena, message, dtype)
            # time.monotonic() is one clock for every process of a host; the loop may keep its own epoch.
            deadline = message.deadline
            until = None if deadline is None else asyncio.get_running_loop().time() + (deadline - time.monotonic())
            answer = DTYPES[message.answer_dtype]
            monte_carlo = message.monte_carlo
            if monte_carlo is None:
                call: asyncio.Future[Any] = model.infer_soon(rows, answer, deadline=until)
            else:
                request = MonteCarloRequest(monte_carlo.passes, monte_carlo.dropout, monte_carlo.seed)
                call = asyncio.ensure_future(model.infer_monte_carlo(rows, request, answer, deadline=until))
        except Exception as exc:  # refused at once (an EngineError), or a bug
            self._failed(frames, message.ask, message.generation, message.model, exc)
            return
        finally:
            if token is not None:
                CURRENT.reset(token)
        calls[message.ask] = call
        copy = _copy_of(model)
        call.add_done_callback(lambda _: self._answered(arena, frames, calls, message, call, context, copy))

    def _answered(
        self,
        arena: Arena,
        frames: Frames,
        calls: Calls,
        message: Submit,
        call: asyncio.Future[Any],
        context: RequestContext | None,
        copy: ModelCopy,
    ) -> None:
        """A call ended: its answer into the slot under the request's generation (or into the message), or why not;
        with a traced request's `context`, what it rode in; and the model `copy` that computed it."""
        calls.pop(message.ask, None)
        if call.cancelled():
            frames.send(cancelled(message.ask, message.generation))
            return
        if (error := call.exception()) is not None:
            self._failed(frames, message.ask, message.generation, message.model, error)
            return
        result = call.result()
        parts = [result.mean, result.std] if isinstance(result, MonteCarloResult) else [result]
        # A traced request's context is a HandedOffRequest (app/tracing is imported only where tracing is on).
        handed_off = getattr(context, "handed_off", None)
        rides = None if handed_off is None else rides_of(handed_off.rides)
        _send_answer(arena, frames, message.ask, message.place, message.room, message.generation, parts, rides, copy)

    @staticmethod
    def _failed(frames: Frames, ask: int, generation: int, name: str, error: BaseException) -> None:
        if not isinstance(error, EngineError):  # a bug: the front hears ModelError (500), the log says where
            log.error("hand-off: request %d of model %r failed", ask, name, exc_info=error)
        frames.send(failed(ask, generation, error))


def _rows(arena: Arena, message: Submit, dtype: np.dtype) -> np.ndarray:
    """A request's rows, read in place in its slot, small or large: the engine holds no copy of them while they
    wait for their batch, only the slots it was given, and a slot's answer is written only once its batch is
    computed. The front takes a slot again only once the engine has answered for it; a batch still reading rows
    whose request was cancelled (and its slot taken again) computes, for those rows alone (the FFN is
    position-wise), an answer nobody reads, into no slot."""
    view = arena.region(message.place, message.room, math.prod(message.shape) * dtype.itemsize)
    return np.frombuffer(view, dtype=dtype).reshape(message.shape)


@dataclass(frozen=True)
class Member:
    """One request of a group: its slot, and its rows' place in the group's."""

    ask: int
    place: int
    room: int
    generation: int
    start: int
    stop: int


@dataclass(eq=False)
class Group:
    """A frame's requests for one model, queued as one entry: one call; a member cancelled leaves it."""

    call: asyncio.Future[Any]
    members: dict[int, Member]


Calls = dict[int, "asyncio.Future[Any] | Group"]  # a front's requests in flight, by its ask number


def _gathered(arena: Arena, messages: list[Submit], dtype: np.dtype) -> tuple[np.ndarray, list[Member]]:
    """The requests' rows copied out of their slots into one array (rows × d_model), and where each lies."""
    total = sum(message.shape[0] for message in messages)
    rows = np.empty((total, messages[0].shape[1]), dtype=dtype)
    members = []
    at = 0
    for message in messages:
        shape = message.shape
        view = arena.region(message.place, message.room, math.prod(shape) * dtype.itemsize)
        try:
            rows[at : at + shape[0]] = np.frombuffer(view, dtype=dtype).reshape(shape)
        finally:
            view.release()
        members.append(Member(message.ask, message.place, message.room, message.generation, at, at + shape[0]))
        at += shape[0]
    return rows, members


def _send_answer(
    arena: Arena,
    frames: Frames,
    ask: int,
    place: int,
    room: int,
    generation: int,
    parts: list[np.ndarray],
    rides: list[Ride] | None,
    copy: ModelCopy,
) -> None:
    """Done, with the answer in the request's slot under its generation (the front sized the slot for it); a
    traced request's `rides`; and the model `copy` that computed it."""
    if not arena.write_answer(place, room, generation, parts):
        error = RuntimeError(f"an answer of {sum(p.nbytes for p in parts)} bytes does not fit its slot of {room}")
        EngineServer._failed(frames, ask, generation, copy.name, error)
        return
    arena.done_with(place, room)
    frames.send(Done(ask, generation, tuple(parts[0].shape), rides, copy))


def _copy_of(model: ServedModel) -> ModelCopy:
    """The model copy a request was queued with, as its answer names it."""
    return ModelCopy(model.name, model.version, model.digest)


def _cancel(frames: Frames, calls: Calls, ask: int) -> None:
    """Cancel: a lone call is cancelled (its callback answers Failed); a group's member is answered
    Failed now and its slot left alone, and the group's call is cancelled once no member waits."""
    call = calls.get(ask)
    if isinstance(call, Group):
        member = call.members.pop(ask)
        del calls[ask]
        frames.send(cancelled(ask, member.generation))
        if not call.members:
            call.call.cancel()
    elif call is not None:
        call.cancel()
