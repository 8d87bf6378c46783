"""RemoteEngine: the engine facade (app/engine/facade.py) of engines in other processes, for a front.

The doors and the protocol core know the engine only through its facade; a front process serves
them this one instead of an in-process Engine. No torch: the models are the engines' tables (sent
after each connection and whenever one changes, engine.py's `engine_table`), their work goes
through the hand-off (`EngineClient`), and model control is a message an engine answers.

Several engines (one per entry of `devices`) serve the same models: a request goes to the one,
among those whose copy is ready, with the fewest rows in flight from this front (ties taken in
turn), and a model load or unload is asked of one, which applies it in every engine through the
supervisor (and it is replayed to an engine that restarts). While no engine is linked (starting, or
restarting after it died), the front is not ready: readiness says why, every model is unavailable
(503), and a task per engine links again every RETRY_S; while one of several is linked, the front
serves through it.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from app.config.settings import Settings
from app.engine.description import ModelDescription, listing
from app.engine.errors import Unavailable
from app.engine.facade import ModelFacade, ServingEngine
from app.engine.loop_watch import LoopWatch
from app.engine.montecarlo import MonteCarloRequest, MonteCarloResult
from app.engine.status import DRAINING, ModelState, ModelStatus
from app.engine.unloaded import not_ready_error, not_served_error
from app.handoff.front import Ask, EngineClient, EngineNotRunning
from app.handoff.messages import Table
from app.observe.identity import current
from ffn_core.dtypes import DTYPES, DType

if TYPE_CHECKING:  # a type only: app.observe.collectors imports torch within its readers (pyproject: no torch here)
    from app.observe.collectors import GpuReading

log = logging.getLogger("ffn_serve.handoff")

RETRY_S = 0.2  # how often a front without an engine tries to link again
NOT_LINKED = ModelStatus(ModelState.UNAVAILABLE, "the engine process is not running (it may be restarting)")


@dataclass(frozen=True)
class RemoteDevice:
    """Where the engine computes a model ("cpu", or "cuda" and its index), read from its description."""

    type: str
    index: int | None

    @classmethod
    def parse(cls, device: str) -> RemoteDevice:
        kind, _, index = device.partition(":")
        return cls(kind, int(index) if index else None)

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


@dataclass(frozen=True)
class RemoteShape:
    """What the doors read of a model's configuration (the facade's FFNShape)."""

    d_ff: int
    activation: str
    gated: bool
    variant: str


class RemoteModel:
    """One model of the engines' tables: its description, and its work sent to one of the engines serving it."""

    def __init__(self, copies: Sequence[tuple[EngineClient, ModelDescription, ModelStatus]]) -> None:
        """`copies`: the model in each engine whose table lists it, with the status this front gives that copy."""
        self._clients = [client for client, _, status in copies if status.ready]
        self._turn = itertools.count()
        # The doors describe the model by a copy that serves (the engines load one config alike).
        _, description, self.status = next((copy for copy in copies if copy[2].ready), copies[0])
        self.description = description
        self._client = self._clients[0] if self._clients else copies[0][0]
        self.name = description.name
        self._version = description.version
        self._digest = description.digest
        self.d_model = description.d_model
        self.dtype: DType = DTYPES[description.dtype]
        self.dropout = description.dropout
        self.config = RemoteShape(description.d_ff, description.activation, description.gated, description.variant)
        self.device = RemoteDevice.parse(description.device)
        self.weight_bytes = description.weight_bytes

    @property
    def version(self) -> int:
        """The version this front's table names; within a request this model answered, the version of
        the copy that computed it (a reload may have raced the request to the engine)."""
        computed = self._computed()
        return self._version if computed is None else computed[1]

    @property
    def digest(self) -> str:
        """As `version`: the table's, or that of the copy that computed the current request's answer."""
        computed = self._computed()
        return self._digest if computed is None else computed[2]

    def _computed(self) -> tuple[str, int, str] | None:
        context = current()
        computed = None if context is None else context.computed_by
        return computed if computed is not None and computed[0] == self.name else None

    def describe(self) -> dict[str, Any]:
        """The model as GET /v1/models lists it: the engine's description, in its state here."""
        return listing(self.description, self.status)

    def check_serving(self) -> None:
        if not self.status.ready:
            raise not_ready_error(self.name, self.status)

    def _least_loaded(self) -> EngineClient:
        """The engine with the fewest of this front's rows in flight, among those whose copy serves;
        ties in turn, so that light traffic reaches (and keeps warm) every engine."""
        clients = self._clients
        if len(clients) < 2:
            return self._client
        first = next(self._turn) % len(clients)
        return min(clients[first:] + clients[:first], key=lambda client: client.rows_in_flight)

    async def infer(self, rows: np.ndarray, answer_dtype: DType, *, deadline: float | None) -> np.ndarray:
        return await self.infer_soon(rows, answer_dtype, deadline=deadline)

    def infer_soon(
        self,
        rows: np.ndarray,
        answer_dtype: DType,
        *,
        deadline: float | None,
        settled: Callable[[asyncio.Future[np.ndarray]], None] | None = None,
    ) -> asyncio.Future[np.ndarray]:
        """`infer` without a coroutine (the HTTP door's lean path): sent to the least loaded engine now, the
        answer's future; cancelling it withdraws the request. The current request's context crosses with it.
        `settled`: a done-callback of the future."""
        client = self._least_loaded()
        future = client.infer_soon(Ask(self.name, None, rows, answer_dtype, deadline=deadline, context=current()))
        if settled is not None:
            future.add_done_callback(settled)
        return future

    async def infer_monte_carlo(
        self, rows: np.ndarray, request: MonteCarloRequest, answer_dtype: DType, *, deadline: float | None
    ) -> MonteCarloResult:
        client = self._least_loaded()
        return await client.infer_monte_carlo(
            Ask(self.name, None, rows, answer_dtype, deadline=deadline, monte_carlo=request, context=current())
        )


class _Linked:
    """What a front knows of one engine process: its client, the last table it sent, whether it is linked."""

    def __init__(self, client: EngineClient, name: str) -> None:
        self.client = client
        self.name = name  # "the engine process", or "engine process 1" of several
        self.table: Table | None = None
        self.linked = False
        self.failure: Unavailable | None = None  # why the last try to link failed; None: it did not

    def not_linked(self) -> ModelStatus:
        """Why this engine serves nothing: not running (the common case), or what the last try to link said."""
        if self.failure is None or isinstance(self.failure, EngineNotRunning):
            return NOT_LINKED
        return ModelStatus(ModelState.UNAVAILABLE, self.failure.message)


class RemoteEngine:
    """The facade of the engines listening where `clients` connect (one, or one per device), with the
    lifecycle a served process runs its engine by (app/main.py, app/process/server.py): start, until_warm,
    drain, stop.

    `beat`: called on every tick of this process's loop watch (a worker's heartbeat to the supervisor).
    """

    batches_here = False  # the engine processes form them

    def __init__(
        self, clients: Sequence[EngineClient], settings: Settings, beat: Callable[[], None] | None = None
    ) -> None:
        if not clients:
            raise ValueError("a front needs at least one engine")
        self.settings = settings
        several = len(clients) > 1
        self._engines = [
            _Linked(client, f"engine process {k}" if several else "the engine process")
            for k, client in enumerate(clients)
        ]
        for engine in self._engines:
            engine.client.on_table = functools.partial(self._take_table, engine)
        self._draining = False
        self._models: dict[str, RemoteModel] = {}
        self._unloaded: dict[str, RemoteModel] = {}
        self._tables = asyncio.Event()  # set at each table: until_warm waits on it
        self._start_stopped = asyncio.Event()
        self._keeping: list[asyncio.Task[None]] = []
        self._loop_watch = LoopWatch(settings.max_loop_lag_s, beat)
        self._hooks: list[tuple[Callable[[Any], None], bool]] = []
        self._prepared: set[tuple[Any, ...]] = set()

    async def start(self) -> None:
        """Link, and keep linking whenever a link ends; ready once an engine's table says so (until_warm)."""
        self._loop_watch.start()
        self._keeping = [
            asyncio.create_task(self._keep_linked(engine), name=f"handoff-link-{k}")
            for k, engine in enumerate(self._engines)
        ]

    async def until_warm(self) -> None:
        """Wait until an engine is linked and ready (or the start is stopped: `stop_starting`)."""
        while not self.ready and not self._start_stopped.is_set():
            self._tables.clear()
            stopped = asyncio.ensure_future(self._start_stopped.wait())
            tabled = asyncio.ensure_future(self._tables.wait())
            try:
                await asyncio.wait([stopped, tabled], return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopped.cancel()
                tabled.cancel()

    def stop_starting(self) -> None:
        self._start_stopped.set()

    async def drain(self) -> bool:
        """Take no new work (readiness and new requests turn 503), then wait for what this front has in
        the engines; True if it was all answered within the drain timeout. The engines drain on their own."""
        self._draining = True
        self._rebuild()
        try:
            async with asyncio.timeout(self.settings.drain_timeout_s):
                while any(engine.client.in_flight for engine in self._engines):
                    await asyncio.sleep(0.01)
        except TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        self._loop_watch.stop()
        await self.close()

    async def close(self) -> None:
        for task in self._keeping:
            task.cancel()
        await asyncio.gather(*self._keeping, return_exceptions=True)
        for engine in self._engines:
            await engine.client.close()

    async def apply_config_file(self) -> None:
        log.warning("SIGHUP ignored by a front: the engine processes read the config file (send them SIGHUP)")

    def on_serving(self, prepare: Callable[[Any], None], *, once_per_name: bool = False) -> None:
        """Call `prepare(model)` for every model served now and each one a later table adds (each version,
        or once per name)."""
        self._hooks.append((prepare, once_per_name))
        self._run_hooks()

    # ----- the facade ------------------------------------------------------------------------

    def model(self, name: str, version: str | None = None) -> RemoteModel:
        served = self._models.get(name)
        if served is None:
            raise not_served_error(name, version, None, unloaded=name in self._unloaded, served=self._models.keys())
        if version is not None and version != str(served.version):
            raise not_served_error(name, version, served.version, unloaded=False)
        return served

    def models(self) -> list[RemoteModel]:
        return list(self._models.values())

    def listed(self) -> list[RemoteModel]:
        return [*self._models.values(), *self._unloaded.values()]

    def readiness(self) -> ModelStatus:
        """Ready while one engine is linked and ready: a front of several serves through those that are."""
        if self._draining:
            return DRAINING
        tabled = [engine.table for engine in self._engines if engine.linked and engine.table is not None]
        if not tabled:
            return self._engines[0].not_linked()
        lagging = self._loop_watch.lagging()
        if lagging is not None:
            return ModelStatus(ModelState.UNAVAILABLE, lagging)
        statuses = [ModelStatus(ModelState(t.readiness_state), t.readiness_reason) for t in tabled]
        return next((status for status in statuses if status.ready), statuses[0])

    @property
    def ready(self) -> bool:
        return self.readiness().ready

    @property
    def cuda_available(self) -> bool:
        return any(engine.table is not None and engine.table.cuda for engine in self._engines)

    def gpus(self) -> list[GpuReading]:
        """What the linked engines last said of their GPUs (every GPUS_EVERY_S), each GPU once."""
        readings = {gpu.uuid: gpu for engine in self._engines if engine.linked for gpu in engine.client.gpus}
        return list(readings.values())

    async def load(self, name: str, config: str | None = None) -> dict[str, Any]:
        return await self._control("load", {"name": name, "config": config})

    async def unload(self, name: str) -> dict[str, Any]:
        return await self._control("unload", {"name": name})

    def count_refused_load(self, name: str) -> None:
        """Counted by an engine, which keeps the model-load series; lost while none is linked."""
        if not any(engine.client.tell("refused_load", {"name": name}) for engine in self._engines):
            log.warning("a refused load of %r was not counted: no engine is linked", name[:100])

    async def _control(self, what: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """A model control, asked of one linked engine: it reaches the others through the supervisor, as
        a load reaches every worker (app/engine/service.py), and is replayed to one that restarts."""
        linked = next((engine for engine in self._engines if engine.linked), self._engines[0])
        return await linked.client.control(what, arguments)

    # ----- the links -------------------------------------------------------------------------

    def _take_table(self, engine: _Linked, table: Table) -> None:
        engine.table = table
        engine.linked = True
        self._rebuild()
        self._run_hooks()
        self._tables.set()

    def _rebuild(self) -> None:
        """The models from every engine's last table, each copy with the status this front gives it."""
        served: dict[str, list[tuple[EngineClient, ModelDescription, ModelStatus]]] = {}
        unloaded: dict[str, list[tuple[EngineClient, ModelDescription, ModelStatus]]] = {}
        for engine in self._engines:
            table = engine.table
            if table is None:
                continue
            unable = DRAINING if self._draining else None if engine.linked else engine.not_linked()
            for listed, entries in ((served, table.models), (unloaded, table.unloaded)):
                for entry in entries:
                    status = unable or ModelStatus(ModelState(entry.state), entry.reason)
                    listed.setdefault(entry.description.name, []).append((engine.client, entry.description, status))
        self._models = {name: RemoteModel(copies) for name, copies in served.items()}
        self._unloaded = {name: RemoteModel(copies) for name, copies in unloaded.items() if name not in served}

    def _run_hooks(self) -> None:
        for prepare, once_per_name in self._hooks:
            for served in self._models.values():
                key = (id(prepare), served.name) if once_per_name else (id(prepare), served.name, served.version)
                if key not in self._prepared:
                    self._prepared.add(key)
                    prepare(served)

    async def _keep_linked(self, engine: _Linked) -> None:
        while True:
            try:
                ended = await engine.client.linked()
            except Unavailable as exc:
                if engine.failure is None or exc.message != engine.failure.message:  # said once, not every RETRY_S
                    log.warning("cannot link to %s: %s", engine.name, exc.message)
                    engine.failure = exc
                    self._rebuild()
                await asyncio.sleep(RETRY_S)
                continue
            engine.failure = None
            await ended.wait()
            engine.linked = False  # until its next table: its copies unavailable
            self._rebuild()
            self._tables.set()
            log.warning("the link to %s ended; linking again", engine.name)
            await asyncio.sleep(RETRY_S)


if TYPE_CHECKING:  # mypy holds the front's engine to the facade the doors know, as main.py holds Engine
    _ENGINE: type[ServingEngine] = RemoteEngine
    _MODEL: type[ModelFacade] = RemoteModel
