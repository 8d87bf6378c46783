"""create_app(settings): the FastAPI app, wired from the engine, the endpoints and the middleware."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from app import __version__
from app.control import Control
from app.engine.registry import Registry
from app.engine.service import Engine
from app.metrics import Metrics
from app.settings import Settings
from app.web import ops
from app.web.docs_assets import serve_docs_offline
from app.web.endpoints import register
from app.web.errors import install_error_handlers
from app.web.guard import GuardMiddleware, JsonCORSMiddleware
from app.web.held import HeldBytes
from app.web.native import routes as native
from app.web.openapi import document_validation_errors_as_400
from app.web.state import ServiceState
from app.web.v2 import routes as v2

ENDPOINTS = [*ops.ENDPOINTS, *native.ENDPOINTS, *v2.ENDPOINTS]


def create_app(
    settings: Settings,
    registry: Registry | None = None,
    *,
    fast_path: bool = True,
    warm_before_serving: bool = False,
    control: Control | None = None,
) -> FastAPI:
    """The service. Pass a loaded `registry` to skip loading in the lifespan (the CLI does).

    `fast_path=False` leaves every request to FastAPI's own routing (tests compare the two).
    `warm_before_serving`: the lifespan's start-up waits for the warm-up, so the server accepts
    connections only once warm (worker processes: a restarted one takes no traffic while cold).
    `control`: how commands reach every serving process (a worker's pipe); by default, this one only.
    """
    registry = registry or Registry(settings, Metrics())
    control = control or Control()
    engine = Engine(settings, registry, beat=control.heartbeat)
    state = ServiceState(settings, engine, registry.metrics, control, HeldBytes(settings.max_held_bytes))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            await control.open()  # commands that came meanwhile (a worker's replayed ones) apply first
            if warm_before_serving:
                await engine.until_warm()
            yield
        finally:
            await engine.stop()

    app = FastAPI(
        title="ffn-serve",
        version=__version__,
        summary="A transformer's position-wise feed-forward network over HTTP, micro-batched.",
        lifespan=lifespan,
        # A slash redirect would build its Location from the client's Host header; the documented
        # trailing-slash form (/v2/) is a route of its own instead.
        redirect_slashes=False,
        docs_url=None,  # FastAPI's pages load from a CDN; serve_docs_offline serves packaged copies
        redoc_url=None,
    )
    app.state.service = state
    install_error_handlers(app)
    document_validation_errors_as_400(app)
    register(app, ENDPOINTS, fast_path=fast_path)
    serve_docs_offline(app)
    api_key = settings.api_key.get_secret_value() if settings.api_key else None
    app.add_middleware(
        GuardMiddleware, api_key=api_key, max_header_bytes=settings.max_header_bytes, metrics_port=settings.metrics_port
    )
    if settings.cors_origins:  # added last, so outermost: preflights never meet the key check
        app.add_middleware(
            JsonCORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
            expose_headers=[
                "X-Shape",
                "X-Dtype",
                "Inference-Header-Content-Length",
                "X-MC-Passes",
                "X-MC-Dropout",
                "X-MC-Seed",
            ],
        )
    return app
