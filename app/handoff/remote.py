"""RemoteEngine: the engine facade (app/engine/facade.py) of an engine in another process, for a front.

The doors and the protocol core know the engine only through its facade; a front process serves
them this one instead of an in-process Engine. No torch: the models are the engine's table (sent
after each connection and whenever it changes, engine.py's `engine_table`), their work goes
through the hand-off (`EngineClient`), and model control is a message the engine answers.

While no engine is linked (it is starting, or restarting after it died), the front is not ready:
readiness says why, every model is unavailable (503), and a task links again every RETRY_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from app.engine.errors import Unavailable
from app.engine.facade import ModelFacade, ServingEngine
from app.engine.loop_watch import LoopWatch
from app.engine.montecarlo import MonteCarloRequest, MonteCarloResult
from app.engine.status import DRAINING, ModelState, ModelStatus
from app.engine.unloaded import not_ready_error, not_served_error
from app.handoff.front import EngineClient
from app.settings import Settings
from ffn_core.dtypes import DTYPES, DType

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
    """One model of the engine's table: its description, and its work sent to the engine."""

    def __init__(self, client: EngineClient, description: dict[str, Any], unable: ModelStatus | None = None) -> None:
        """`unable`: the status this front gives it whatever the engine says (no engine linked, draining)."""
        self._client = client
        self._description = description
        self.name: str = description["name"]
        self.version: int = description["version"]
        self.digest: str = description["digest"]
        self.d_model: int = description["d_model"]
        self.dtype: DType = DTYPES[description["dtype"]]
        self.dropout: float = description["dropout"]
        self.config = RemoteShape(
            description["d_ff"], description["activation"], description["gated"], description["variant"]
        )
        self.device = RemoteDevice.parse(description["device"])
        self.weight_bytes: int = description.get("weight_bytes", 0)
        self.status = unable or ModelStatus(ModelState(description["state"]), description["reason"] or "")

    def describe(self) -> dict[str, Any]:
        """The model as GET /v1/models lists it: the engine's description (and its state here)."""
        return {key: value for key, value in self._description.items() if key != "weight_bytes"} | {
            "ready": self.status.ready,
            "state": self.status.state.value,
            "reason": self.status.reason,
        }

    def check_serving(self) -> None:
        if not self.status.ready:
            raise not_ready_error(self.name, self.status)

    async def infer(self, rows: np.ndarray, answer_dtype: DType, *, deadline: float | None) -> np.ndarray:
        return await self._client.infer(self.name, None, rows, answer_dtype, deadline=deadline)

    async def infer_monte_carlo(
        self, rows: np.ndarray, request: MonteCarloRequest, answer_dtype: DType, *, deadline: float | None
    ) -> MonteCarloResult:
        return await self._client.infer_monte_carlo(self.name, None, rows, request, answer_dtype, deadline=deadline)


class RemoteEngine:
    """The facade of the engine listening where `client` connects, with the lifecycle a served process
    runs its engine by (app/main.py, app/server.py): start, until_warm, drain, stop.

    `beat`: called on every tick of this process's loop watch (a worker's heartbeat to the supervisor).
    """

    batches_here = False  # the engine process forms them

    def __init__(self, client: EngineClient, settings: Settings, beat: Callable[[], None] | None = None) -> None:
        self.settings = settings
        self._client = client
        client.on_table = self._take_table
        self._table: dict[str, Any] | None = None
        self._linked = False
        self._draining = False
        self._models: dict[str, RemoteModel] = {}
        self._unloaded: dict[str, RemoteModel] = {}
        self._tables = asyncio.Event()  # set at each table: until_warm waits on it
        self._start_stopped = asyncio.Event()
        self._keeping: asyncio.Task[None] | None = None
        self._loop_watch = LoopWatch(settings.max_loop_lag_s, beat)
        self._hooks: list[tuple[Callable[[Any], None], bool]] = []
        self._why_unlinked: str | None = None  # the last failed link's reason
        self._prepared: set[tuple[Any, ...]] = set()

    async def start(self) -> None:
        """Link, and keep linking whenever the link ends; ready once the engine's table says so (until_warm)."""
        self._loop_watch.start()
        self._keeping = asyncio.create_task(self._keep_linked(), name="handoff-link")

    async def until_warm(self) -> None:
        """Wait until the engine is linked and ready (or the start is stopped: `stop_starting`)."""
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
        the engine; True if it was all answered within the drain timeout. The engine drains on its own."""
        self._draining = True
        self._rebuild()
        try:
            async with asyncio.timeout(self.settings.drain_timeout_s):
                while self._client.in_flight:
                    await asyncio.sleep(0.01)
        except TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        self._loop_watch.stop()
        await self.close()

    async def close(self) -> None:
        if self._keeping is not None:
            self._keeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeping
        await self._client.close()

    async def apply_config_file(self) -> None:
        log.warning("SIGHUP ignored by a front: the engine process reads the config file (send it SIGHUP)")

    def on_serving(self, prepare: Callable[[Any], None], *, once_per_name: bool = False) -> None:
        """Call `prepare(model)` for every model served now and each one a later table adds (each version,
        or once per name)."""
        self._hooks.append((prepare, once_per_name))
        self._run_hooks()

    # ----- the facade ------------------------------------------------------------------------

    def model(self, name: str, version: str | None = None) -> RemoteModel:
        served = self._models.get(name)
        if served is None:
            raise not_served_error(name, version, None, unloaded=name in self._unloaded)
        if version is not None and version != str(served.version):
            raise not_served_error(name, version, served.version, unloaded=False)
        return served

    def models(self) -> list[RemoteModel]:
        return list(self._models.values())

    def listed(self) -> list[RemoteModel]:
        return [*self._models.values(), *self._unloaded.values()]

    def readiness(self) -> ModelStatus:
        if self._draining:
            return DRAINING
        if not self._linked or self._table is None:
            return self._not_linked()
        lagging = self._loop_watch.lagging()
        if lagging is not None:
            return ModelStatus(ModelState.UNAVAILABLE, lagging)
        state, reason = self._table["readiness"]
        return ModelStatus(ModelState(state), reason)

    @property
    def ready(self) -> bool:
        return self.readiness().ready

    @property
    def cuda_available(self) -> bool:
        return bool(self._table and self._table["cuda"])

    async def load(self, name: str, config: str | None = None) -> dict[str, Any]:
        return await self._client.control("load", {"name": name, "config": config})

    async def unload(self, name: str) -> dict[str, Any]:
        return await self._client.control("unload", {"name": name})

    def count_refused_load(self, name: str) -> None:
        """Counted by the engine, which keeps the model-load series; lost while no engine is linked."""
        if not self._client.tell("refused_load", {"name": name}):
            log.warning("a refused load of %r was not counted: no engine is linked", name[:100])

    # ----- the link --------------------------------------------------------------------------

    def _take_table(self, table: dict[str, Any]) -> None:
        self._table = table
        self._linked = True
        self._rebuild()
        self._run_hooks()
        self._tables.set()

    def _rebuild(self) -> None:
        table = self._table or {"models": [], "unloaded": []}
        unable = DRAINING if self._draining else None if self._linked else self._not_linked()
        self._models = {d["name"]: RemoteModel(self._client, d, unable) for d in table["models"]}
        self._unloaded = {d["name"]: RemoteModel(self._client, d, unable) for d in table["unloaded"]}

    def _not_linked(self) -> ModelStatus:
        """Why there is no engine: not running (the common case), or what the last try to link said."""
        if self._why_unlinked is None or self._why_unlinked.startswith("the engine is not running"):
            return NOT_LINKED
        return ModelStatus(ModelState.UNAVAILABLE, self._why_unlinked)

    def _run_hooks(self) -> None:
        for prepare, once_per_name in self._hooks:
            for served in self._models.values():
                key = (id(prepare), served.name) if once_per_name else (id(prepare), served.name, served.version)
                if key not in self._prepared:
                    self._prepared.add(key)
                    prepare(served)

    async def _keep_linked(self) -> None:
        while True:
            try:
                ended = await self._client.linked()
            except Unavailable as exc:
                if exc.message != self._why_unlinked:  # said once, not every RETRY_S
                    log.warning("cannot link to the engine process: %s", exc.message)
                    self._why_unlinked = exc.message
                    self._rebuild()
                await asyncio.sleep(RETRY_S)
                continue
            self._why_unlinked = None
            await ended.wait()
            self._linked = False  # until the next engine's table: every model unavailable, not ready
            self._rebuild()
            self._tables.set()
            log.warning("the engine process's link ended; linking again")
            await asyncio.sleep(RETRY_S)


if TYPE_CHECKING:  # mypy holds the front's engine to the facade the doors know, as main.py holds Engine
    _ENGINE: type[ServingEngine] = RemoteEngine
    _MODEL: type[ModelFacade] = RemoteModel
