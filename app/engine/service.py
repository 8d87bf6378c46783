"""Engine: the one object the edge talks to, like TEI's router and its `Infer`. No HTTP here.

The edge looks a model up (`model`, `models`), reads its status or the server's (`readiness`),
and sends it work through the ServedModel it got (`check_serving`, `infer`, `infer_monte_carlo`);
the server process drives the lifecycle: start, warm up, drain, stop. A protocol (native, V2
over HTTP, gRPC) is a codec and routes on this facade, nothing more: it knows it through
app/engine/facade.py's protocols (numpy arrays in and out, no torch), and app/main.py wires this in.

start: load (unless already loaded), start every batcher, then warm up in the background;
each model turns READY once it has run its batch-size buckets. drain: every model turns
UNAVAILABLE and the accepted work finishes. stop: answer whatever is left and release the
device threads.

Model control (model_control = explicit): `load` and `unload` (one call each, whichever door
asks: V2 over HTTP, gRPC) resolve the model's table here, then broadcast the command to every
serving process (app/control.py), which applies it (app/engine/lifecycle.py); the answer comes
once all have, and names those that failed. `apply_config_file` is SIGHUP's: the config file
read again, and what differs loaded or unloaded the same way. Every load refused or failed is
counted (ffn_model_loads_total{outcome="failed"}): here when refused before the broadcast, else
by each worker that failed; under the model's name when a [[models]] table names it, else under
one label for every other name (`counted_as`).

The models are the configuration's, as Triton's are its repository's: a load serves only a name
a [[models]] table names (the config file's, read again at each load; without a config file,
the models served from the start), and a load's config parameter replaces that name's table,
never adds a name. So the models a client can have served are the operator's, in number and
weights, and a load of any other name is refused before any worker hears of it (before, a load
of any new name with `config {}` built a copy of the demo weights, about 10 MiB each, without
bound: python3 -m bench.model_loads). A model unloaded once no table names it (its table removed, then SIGHUP or an unload)
is forgotten: it leaves the repository index and /metrics, in every worker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import torch

from app.config.settings import ModelSpec, Settings, configured_models
from app.config.settings_problems import SettingsError
from app.control import Control, Reply
from app.engine.errors import LoadFailed, ModelControlOff, ModelNotFound, Unavailable
from app.engine.lifecycle import LOAD_MODEL, UNLOAD_MODEL, Lifecycle, model_key
from app.engine.loop_watch import LoopWatch
from app.engine.registry import Registry, ServedModel
from app.engine.repository import changes, identify, spec_from_config
from app.engine.status import DRAINING, READY, ModelState, ModelStatus
from app.engine.unloaded import UnloadedModel, not_served_error
from app.errors import ServiceError
from app.observe.collectors import GpuReading, read_gpus
from app.observe.metrics import OTHER_MODELS

# The doors know these through app/engine/facade.py's protocols only (they never import torch).
__all__ = ["Engine", "ServedModel", "UnloadedModel"]

log = logging.getLogger("ffn_serve")

# A load's answer waits this long for every worker: reading a large checkpoint from a slow disk takes minutes.
LOAD_TIMEOUT_S = 300.0


class Engine:
    """The served models, looked up by name, and their lifecycle from start to drain."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        control: Control | None = None,
        beat: Callable[[], None] | None = None,
    ) -> None:
        """`control`: how a load reaches every serving process (by default this one alone).
        `beat`: called on every tick of the loop watch (a worker's heartbeat to its supervisor)."""
        self.settings = settings
        self._registry = registry
        self._started = False
        self._draining = False
        self._warm_up_task: asyncio.Task[None] | None = None
        self._start_stopped = asyncio.Event()
        self._control = control or Control()
        self._lifecycle = Lifecycle(registry)
        self._control.register(LOAD_MODEL, self._lifecycle.apply_load)
        self._control.register(UNLOAD_MODEL, self._lifecycle.apply_unload)
        self._config_lock = asyncio.Lock()  # one SIGHUP applied at a time
        self._loop_watch = LoopWatch(settings.max_loop_lag_s, beat)
        # The [[models]] tables served from the start (without a config file, the configuration for
        # good), and the names the tables give: at start, then as the config file last read said.
        self._start_tables = {spec.name: spec for spec in settings.served_models()}
        self._configured = set(self._start_tables)

    # ----- lookup ----------------------------------------------------------------------------

    batches_here = True  # the models' batches are this process's (app/handoff/remote.py's are not)

    def model(self, name: str, version: str | None = None) -> ServedModel:
        """The model served as `name` (and `version`, where a path names one); ModelNotFound (404) if none."""
        served = self._registry.models.get(name)
        if served is None:
            models = self._registry.models
            raise not_served_error(name, version, None, unloaded=name in self._registry.unloaded, served=models.keys())
        if version is not None and version != str(served.version):
            raise not_served_error(name, version, served.version, unloaded=False)
        return served

    def models(self) -> list[ServedModel]:
        return list(self._registry.models.values())

    def unloaded(self) -> list[UnloadedModel]:
        """The models unloaded while serving: listed (UNAVAILABLE, "unloaded"), but not served."""
        return list(self._registry.unloaded.values())

    def on_serving(self, prepare: Callable[[ServedModel], None], *, once_per_name: bool = False) -> None:
        """Call `prepare(served)` for every copy serving now and for each one a load puts in service,
        before it takes any request (the tracing's hook); `once_per_name`: for a name's first copy only
        (what outlives a reload: the doors' series of that name)."""
        self._lifecycle.add_hook(prepare, once_per_name=once_per_name, serving=self.models())

    def listed(self) -> list[ServedModel | UnloadedModel]:
        """Every model a list shows (GET /v1/models, the repository index): served, then unloaded."""
        return [*self.models(), *self.unloaded()]

    # ----- status ----------------------------------------------------------------------------

    def readiness(self) -> ModelStatus:
        """The server's status: READY when every loaded model is (as Triton); otherwise the first reason why not.

        Unloaded models do not count: a server whose models were all unloaded is ready (with
        nothing to serve), so that a load can still reach it through a load balancer.
        """
        if self._draining:
            return DRAINING
        models = self.models()
        if not self._started or not (models or self._registry.unloaded):
            return ModelStatus(ModelState.LOADING, "models are still loading")
        unavailable = [
            f"model {m.name!r}: {m.status.reason}" for m in models if m.status.state is ModelState.UNAVAILABLE
        ]
        if unavailable:
            return ModelStatus(ModelState.UNAVAILABLE, "; ".join(unavailable))
        if any(m.status.state is ModelState.LOADING for m in models):
            return ModelStatus(ModelState.LOADING, "models are still loading or warming up")
        lagging = self._loop_watch.lagging()
        if lagging is not None:
            return ModelStatus(ModelState.UNAVAILABLE, lagging)
        return READY

    @property
    def ready(self) -> bool:
        return self.readiness().ready

    @property
    def cuda_available(self) -> bool:
        """Whether this server sees a CUDA device (what CUDA shared memory's refusal says)."""
        return torch.cuda.is_available()

    def gpus(self) -> list[GpuReading]:
        """The GPUs where this process holds memory, read now."""
        return read_gpus()

    # ----- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Load if needed and start the batchers; warm-up runs in the background (live before ready)."""
        # Before the model thread exists: a thread takes torch's count at its first parallel operation.
        if threads := self.settings.intra_op_threads():
            torch.set_num_threads(threads)
        self._loop_watch.start()
        if not self._registry.models:
            await asyncio.to_thread(self._registry.load)
        for served in self.models():
            await served.start()
        self._warm_up_task = asyncio.create_task(self._warm_up(), name="warm-up")
        self._started = True

    async def until_warm(self) -> None:
        """Wait for the warm-up that start() began; a worker process accepts no connection before it ends.

        Returns at once when the start is stopped (`stop_starting`): the warm-up is then left to `stop`.
        """
        if self._warm_up_task is None:
            return
        stopped = asyncio.ensure_future(self._start_stopped.wait())
        try:
            await asyncio.wait([self._warm_up_task, stopped], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if self._warm_up_task.done():
            self._warm_up_task.result()  # its failure, if it failed

    def stop_starting(self) -> None:
        """A signal came while starting: stop waiting for the warm-up (the server then stops without serving)."""
        self._start_stopped.set()

    async def drain(self) -> bool:
        """Stop taking work (readiness and new requests turn 503), then finish what was accepted.

        True if everything accepted was answered within the drain timeout.
        """
        self._draining = True
        self._lifecycle.closed = True  # a load under way serves nothing now
        models = self.models()
        finished = all(await asyncio.gather(*(m.drain(self.settings.drain_timeout_s) for m in models)))
        if not finished:
            # Out of time: answer what is left 503 now, while its clients are still connected
            # (after uvicorn's own grace period their requests would be cancelled instead).
            for served in models:
                await served.stop()
        return finished

    async def stop(self) -> None:
        """Stop warming up and the loop watch, answer every pending entry 503 and release the device threads."""
        if self._warm_up_task is not None:
            self._warm_up_task.cancel()
        self._loop_watch.stop()
        for served in self.models():
            await served.stop()
        await self._lifecycle.stop()
        self._registry.shutdown_executors()

    async def _warm_up(self) -> None:
        for served in self.models():
            await served.warm_up(self.settings.warmup)
        log.info("ready: %s", ", ".join(self._registry.models))

    # ----- model control ---------------------------------------------------------------------

    async def load(self, name: str, config: str | None = None) -> dict[str, Any]:
        """Load or reload `name` in every serving process: {"name", "version", "workers": [...]}.

        `config`: a [[models]] table as JSON (its weights inside the model repository); without
        it, the config file's table of that name, read again, else the table it was served with.
        LoadFailed names the file and why, and the workers that failed (they keep their copy).
        """
        try:
            self._check_control()
            spec = self._table(name, config)
        except ServiceError:
            self.count_refused_load(name)
            raise
        return await self._load(spec)

    def counted_as(self, name: str) -> str:
        """The model label a failed load of `name` is counted under: the name when a [[models]] table
        names it or it is served (or listed unloaded), else one label for all others, so refusals add
        no series. A name forgotten and named by a table again counts under the others until a load
        of it reaches the workers (which show its series again)."""
        known = name in self._configured or name in self._registry.models or name in self._registry.unloaded
        return name if known and name not in self._registry.metrics.hidden else OTHER_MODELS

    def count_refused_load(self, name: str) -> None:
        """Count a load of `name` refused before any worker heard of it (ffn_model_loads_total, failed)."""
        self._registry.metrics.model_loads.labels(model=self.counted_as(name), outcome="failed").inc()

    async def unload(self, name: str) -> dict[str, Any]:
        """Unload `name` in every serving process: {"name", "version" (the one unloaded), "workers"}.

        A model a [[models]] table still names stays listed (UNAVAILABLE, "unloaded"), to be loaded
        again; one no table names any more is forgotten (Lifecycle.apply_unload).
        """
        self._check_control()
        if name not in self._registry.models and name not in self._registry.unloaded:
            raise ModelNotFound(f"model {name[:100]!r} is not served here: nothing to unload", name=name)
        try:
            configured = set(self._tables())
        except LoadFailed:  # a config file that cannot be read now: as it last read
            configured = self._configured
        args = {"name": name, "forget": name not in configured}
        replies = await asyncio.shield(self._control.broadcast(UNLOAD_MODEL, args, sticky=model_key(name)))
        return _outcome(name, "unload", replies)

    async def apply_config_file(self) -> None:
        """SIGHUP: read the config file again; load the models added or changed (table edited, file
        replaced), unload those removed. Each change and its outcome is logged."""
        async with self._config_lock:
            path = self.settings.config
            if self.settings.model_control != "explicit":
                log.warning("SIGHUP ignored: model_control is none, the models are fixed at start")
                return
            if path is None:
                log.warning("SIGHUP ignored: there is no config file to read again (--config, FFN_CONFIG)")
                return
            try:
                wanted = await asyncio.to_thread(configured_models, path)
            except SettingsError as exc:
                log.error("SIGHUP: config file %s not applied: %s", path, "; ".join(exc.problems))
                return
            self._configured = {spec.name for spec in wanted}
            plan = changes({m.name: m.served for m in self.models()}, wanted)
            log.info("SIGHUP: config file %s read again: %s", path, plan.summary())
            specs = [*plan.added, *(spec for spec, _ in plan.changed)]
            # Models unloaded earlier whose table is gone now: forgotten too (an unload of them is done already).
            unlisted = [name for name in self._registry.unloaded if name not in self._configured]
            results = await asyncio.gather(
                *(self._load(spec) for spec in specs),
                *(self.unload(name) for name in plan.removed),
                return_exceptions=True,
            )
            for name in unlisted:
                try:
                    await self.unload(name)
                except ServiceError as exc:
                    log.error("SIGHUP: model %s not forgotten: %s", name, exc)
            done = ["serving"] * len(specs) + ["unloaded"] * len(plan.removed)
            for result, what in zip(results, done, strict=True):
                if isinstance(result, dict):
                    processes = len(result["workers"])
                    log.info(
                        "SIGHUP: model %s: version %d %s in %d process(es)",
                        result["name"],
                        result["version"],
                        what,
                        processes,
                    )
                elif isinstance(result, Exception):
                    log.error("SIGHUP: %s", result)

    def _check_control(self) -> None:
        if self.settings.model_control != "explicit":
            raise ModelControlOff("model control is off (model_control = none): the models are fixed at start")
        if self._draining:
            raise Unavailable("the server is draining before shutdown: nothing is loaded or unloaded")

    def _tables(self) -> dict[str, ModelSpec]:
        """The [[models]] tables by name: the config file's, read again now; without a config file, the
        models served from the start. LoadFailed if the file cannot be read or holds invalid tables."""
        path = self.settings.config
        if path is None:
            return self._start_tables
        try:
            tables = configured_models(path)
        except SettingsError as exc:
            raise LoadFailed(f"config file {path}: {'; '.join(exc.problems)}") from None
        self._configured = {spec.name for spec in tables}
        return {spec.name: spec for spec in tables}

    def _table(self, name: str, config: str | None) -> ModelSpec:
        """The table a load of `name` applies: its config parameter, else the config file's, else (no
        config file) the one it was served with. LoadFailed for a name no table names."""
        tables = self._tables()
        table = tables.get(name)
        if table is None:
            path = self.settings.config
            if path is not None:
                where = f"no [[models]] table of the config file {path} names it"
                how = "add a [[models]] table to the config file, then load it or send SIGHUP"
            else:
                where = f"the server was started without a config file and serves {', '.join(sorted(tables))} only"
                how = "start it with a config file whose [[models]] tables name the models to serve"
            raise LoadFailed(
                f"no model {name[:100]!r} to load: {where}; a load serves only the models the configuration "
                f"names, as Triton loads only what its model repository holds ({how})"
            )
        if config is not None:
            return spec_from_config(name, config, self.settings.repository())
        if self.settings.config is None:
            known = self._registry.models.get(name) or self._registry.unloaded.get(name)
            if known is not None:  # a config parameter's table, if a load gave one
                return known.spec
        return table

    async def _load(self, spec: ModelSpec) -> dict[str, Any]:
        try:
            source = identify(spec)  # the origin's check: a missing file is refused before any worker hears of it
        except LoadFailed:
            self.count_refused_load(spec.name)
            raise
        # A worker that fails counts the failure itself, under the label decided here.
        args = {
            "spec": spec.model_dump(mode="json"),
            "source": None if source is None else source.as_args(),
            "counted_as": self.counted_as(spec.name),
        }
        # Shielded: a client that hangs up does not cut a load short halfway through building its copy.
        replies = await asyncio.shield(
            self._control.broadcast(LOAD_MODEL, args, sticky=model_key(spec.name), timeout_s=LOAD_TIMEOUT_S)
        )
        return _outcome(spec.name, "load", replies)


def _outcome(name: str, what: str, replies: list[Reply]) -> dict[str, Any]:
    """Every process's reply as one answer; LoadFailed if any failed, naming each one and why."""
    if not replies:  # every process that would apply it was gone by the time the supervisor sent it
        raise Unavailable(f"the {what} of model {name[:100]!r} reached no serving process; try again")
    failed = [reply for reply in replies if not reply.ok]
    if failed:
        errors = list(dict.fromkeys(reply.error for reply in failed))
        if len(failed) == len(replies) and len(errors) == 1:
            raise LoadFailed(errors[0])
        done = [reply.worker for reply in replies if reply.ok]
        told = "; ".join(f"worker {reply.worker}: {reply.error}" for reply in failed)
        raise LoadFailed(
            f"{what} of model {name[:100]!r} failed in {len(failed)} of {len(replies)} workers: {told}"
            + (f" (workers {', '.join(map(str, done))} applied it)" if done else "")
        )
    workers = [{"worker": reply.worker, **reply.result} for reply in replies]
    return {"name": name, "version": workers[0]["version"], "workers": workers}
