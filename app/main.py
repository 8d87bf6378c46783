"""create_app(settings): the FastAPI app, its lifespan (load, warm up, start and stop batchers)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from app.errors import install_error_handlers
from app.fastpath import FastPath
from app.guard import GuardMiddleware
from app.metrics import Metrics
from app.registry import Registry
from app.routes import health, native, v2
from app.settings import Settings
from app.state import ServiceState

log = logging.getLogger("ffn_serve")


def create_app(settings: Settings, registry: Registry | None = None) -> FastAPI:
    """The service. Pass a loaded `registry` to skip loading in the lifespan (the CLI does)."""
    metrics = registry.metrics if registry is not None else Metrics()
    state = ServiceState(settings, registry or Registry(settings, metrics), metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        if not state.registry.models:
            await asyncio.to_thread(state.registry.load)
        for served in state.registry.models.values():
            await served.batcher.start()
        # Live answers at once; ready only once every model has run its batch-size buckets.
        warm = asyncio.create_task(_warm_up(state), name="warm-up")
        state.started = True
        try:
            yield
        finally:
            warm.cancel()
            for served in state.registry.models.values():
                await served.batcher.stop()
            state.registry.shutdown_executors()

    app = FastAPI(
        title="ffn-serve",
        version="0.1.0",
        summary="A transformer's position-wise feed-forward network over HTTP, micro-batched.",
        lifespan=lifespan,
    )
    app.state.service = state
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(health.metrics_router)
    app.include_router(native.router)
    app.include_router(v2.router)
    app.add_middleware(FastPath, routes=[
        (r"/v1/models/(?P<name>[^/]+)/transform", native.transform),
        (r"/v2/models/(?P<name>[^/]+)/infer", v2.infer),
        (r"/v2/models/(?P<name>[^/]+)/versions/(?P<version>[^/]+)/infer", v2.infer_version),
    ])
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["*"], expose_headers=["X-Shape", "X-Dtype", "Inference-Header-Content-Length"])
    api_key = settings.api_key.get_secret_value() if settings.api_key else None
    app.add_middleware(GuardMiddleware, api_key=api_key)
    return app


async def _warm_up(state: ServiceState) -> None:
    loop = asyncio.get_running_loop()
    for served in state.registry.models.values():
        executor = state.registry.executors[str(served.runner.device)]
        if state.settings.warmup:
            sizes = await loop.run_in_executor(executor, served.runner.warm_up, state.settings.max_batch_rows)
            log.info("model %s warm at batch sizes %s", served.name, sizes)
        served.warm = True
    log.info("ready: %s", ", ".join(state.registry.models))


async def drain(state: ServiceState) -> bool:
    """Stop taking work (ready and new requests turn 503), then finish what was accepted."""
    state.draining = True
    timeout = state.settings.drain_timeout_s
    results = await asyncio.gather(*(m.batcher.drain(timeout) for m in state.registry.models.values()))
    if not all(results):
        # Out of time: answer what is left 503 now, while its clients are still connected
        # (after uvicorn's own grace period their requests would be cancelled: a 500).
        for served in state.registry.models.values():
            await served.batcher.stop()
    return all(results)
