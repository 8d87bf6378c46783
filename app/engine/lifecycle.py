"""Lifecycle: load, reload and unload a model in this process while it serves.

The Engine broadcasts LOAD_MODEL and UNLOAD_MODEL (app/control.py) and every serving process
applies them here; commands for one model apply in order, for different models concurrently.

A load builds a new copy beside the one serving: read the file into host memory, place the
weights on the device, start its batcher and warm it up. On the CPU all three run on a thread of
the load's own at a lower priority (nice +10), so that the serving copy's batches neither wait
behind them nor lose their cores to them; on CUDA placing and warming run on the device's thread,
as at start (graph capture must meet no other work on the device). Only then is the registry's entry swapped, in
one step on the event loop: requests looked up from then on go to the new copy, those admitted
before finish on the old one, which then stops and lets its memory go. The model stays READY
throughout. A failure at any step (a missing or replaced file, wrong shapes, NaN weights, a
d_model other than the served copy's, out of memory) leaves the old copy serving, and the error
names the file and why. An unload turns the model UNAVAILABLE ("unloaded"), finishes what it
admitted, stops it and frees it; an unload that forgets (of a name no [[models]] table names any
more: the Engine decides) then drops it from the lists and /metrics, as if it had never served.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from app.config.settings import ModelSpec
from app.control import command_number
from app.engine.batcher import OUT_OF_MEMORY
from app.engine.errors import LoadFailed, ModelNotFound, Unavailable
from app.engine.registry import Registry, ServedModel, model_digest, place, read_weights
from app.engine.repository import WeightsFile
from app.observe.metrics import OTHER_MODELS
from ffn_core import FeedForward, WeightsError

log = logging.getLogger("ffn_serve")

LOAD_MODEL, UNLOAD_MODEL = "load_model", "unload_model"
LOADER_NICENESS = 10  # the CPU work of a load yields to serving: "nice +10", as a batch job would run

T = TypeVar("T")


def model_key(name: str) -> str:
    """The control key of a model's commands: one model's loads and unloads apply in order."""
    return f"model:{name}"


@dataclass
class Timings:
    """Where a load's time went, in seconds: load-to-serving is read + build + warm_up + switch."""

    read_s: float = 0.0  # the file into host memory, checked (keys, shapes, finite)
    build_s: float = 0.0  # onto the device, fused, runner and batcher made and started
    warm_up_s: float = 0.0  # every batch-size bucket run once (CUDA graphs captured)
    switch_s: float = 0.0  # the registry's entry swapped
    retire_s: float = 0.0  # after serving: the old copy's admitted work finished, the copy stopped and freed

    @property
    def to_serving_s(self) -> float:
        return self.read_s + self.build_s + self.warm_up_s + self.switch_s


class Lifecycle:
    """This process's side of load and unload: building, swapping and retiring copies."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._settings = registry.settings
        self._metrics = registry.metrics
        # Version 1 is what a configured model serves from the start: its first load is version 2.
        self._at_start = {spec.name for spec in self._settings.served_models()}
        self._loads_counted = set(self._at_start)  # the names whose load series exist (at 0 or more)
        for name in self._at_start:
            self._metrics.loads_from_zero(name)
        self._metrics.model_loads.labels(model=OTHER_MODELS, outcome="failed")
        self._retiring: set[ServedModel] = set()
        self.closed = False  # draining: no new copy enters service
        # Called on a new copy before it serves: every copy's, and those for a name's first copy only.
        self.prepare: list[Callable[[ServedModel], None]] = []
        self.prepare_name: list[Callable[[ServedModel], None]] = []
        self._prepared_names: set[str] = set()

    def add_hook(
        self, prepare: Callable[[ServedModel], None], *, once_per_name: bool, serving: list[ServedModel]
    ) -> None:
        """Run `prepare` on the copies `serving` now, and on each later copy (a name's first only, if `once_per_name`)."""
        (self.prepare_name if once_per_name else self.prepare).append(prepare)
        for served in serving:
            if once_per_name:
                self._prepared_names.add(served.name)
            prepare(served)

    def prepared(self, served: ServedModel) -> None:
        """Run the hooks for a copy about to serve: every copy's, and a new name's."""
        for prepare in self.prepare:
            prepare(served)
        if served.name not in self._prepared_names:
            self._prepared_names.add(served.name)
            for prepare in self.prepare_name:
                prepare(served)

    async def apply_load(self, args: dict[str, Any]) -> dict[str, Any]:
        """LOAD_MODEL: {"spec": a ModelSpec as JSON, "source": a WeightsFile's args or None, "counted_as": the
        model label of a failure (Engine.counted_as)} -> version, timings."""
        spec = ModelSpec.model_validate(args["spec"])
        source = WeightsFile.from_args(args.get("source"))
        if spec.name in self._metrics.hidden:  # forgotten once, named by a table again (the Engine loads no other)
            self._metrics.remember_model(spec.name)
        version = command_number.get() + (1 if spec.name in self._at_start else 0)
        current = self._registry.models.get(spec.name)
        timings = Timings()
        try:
            served = await self._build(spec, source, version, current, timings)
        except LoadFailed as exc:
            self._metrics.model_loads.labels(model=args.get("counted_as", spec.name), outcome="failed").inc()
            keeps = f"version {current.version} keeps serving" if current else "it is not served"
            message = f"model {spec.name!r}: version {version} not loaded: {exc.message}; {keeps}"
            log.error("%s", message)
            raise LoadFailed(message) from None
        if self.closed:  # a drain began while it was built: it would only have to drain at once
            await served.retire(0)
            raise Unavailable(f"model {spec.name!r}: version {version} not loaded: the server is shutting down")
        self.prepared(served)
        started = time.perf_counter()
        previous = self._registry.serve(served)
        timings.switch_s = time.perf_counter() - started
        if spec.name not in self._loads_counted:  # a model first loaded now: its failures from 0 too
            self._loads_counted.add(spec.name)
            self._metrics.loads_from_zero(spec.name)
        self._metrics.model_loads.labels(model=spec.name, outcome="ok").inc()
        self._metrics.model_load_seconds.labels(model=spec.name).observe(timings.to_serving_s)
        log.info(
            "model %s version %d serving, digest %s (read %.3f s, build %.3f s, warm-up %.3f s)%s",
            spec.name,
            version,
            served.digest,  # whole, as X-Model-Digest and ffn_model_info show it: an operator compares them
            timings.read_s,
            timings.build_s,
            timings.warm_up_s,
            f"; version {previous.version} retiring" if previous else "",
        )
        if previous is not None:
            timings.retire_s = await self._retire(previous)
        return {"version": version, **asdict(timings)}

    async def apply_unload(self, args: dict[str, Any]) -> dict[str, Any]:
        """UNLOAD_MODEL: {"name": ..., "forget": whether no table names it any more} -> the version unloaded.

        Unloading an unloaded model is done already. With `forget`, the model then leaves the lists
        and /metrics, once its copy has finished its work (its last answers are still counted); a
        worker started later, which replays the unload, may never have served it: it forgets the name.
        """
        name, forget = args["name"], bool(args.get("forget"))
        if name in self._registry.models:
            served = self._registry.unload(name)
            log.info("model %s version %d unloaded; finishing what it admitted", name, served.version)
            result = {"version": served.version, "retire_s": await self._retire(served)}
        elif name in self._registry.unloaded:
            result = {"version": self._registry.unloaded[name].version, "retire_s": 0.0}
        elif forget:
            result = {"version": 0, "retire_s": 0.0}
        else:
            raise ModelNotFound(f"model {name[:100]!r} is not served here: nothing to unload", name=name)
        if forget:
            self._forget(name)
        return result

    def _forget(self, name: str) -> None:
        """No table names `name` any more: it leaves the lists and /metrics; a later table of that name
        starts afresh (its series made again at 0, the doors' too)."""
        self._registry.forget(name)
        self._loads_counted.discard(name)
        self._prepared_names.discard(name)
        log.info("model %s: no [[models]] table names it: it leaves the repository index and /metrics", name)

    async def stop(self) -> None:
        """Shutting down: answer 503 whatever the copies still retiring hold."""
        for served in list(self._retiring):
            await served.stop()

    # ----- building a copy -----------------------------------------------------------------

    async def _build(
        self, spec: ModelSpec, source: WeightsFile | None, version: int, current: ServedModel | None, t: Timings
    ) -> ServedModel:
        what = source.path if source is not None else "the built-in demo weights"
        try:
            device = self._registry.device_of(spec)
        except ValueError as exc:
            raise LoadFailed(str(exc)) from None
        with _loader_thread() as loader:
            # On CUDA the device's own thread places and warms up; on the CPU the load's thread does.
            on_device = self._registry.executor(device) if device.type == "cuda" else loader
            started = time.perf_counter()
            try:
                model, digest = await _run(loader, functools.partial(_read, spec, source))
            except WeightsError as exc:  # its message names the file
                raise LoadFailed(str(exc)) from None
            except (ValueError, OSError) as exc:
                raise LoadFailed(f"cannot load {what}: {exc}") from None
            except OUT_OF_MEMORY:
                raise LoadFailed(f"out of host memory reading {what}") from None
            t.read_s = time.perf_counter() - started
            if current is not None and model.config.d_model != current.d_model:
                raise LoadFailed(
                    f"{what} has d_model {model.config.d_model}, the served copy {current.d_model}: a reload keeps "
                    "d_model, so that the rows clients send still fit; unload the model first to change it"
                )
            started = time.perf_counter()
            try:
                placed = await _run(on_device, functools.partial(place, model, device, fuse=self._settings.fuse_gate))
            except OUT_OF_MEMORY:
                raise LoadFailed(_no_room(device, model, current)) from None
            del model  # on CUDA, the host copy: freed now, not after the warm-up
            served = self._registry.build(spec, placed, version=version, source=source, digest=digest)
            await served.start()
            t.build_s = time.perf_counter() - started
            started = time.perf_counter()
            try:
                await served.warm_up(self._settings.warmup, executor=on_device)
            except OUT_OF_MEMORY:
                await self._discard(served)
                raise LoadFailed(_no_room(device, placed, current)) from None
            except BaseException:
                await self._discard(served)
                raise
            t.warm_up_s = time.perf_counter() - started
        return served

    async def _discard(self, served: ServedModel) -> None:
        await served.retire(0)
        _free_cached(served.device)

    async def _retire(self, served: ServedModel) -> float:
        """Let `served` finish what it admitted, stop and free it; the seconds that took."""
        started = time.perf_counter()
        self._retiring.add(served)
        try:
            if not await served.retire(self._settings.drain_timeout_s):
                log.warning(
                    "model %s version %d: work still queued after %.1f s; answered 503",
                    served.name,
                    served.version,
                    self._settings.drain_timeout_s,
                )
        finally:
            self._retiring.discard(served)
        _free_cached(served.device)
        return time.perf_counter() - started


@contextmanager
def _loader_thread() -> Iterator[Executor]:
    """A thread for one load's CPU work, at a lower priority (Linux: a thread has its own nice value)."""

    def lower_priority() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOADER_NICENESS)
        except OSError:  # not allowed here: run at the same priority
            pass

    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ffn-load", initializer=lower_priority)
    try:
        yield executor
    finally:
        executor.shutdown(wait=False)


async def _run(executor: Executor | None, work: Callable[[], T]) -> T:
    return await asyncio.get_running_loop().run_in_executor(executor, work)


def _read(spec: ModelSpec, source: WeightsFile | None) -> tuple[FeedForward, str]:
    """The weights into host memory, from the file the load was asked for (checked before and after
    reading), and their digest, taken here on the host tensors before they are placed."""
    if source is not None:
        source.check()
    model = read_weights(spec, None if source is None else Path(source.path))  # the very file the load found
    if source is not None:
        source.check()
    return model, model_digest(spec, model)


def _no_room(device: torch.device, new: FeedForward, current: ServedModel | None) -> str:
    need = sum(p.numel() * p.element_size() for p in new.parameters()) / 2**20
    beside = f" beside the serving copy's {current.weight_bytes / 2**20:.1f} MiB" if current else ""
    return (
        f"out of memory on {device}: the new copy needs {need:.1f} MiB{beside}; "
        "unload another model, or unload this one and load it again"
    )


def _free_cached(device: torch.device) -> None:
    """Give a freed copy's device memory back to the driver, for the other processes on the GPU."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
