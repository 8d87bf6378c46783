"""One serving process: load the models, run the app on the listening sockets, drain on SIGTERM.

The same code runs the whole service (`workers = 1`) and each of the supervisor's workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType

import uvicorn

from app.control import Control
from app.descriptors import fit_connection_cap
from app.engine.registry import ModelLoadError, Registry
from app.engine.service import Engine
from app.exits import EXIT_CANNOT_BIND, EXIT_OK, EXIT_START_FAILED
from app.main import create_app
from app.metrics import Metrics
from app.settings import Settings
from app.web.protocol import uvicorn_options

log = logging.getLogger("ffn_serve")

# uvicorn waits this long for open connections once the batchers have drained.
CONNECTION_CLOSE_GRACE_S = 3
BACKLOG = 2048  # uvicorn's default


@dataclass
class Listeners:
    """The bound sockets: the service's port, and the metrics port when one is set."""

    main: socket.socket
    metrics: socket.socket | None = None

    def all(self) -> list[socket.socket]:
        return [self.main] if self.metrics is None else [self.main, self.metrics]

    def close(self) -> None:
        for sock in self.all():
            sock.close()

    def metrics_port(self) -> int | None:
        """The metrics socket's port number (the one the system picked, when 0 was asked for)."""
        return None if self.metrics is None else int(self.metrics.getsockname()[1])


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains the batchers before shutting down.

    While draining the socket stays open: readiness answers 503 (so load balancers and
    Kubernetes take the pod out), new work gets 503, and every accepted request is answered.
    A second signal exits at once. SIGHUP drains like SIGTERM (uvicorn would leave it to the
    default action, an exit without a drain), until the service gives it a meaning of its own.
    `on_started` is called once the sockets accept connections.
    """

    def __init__(self, config: uvicorn.Config, engine: Engine, on_started: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self._engine = engine
        self._on_started = on_started
        self._drain_task: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            with super().capture_signals():
                yield
            return
        previous = signal.signal(signal.SIGHUP, self.handle_exit)
        try:
            with super().capture_signals():
                yield
        finally:
            signal.signal(signal.SIGHUP, previous)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit and self._on_started is not None:
            self._on_started()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or not self.started:
            super().handle_exit(sig, frame)  # second signal, or still starting: uvicorn's own way
            return
        log.info(
            "received %s: draining (up to %.1f s)", signal.Signals(sig).name, self._engine.settings.drain_timeout_s
        )
        self._drain_task = asyncio.get_event_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        finished = await self._engine.drain()
        if not finished:
            log.warning("drain timeout reached with work still queued; answering it 503")
        await asyncio.sleep(0.05)  # let the last answers reach their sockets
        self.should_exit = True


def serve_here(
    settings: Settings,
    listeners: Listeners,
    metrics: Metrics,
    on_ready: Callable[[], None] | None = None,
    control: Control | None = None,
) -> int:
    """Load the models and serve on `listeners` until drained; the process's exit code.

    Alone (`on_ready` None): listen once loaded, and warm up while live but not yet ready.
    As a worker: accept nothing until warm (the port already serves through the other workers),
    then call `on_ready`. `control`: the worker's link to the others (app/control.py).
    """
    registry = Registry(settings, metrics)
    try:
        registry.load()
    except ModelLoadError as exc:
        log.error("%s", exc)
        return EXIT_START_FAILED
    if on_ready is None:
        try:
            for sock in listeners.all():
                sock.listen(BACKLOG)  # only now: a client that came early was refused, not left hanging
        except OSError as exc:  # another process bound the same port meanwhile and listens first
            log.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc.strerror or exc)
            return EXIT_CANNOT_BIND
        log_start(settings, listeners)
    settings = settings.model_copy(
        update={
            "metrics_port": listeners.metrics_port(),
            "max_connections": fit_connection_cap(settings.max_connections),
        }
    )
    app = create_app(settings, registry, warm_before_serving=on_ready is not None, control=control)
    config = uvicorn.Config(
        app,
        log_config=None,
        log_level=settings.log_level,
        access_log=settings.access_log,
        timeout_graceful_shutdown=CONNECTION_CLOSE_GRACE_S,
        loop="auto",
        server_header=False,
        proxy_headers=False,
        backlog=BACKLOG,
        **uvicorn_options(settings),
    )
    server = DrainingServer(config, app.state.service.engine, on_started=on_ready)
    # Everything loaded so far (torch, the app, the weights: some 200,000 objects) lives as long
    # as the process. Frozen, the garbage collector's full passes skip it: unfrozen, each one
    # paused the event loop for over 100 ms every second or two under load (docs/benchmarks.md).
    gc.collect()
    gc.freeze()
    try:
        server.run(sockets=listeners.all())
    except SystemExit as exc:  # uvicorn's way out when the app's start-up (its lifespan) failed
        if exc.code:
            return EXIT_START_FAILED
    return EXIT_OK if server.started else EXIT_START_FAILED


def log_start(settings: Settings, listeners: Listeners) -> None:
    """Log the settings that differ from defaults, whether auth is on, and where it listens."""
    changed = {
        name: ("***" if name == "api_key" else value)
        for name, value in settings.model_dump(exclude={"models"}).items()
        if name in settings.model_fields_set
        and value != Settings.model_fields[name].get_default(call_default_factory=True)
    }
    log.info("settings changed from defaults: %s", ", ".join(f"{k}={v}" for k, v in changed.items()) or "none")
    log.info("auth %s", "on (Bearer API key)" if settings.api_key else "off: no API key set")
    log.info("listening on %s", _address(listeners.main))
    if listeners.metrics is not None:
        log.info("metrics on %s/metrics, without the API key", _address(listeners.metrics))


def _address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"
