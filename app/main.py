"""The service and its HTTP app: build_service (what both doors are given), http_app (FastAPI's), create_app (both).

`build_service` makes the protocol-neutral ServiceState (the engine, budgets, metrics, tracing and
the commands every process obeys); the HTTP app and the gRPC server (app/grpc/server.py) are each
handed it, so neither door reads the other's objects. `http_app` wires the FastAPI app around a
state: its lifespan (which starts and stops the engine), the endpoints and the middleware.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from app import __version__
from app.config.settings import Settings
from app.config.tracing import traces_export
from app.control import Control
from app.engine.facade import ServingEngine
from app.http import ops
from app.http.docs_assets import serve_docs_offline
from app.http.edge import Edge, GuardMiddleware, JsonCORSMiddleware, protocol_of, route_templates
from app.http.endpoints import ServiceApp, register
from app.http.errors import install_error_handlers
from app.http.kserve_v1 import routes as kserve_v1
from app.http.native import routes as native
from app.http.openapi import document_validation_errors_as_400
from app.http.transport import lean
from app.http.v2 import routes as v2
from app.observe.metrics import Metrics
from app.observe.triton_metrics import TritonNames
from app.protocol.admission import HeldBytes
from app.protocol.shared_memory import SharedMemoryRegions
from app.protocol.state import ServiceState
from app.protocol.v2 import log_settings, system_shared_memory, trace_extension
from app.tracing import TraceSettings, start_tracing

if TYPE_CHECKING:
    from app.engine.registry import Registry

ENDPOINTS = [*ops.ENDPOINTS, *native.ENDPOINTS, *v2.ENDPOINTS, *kserve_v1.ENDPOINTS]


def create_app(
    settings: Settings,
    registry: Registry | None = None,
    *,
    fast_path: bool = True,
    warm_before_serving: bool = False,
    control: Control | None = None,
    engine: tuple[ServingEngine, Metrics] | None = None,
) -> ServiceApp:
    """The service's HTTP app on a state of its own (build_service's arguments, then http_app's)."""
    state = build_service(settings, registry, control=control, engine=engine)
    return http_app(state, fast_path=fast_path, warm_before_serving=warm_before_serving)


def build_service(
    settings: Settings,
    registry: Registry | None = None,
    *,
    control: Control | None = None,
    engine: tuple[ServingEngine, Metrics] | None = None,
) -> ServiceState:
    """What both doors are given. Pass a loaded `registry` to skip loading at start (the CLI does).

    `control`: how commands reach every serving process (a worker's pipe); by default, this one only.
    `engine`: the engine and this process's metrics, where the models are not this process's (a
    front's RemoteEngine); by default an Engine of `registry`'s models, in this process.
    """
    control = control or Control()
    arrivals = None
    if engine is None:
        # torch and the models: imported here, so that a front (engine given) never imports them.
        from app.engine.registry import Registry
        from app.engine.service import Engine

        registry = registry or Registry(settings, Metrics())
        engine = Engine(settings, registry, control, beat=control.heartbeat), registry.metrics
        arrivals = registry.arrivals
    served, metrics = engine
    export = traces_export(settings.otlp_endpoint, os.environ)
    trace_settings = TraceSettings(tracing=export is not None)
    tracing = start_tracing(export, trace_settings)
    regions = SharedMemoryRegions() if settings.shared_memory else None
    held = HeldBytes(settings.held_bytes_per_process)
    metrics.gpus = served.gpus  # its own, or its engines' (a front)
    if settings.triton_metrics:  # the models served now, each at its version, whichever loads happened
        metrics.triton = TritonNames(
            versions=lambda: {model.name: model.version for model in served.models()}, gpus=served.gpus
        )
    state = ServiceState(
        settings,
        served,
        metrics,
        control,
        held,
        trace_settings,
        tracing=tracing,
        shared_memory=regions,
        arrivals=arrivals,
    )
    control.register(trace_extension.COMMAND, trace_extension.apply_command(state))
    control.register(log_settings.COMMAND, log_settings.apply_command)
    if regions is not None:
        for command, handler in system_shared_memory.control_handlers(regions).items():
            control.register(command, handler)
    return state


def http_app(state: ServiceState, *, fast_path: bool = True, warm_before_serving: bool = False) -> ServiceApp:
    """FastAPI's app around `state`; its lifespan starts the engine and stops it, and what the state holds.

    `fast_path=False` leaves every request to FastAPI's own routing (tests compare the two).
    `warm_before_serving`: the lifespan's start-up waits for the warm-up, so the server accepts
    connections only once warm (worker processes: a restarted one takes no traffic while cold).
    """
    settings, served, control, tracing, regions = (
        state.settings,
        state.engine,
        state.control,
        state.tracing,
        state.shared_memory,
    )

    @asynccontextmanager
    async def lifespan(app: ServiceApp) -> AsyncIterator[None]:
        await served.start()

        # The copies loaded now, and each that a load puts in service later: a name's series from zero,
        # each copy's batches traced (where the batches are this process's).
        served.on_serving(lambda model: state.outcomes.count_from_zero(model.name), once_per_name=True)
        if tracing is not None and served.batches_here:
            served.on_serving(tracing.observe)
        try:
            await control.open()  # commands that came meanwhile (a worker's replayed ones) apply first
            if warm_before_serving:
                await served.until_warm()
            yield
        finally:
            await served.stop()
            if tracing is not None:
                await tracing.shutdown()  # what is still collected is sent now
            if regions is not None:
                regions.close_all()

    app = ServiceApp(
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
    register(app, ENDPOINTS, fast_path=fast_path, tracing=tracing)
    serve_docs_offline(app)
    api_key = settings.api_key.get_secret_value() if settings.api_key else None
    app.add_edge_middleware(
        GuardMiddleware, api_key=api_key, max_header_bytes=settings.max_header_bytes, metrics_port=settings.metrics_port
    )
    if settings.cors_origins:  # added last, so outermost: preflights never meet the key check
        app.add_edge_middleware(
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
                "X-Request-Id",
                "X-Model-Digest",
                "traceparent",
                "tracestate",
            ],
        )
    # Outermost, in front of FastAPI's stack and Starlette's error middleware in it: every answer,
    # an unexpected 500's included, carries the request's id, and the whole request is timed, the
    # guard's and CORS's answers included (app/http/edge.py).
    hot = [endpoint.path for endpoint in ENDPOINTS if endpoint.fast]
    app.add_edge_middleware(Edge, histogram=state.metrics.http_request_seconds, routes=route_templates(app.routes, hot))
    if fast_path and settings.lean_path and tracing is None:
        # Read by our HTTP protocol (app/http/transport/protocol.py): plain tensor requests are served
        # below ASGI (app/http/transport/lean.py). A traced server's requests all go through the app.
        app.lean_door = lean.LeanDoor(
            state,
            api_key=api_key,
            metrics_port=settings.metrics_port,
            cors=bool(settings.cors_origins),
            histogram=state.metrics.http_request_seconds,
            protocols={route: protocol_of(route) for route in lean.ROUTES},
        )
    return app
