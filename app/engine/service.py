"""Engine: the one object the edge talks to, like TEI's router and its `Infer`. No HTTP here.

The edge looks a model up (`model`, `models`), reads its status or the server's (`readiness`),
and sends it work through the ServedModel it got (`check_serving`, `infer`, `infer_monte_carlo`);
the server process drives the lifecycle: start, warm up, drain, stop. A protocol (native, V2
over HTTP, gRPC) is a codec and routes on this facade, nothing more.

start: load (unless already loaded), start every batcher, then warm up in the background;
each model turns READY once it has run its batch-size buckets. drain: every model turns
UNAVAILABLE and the accepted work finishes. stop: answer whatever is left and release the
device threads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import torch

from app.engine.errors import ModelNotFound
from app.engine.loop_watch import LoopWatch
from app.engine.registry import Registry, ServedModel
from app.engine.status import READY, ModelState, ModelStatus
from app.settings import Settings

__all__ = ["Engine", "ServedModel"]  # the edge's whole view of the engine, with its errors and status

log = logging.getLogger("ffn_serve")


class Engine:
    """The served models, looked up by name, and their lifecycle from start to drain."""

    def __init__(self, settings: Settings, registry: Registry, beat: Callable[[], None] | None = None) -> None:
        """`beat`: called on every tick of the loop watch (a worker's heartbeat to its supervisor)."""
        self.settings = settings
        self._registry = registry
        self._started = False
        self._draining = False
        self._warm_up_task: asyncio.Task[None] | None = None
        self._loop_watch = LoopWatch(settings.max_loop_lag_s, beat)

    # ----- lookup ----------------------------------------------------------------------------

    def model(self, name: str, version: str | None = None) -> ServedModel:
        """The model served as `name` (and `version`, where a path names one); ModelNotFound (404) if none."""
        served = self._registry.models.get(name)
        if served is None:
            raise ModelNotFound(f"model {name[:100]!r} is not served here; GET /v1/models lists the models")
        if version is not None and version != str(served.version):
            raise ModelNotFound(
                f"model {name[:100]!r} has no version {version[:32]!r}; the version served is {served.version}"
            )
        return served

    def models(self) -> list[ServedModel]:
        return list(self._registry.models.values())

    # ----- status ----------------------------------------------------------------------------

    def readiness(self) -> ModelStatus:
        """The server's status: READY when every model is; otherwise the first reason why not."""
        if self._draining:
            return ModelStatus(ModelState.UNAVAILABLE, "draining before shutdown")
        models = self.models()
        if not self._started or not models:
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

    # ----- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Load if needed and start the batchers; warm-up runs in the background (live before ready)."""
        if self.settings.torch_threads:
            torch.set_num_threads(self.settings.torch_threads)
        self._loop_watch.start()
        if not self._registry.models:
            await asyncio.to_thread(self._registry.load)
        for served in self.models():
            await served.start()
        self._warm_up_task = asyncio.create_task(self._warm_up(), name="warm-up")
        self._started = True

    async def until_warm(self) -> None:
        """Wait for the warm-up that start() began; a worker process accepts no connection before it ends."""
        if self._warm_up_task is not None:
            await asyncio.shield(self._warm_up_task)

    async def drain(self) -> bool:
        """Stop taking work (readiness and new requests turn 503), then finish what was accepted.

        True if everything accepted was answered within the drain timeout.
        """
        self._draining = True
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
        self._registry.shutdown_executors()

    async def _warm_up(self) -> None:
        for served in self.models():
            await served.warm_up(self.settings.warmup)
        log.info("ready: %s", ", ".join(self._registry.models))
