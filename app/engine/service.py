"""Engine: the served models' lifecycle, from start to drain. No HTTP here.

start: load (unless already loaded), start every batcher, then warm up in the background;
the engine is ready once every model has run its batch-size buckets. drain: refuse new work,
finish what was accepted. stop: answer whatever is left and release the device threads.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from app.engine.errors import Unavailable
from app.engine.registry import Registry, ServedModel
from app.settings import Settings

log = logging.getLogger("ffn_serve")


class Engine:
    """The registry of served models, and whether they take work: started, warm, draining."""

    def __init__(self, settings: Settings, registry: Registry) -> None:
        self.settings = settings
        self.registry = registry
        self.started = False
        self.draining = False
        self._warm_up_task: asyncio.Task[None] | None = None

    @property
    def ready(self) -> bool:
        return self.started and not self.draining and self.registry.ready

    def check_serving(self, served: ServedModel) -> None:
        """Refuse new work while draining or before the model is warm."""
        if self.draining:
            raise Unavailable("the server is draining before shutdown")
        if not served.warm:
            raise Unavailable(f"model {served.name!r} is still warming up")

    async def start(self) -> None:
        """Load if needed and start the batchers; warm-up runs in the background (live before ready)."""
        if self.settings.torch_threads:
            torch.set_num_threads(self.settings.torch_threads)
        if not self.registry.models:
            await asyncio.to_thread(self.registry.load)
        for served in self.registry.models.values():
            await served.batcher.start()
            served.monte_carlo.start()
        self._warm_up_task = asyncio.create_task(self._warm_up(), name="warm-up")
        self.started = True

    async def until_warm(self) -> None:
        """Wait for the warm-up that start() began; a worker process accepts no connection before it ends."""
        if self._warm_up_task is not None:
            await asyncio.shield(self._warm_up_task)

    async def stop(self) -> None:
        """Stop warming up, answer every pending entry 503 and release the device threads."""
        if self._warm_up_task is not None:
            self._warm_up_task.cancel()
        for served in self.registry.models.values():
            await served.batcher.stop()
            served.monte_carlo.stop()
        self.registry.shutdown_executors()

    async def drain(self) -> bool:
        """Stop taking work (ready and new requests turn 503), then finish what was accepted.

        True if everything accepted was answered within the drain timeout.
        """
        self.draining = True
        timeout = self.settings.drain_timeout_s
        models = list(self.registry.models.values())
        finished = await asyncio.gather(
            *(m.batcher.drain(timeout) for m in models), *(m.monte_carlo.drain(timeout) for m in models)
        )
        if not all(finished):
            # Out of time: answer what is left 503 now, while its clients are still connected
            # (after uvicorn's own grace period their requests would be cancelled instead).
            for served in models:
                await served.batcher.stop()
                served.monte_carlo.stop()
        return all(finished)

    async def _warm_up(self) -> None:
        loop = asyncio.get_running_loop()
        for served in self.registry.models.values():
            if self.settings.warmup:
                executor = self.registry.executors[str(served.runner.device)]
                sizes = await loop.run_in_executor(executor, served.runner.warm_up)
                log.info("model %s warm at batch sizes %s", served.name, sizes)
            served.warm = True
        log.info("ready: %s", ", ".join(self.registry.models))
