"""EngineClient: a front process's side of the hand-off. No torch: numpy arrays in, numpy arrays out.

`infer`, `infer_soon` and `infer_monte_carlo` each take an `Ask`: what the engine facade's models take
(app/engine/facade.py), with the model's name and the request's context; they answer what the facade
answers, or raise the engine's error as the engine raised it. The first call
connects; a connection the engine ended (it died, or is restarting) fails what it had in flight
Unavailable at once, and the next call connects again, with a new arena. Each arena's memory is
reserved before its connection is made (`reserve`: at a front's start, so that a host without the
memory stops the start at once), and handed to the engine over the socket as the connection begins.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import socket
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.engine.errors import Overloaded, RequestTooLarge, Unavailable
from app.engine.montecarlo import MonteCarloRequest, MonteCarloResult
from app.handoff.arena import Arena, NoRoom, Slot
from app.handoff.frames import ENGINE_TO_FRONT, BadFrame, FrameWriter, read_frame, send_memory
from app.handoff.messages import (
    Cancel,
    Control,
    Done,
    Failed,
    FrontMessage,
    Gpus,
    Hello,
    MonteCarlo,
    Reply,
    Submit,
    Table,
    TraceContext,
    error_of,
    rides_as_recorded,
)
from app.observe.collectors import GpuReading
from app.observe.identity import RequestContext
from ffn_core.dtypes import DType

SLOTS, SLOT_BYTES = 64, 1 << 20  # 64 requests of up to 1 MiB each in flight per front: 64 MiB of shared memory
# The large area of a client made without a size (tests, benchmarks): its pages are taken only as used.
LARGE_BYTES = 256 << 20


class EngineNotRunning(Unavailable):
    """Nothing listens on the engine's socket: it is starting, or restarting after it died."""


@dataclass(frozen=True, slots=True)
class Ask:
    """One request to the engine, as the front hands it off: written once here, read by field name."""

    model: str  # the served model's name
    version: str | None  # None: the version the engine serves
    rows: np.ndarray  # (n, d_model), in the dtype the request carried (a uint16 array carries bfloat16)
    answer_dtype: DType  # the dtype the answer is computed and carried in
    _: KW_ONLY
    deadline: float | None  # on the front's event loop clock (loop.time()); None: no deadline
    monte_carlo: MonteCarloRequest | None = None  # None: the plain FFN; else the passes' mean and std
    context: RequestContext | None = None  # the request's (app/observe/identity.py): a traced one crosses traced


@dataclass
class Pending:
    answer: asyncio.Future[Any]  # list[np.ndarray], or the one np.ndarray when `single`
    slot: Slot
    dtype: DType
    parts: int  # 1, or 2 for a Monte Carlo request's mean and std
    context: RequestContext | None  # the request's: told which model copy computed it (and a trace, what it rode in)
    single: bool = False  # answered its one array itself, not a list of them (infer_soon)


class EngineClient:
    """One front's link to one engine, over the Unix socket at `path`."""

    def __init__(
        self,
        path: Path,
        slots: int = SLOTS,
        slot_bytes: int = SLOT_BYTES,
        *,
        large_bytes: int = LARGE_BYTES,
        on_table: Callable[[Table], None] | None = None,
    ) -> None:
        """`on_table`: called with each table the engine sends (its models and readiness)."""
        self.path = path
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.large_bytes = large_bytes
        self.on_table = on_table
        self.gpus: list[GpuReading] = []  # the GPUs the engine last said it computes on (Gpus)
        self._link: _Link | None = None
        self._arena: Arena | None = None  # reserved for the next connection
        self._connecting = asyncio.Lock()

    def reserve(self, what: str = "the hand-off's slots") -> None:
        """Reserve the next connection's memory now, if it is not yet: NoRoom (naming `what`, the size and the
        remedy) if the host or the container has not got it."""
        if self._arena is None:
            self._arena = Arena.create(self.slots, self.slot_bytes, what, large_bytes=self.large_bytes)

    async def linked(self) -> asyncio.Event:
        """Connect if not connected (Unavailable if no engine listens); the event set when that link ends."""
        return (await self._connected()).ended

    async def control(self, what: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """Model control in the engine ("load", "unload"): its result, or its error as the engine raised it."""
        link = await self._connected()
        return await link.control(what, arguments)

    def tell(self, what: str, arguments: dict[str, Any]) -> bool:
        """A model control that wants no answer ("refused_load"), sent if linked; whether it was."""
        link = self._link
        if link is None or link.closed:
            return False
        link.tell(what, arguments)
        return True

    async def infer(self, ask: Ask) -> np.ndarray:
        """The FFN of `ask.rows` from model `ask.model`, as an array carrying `ask.answer_dtype`."""
        if ask.monte_carlo is not None:
            raise ValueError("a Monte Carlo request is asked with infer_monte_carlo")
        link = await self._connected()
        (answer,) = await link.ask(ask)
        return answer

    def infer_soon(self, ask: Ask) -> asyncio.Future[np.ndarray]:
        """`infer` without a coroutine where the link is up: sent now, the answer's future (cancelling it
        withdraws the request). While there is no link yet, a task that waits for one, as `infer` does."""
        if ask.monte_carlo is not None:
            raise ValueError("a Monte Carlo request is asked with infer_monte_carlo")
        link = self._link
        if link is None or link.closed:
            return asyncio.ensure_future(self.infer(ask))
        future: asyncio.Future[np.ndarray] = link.ask_soon(ask, single=True)
        return future

    async def infer_monte_carlo(self, ask: Ask) -> MonteCarloResult:
        """The mean and std of `ask.monte_carlo`'s passes over `ask.rows`, each as `infer` answers."""
        if ask.monte_carlo is None:
            raise ValueError("infer_monte_carlo needs the request's monte_carlo")
        link = await self._connected()
        mean, std = await link.ask(ask)
        return MonteCarloResult(mean, std)

    def _took_gpus(self, gpus: list[GpuReading]) -> None:
        self.gpus = gpus

    @property
    def rows_in_flight(self) -> int:
        """Rows (times passes, for Monte Carlo) sent and not yet answered: how busy this front keeps the
        engine, by which a front of several engines picks the least loaded (app/handoff/remote.py)."""
        return 0 if self._link is None else self._link.rows_in_flight

    @property
    def in_flight(self) -> int:
        return 0 if self._link is None else len(self._link.pending)

    async def close(self) -> None:
        if self._link is not None:
            await self._link.close()
            self._link = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    async def _connected(self) -> _Link:
        link = self._link
        if link is not None and not link.closed:  # the common case: no lock, no turn of the loop
            return link
        async with self._connecting:
            if self._link is None or self._link.closed:
                try:
                    self.reserve()
                except NoRoom as exc:
                    raise Unavailable(str(exc)) from None
                assert self._arena is not None
                try:
                    self._link = await _Link.open(self.path, self._arena, self.on_table, self._took_gpus)
                finally:
                    # Handed over, the arena is the link's; kept for the next try if nothing listened.
                    if self._arena.block.fd is None:
                        self._arena = None
            return self._link


class _Link:
    """One connection: its arena, its requests in flight, and the task reading the engine's answers."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        arena: Arena,
        on_table: Callable[[Table], None] | None,
        on_gpus: Callable[[list[GpuReading]], None],
    ) -> None:
        self.arena = arena
        self.pending: dict[int, Pending] = {}
        self.rows_in_flight = 0  # of the requests in `pending`, times their passes
        self.replies: dict[int, asyncio.Future[dict[str, Any]]] = {}  # model control's, by id
        self.closed = False
        self.ended = asyncio.Event()
        self._on_table = on_table
        self._on_gpus = on_gpus
        self._writer = writer
        self._frames: FrameWriter[FrontMessage] = FrameWriter(writer)
        self._ids = itertools.count(1)
        self._frames.send(Hello(len(arena.slots), arena.slot_bytes, arena.large_bytes))
        self._reading = asyncio.create_task(self._read(reader), name="handoff-answers")

    @classmethod
    async def open(
        cls,
        path: Path,
        arena: Arena,
        on_table: Callable[[Table], None] | None,
        on_gpus: Callable[[list[GpuReading]], None],
    ) -> _Link:
        """Connect and hand `arena`'s memory to the engine; EngineNotRunning (the arena untouched) if nothing listens."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, str(path))
            send_memory(sock, arena.fd)
        except OSError as exc:
            sock.close()
            raise EngineNotRunning(f"the engine is not running (it may be restarting): {exc.strerror or exc}") from None
        except BaseException:
            sock.close()
            raise
        arena.handed_over()
        try:
            reader, writer = await asyncio.open_unix_connection(sock=sock)
        except BaseException:
            sock.close()
            arena.close()
            raise
        return cls(reader, writer, arena, on_table, on_gpus)

    async def control(self, what: str, arguments: dict[str, Any]) -> dict[str, Any]:
        ask = next(self._ids)
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.replies[ask] = reply
        self._frames.send(Control(ask, what, arguments))
        try:
            return await reply
        finally:
            self.replies.pop(ask, None)

    def tell(self, what: str, arguments: dict[str, Any]) -> None:
        self._frames.send(Control(0, what, arguments))

    async def ask(self, ask: Ask) -> list[np.ndarray]:
        answer: list[np.ndarray] = await self.ask_soon(ask)
        return answer

    def ask_soon(self, ask: Ask, *, single: bool = False) -> asyncio.Future[Any]:
        """Send `ask` now; the future of its answer (`single`: the array itself, else a list of them).

        Cancelling the future withdraws the request: the engine is told, and its slot stays taken
        until the engine answers for it (see app/handoff/engine.py)."""
        rows, answer_dtype, monte_carlo, context = ask.rows, ask.answer_dtype, ask.monte_carlo, ask.context
        parts = 1 if monte_carlo is None else 2
        slot = self._slot_for(max(rows.nbytes, rows.size * answer_dtype.itemsize * parts))
        target = self.arena.region(slot.place, slot.room, rows.nbytes)
        target[:] = np.ascontiguousarray(rows).data.cast("B")
        target.release()
        self.arena.let_go(slot)
        number = next(self._ids)
        loop = asyncio.get_running_loop()
        trace = None if context is None else context.trace
        pending = Pending(loop.create_future(), slot, answer_dtype, parts, context, single)
        self.pending[number] = pending
        self._frames.send(
            Submit(
                ask=number,
                place=slot.place,
                room=slot.room,
                generation=slot.generation,
                model=ask.model,
                version=ask.version,
                shape=tuple(rows.shape),
                rows_dtype=_dtype_name(rows),
                answer_dtype=answer_dtype.name,
                deadline=None if ask.deadline is None else time.monotonic() + (ask.deadline - loop.time()),
                monte_carlo=None
                if monte_carlo is None
                else MonteCarlo(monte_carlo.passes, monte_carlo.dropout, monte_carlo.seed),
                request_id=None if context is None else context.request_id,
                trace=None if trace is None else TraceContext.of(*trace.handed_off()),
            )
        )
        load = len(rows) * (1 if monte_carlo is None else monte_carlo.passes)
        self.rows_in_flight += load
        pending.answer.add_done_callback(lambda answer: self._asked(number, load, answer))
        return pending.answer

    def _asked(self, ask: int, load: int, answer: asyncio.Future[Any]) -> None:
        """A request's answer came, failed, or was given up: its rows leave the count; given up, the engine is told."""
        self.rows_in_flight -= load
        if answer.cancelled() and ask in self.pending and not self.closed:
            self._frames.send(Cancel(ask))

    async def close(self) -> None:
        self._reading.cancel()
        await asyncio.gather(self._reading, return_exceptions=True)
        self._end(Unavailable("the front is closing its link to the engine"))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                for message in await read_frame(reader, ENGINE_TO_FRONT):
                    if isinstance(message, Done) or (isinstance(message, Failed) and message.ask not in self.replies):
                        self._answered(message)
                    elif isinstance(message, Reply | Failed):
                        self._replied(message)
                    elif isinstance(message, Table):
                        if self._on_table is not None:
                            self._on_table(message)
                    elif isinstance(message, Gpus):
                        self._on_gpus(message.readings)
        except (asyncio.IncompleteReadError, ConnectionError, BadFrame):
            pass  # the engine ended the connection: everything in flight fails below
        finally:
            self._end(Unavailable("the engine process ended while this request was in flight; it is restarting"))

    def _answered(self, message: Done | Failed) -> None:
        pending = self.pending.pop(message.ask, None)
        if pending is None:
            return
        slot = pending.slot
        if message.generation != slot.generation:
            # Not this request's answer (it cannot be, while a slot is given back only on its answer).
            self.pending[message.ask] = pending
            return
        try:
            if pending.answer.done():  # its client left: nothing to answer, the slot is free again
                return
            if isinstance(message, Failed):
                pending.answer.set_exception(error_of(message))
                return
            arrays = self._arrays(pending, message.shape)
            pending.answer.set_result(arrays[0] if pending.single else arrays)
            context = pending.context
            if context is not None:
                copy = message.copy
                context.computed_by = (copy.name, copy.version, copy.digest)
                if message.rides is not None and context.trace is not None:
                    context.trace.rode_in_engine(rides_as_recorded(message.rides))
        finally:
            self.arena.give_back(slot)

    def _replied(self, message: Reply | Failed) -> None:
        reply = self.replies.pop(message.ask, None)
        if reply is None or reply.done():
            return
        if isinstance(message, Reply):
            reply.set_result(message.result)
        else:
            reply.set_exception(error_of(message))

    def _slot_for(self, nbytes: int) -> Slot:
        """A slot for a request whose rows or answer take up to `nbytes`: a small one, or a large one of its own
        size; Overloaded (429) while none is free, RequestTooLarge past the large area."""
        arena = self.arena
        if arena.fits(nbytes):
            slot = arena.take()
            if slot is None:
                raise Overloaded(f"all {len(arena.slots)} of this process's hand-off slots are in use", retry_after_s=1)
            return slot
        if nbytes > arena.large_bytes:
            raise RequestTooLarge(
                f"a request of {nbytes:,} bytes (rows or answer) is more than this process's hand-off holds "
                f"({arena.large_bytes:,} bytes)"
            )
        slot = arena.take_large(nbytes)
        if slot is None:
            raise Overloaded(
                f"this process's hand-off has no room for {nbytes:,} more bytes ({arena.large_free:,} free)",
                retry_after_s=1,
            )
        return slot

    def _arrays(self, pending: Pending, shape: tuple[int, ...]) -> list[np.ndarray]:
        dtype = np.dtype(pending.dtype.array)
        count = math.prod(shape)
        view = self.arena.answer(pending.slot)
        if view is None:
            raise RuntimeError("the slot holds no answer of this request's generation; this is a bug")
        flat = np.frombuffer(view, dtype=dtype).copy()  # the slot is taken again at once
        view.release()
        return [flat[i * count : (i + 1) * count].reshape(shape) for i in range(pending.parts)]

    def _end(self, error: Exception) -> None:
        """Fail what is in flight with `error`, and drop the arena: a new connection gets a new one."""
        if self.closed:
            return
        self.closed = True
        for pending in self.pending.values():
            if not pending.answer.done():
                pending.answer.set_exception(error)
        self.pending.clear()
        for reply in self.replies.values():
            if not reply.done():
                reply.set_exception(error)
        self.replies.clear()
        self._writer.close()
        self.arena.close()
        self.ended.set()


def _dtype_name(rows: np.ndarray) -> str:
    """The rows' dtype by ffn_core/dtypes.py's name: a uint16 array carries bfloat16."""
    dtype = rows.dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:  # numpy's str(dtype) runs in Python (a microsecond a request): each kind is named once
        name = _DTYPE_NAMES[dtype] = "bfloat16" if dtype == np.uint16 else str(dtype)
    return name


_DTYPE_NAMES: dict[np.dtype[Any], str] = {}
