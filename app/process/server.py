"""One serving process: load the models, run the app on the listening sockets, drain on SIGTERM.

The same code runs the whole service (`workers = 1`) and each of the supervisor's workers.
SIGHUP reads the config file again and applies its [[models]] (Engine.apply_config_file); with
workers the supervisor passes it to one of them, whose loads reach them all. With TLS, SIGHUP also
reads the certificate and key again (app/config/tls.py); with workers the supervisor sends every front the
control command TLS_RELOAD for that.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import gc
import logging
import signal
import socket
import sys
import threading
from collections.abc import Awaitable, Callable, Generator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from app.config.settings import Settings
from app.config.tls import TLS_RELOAD, Rotation, TlsError, tls_files
from app.control import Control
from app.engine.facade import ServingEngine
from app.grpc.server import GrpcServer
from app.http.transport.protocol import LimitedHttpToolsProtocol, uvicorn_options
from app.main import build_service, http_app
from app.observe.metrics import Metrics
from app.process.descriptors import fit_connection_cap
from app.process.exits import EXIT_BAD_SETTINGS, EXIT_CANNOT_BIND, EXIT_OK, EXIT_START_FAILED
from app.process.listeners import CONNECTION_CLOSE_GRACE_S, Listeners, log_start
from app.process.starting import Starting, StartStopped

log = logging.getLogger("ffn_serve")

BACKLOG = 2048  # uvicorn's default


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains the batchers before shutting down, or, before
    it serves, stops the start (exit 0).

    While draining the socket stays open: readiness answers 503 (so load balancers and
    Kubernetes take the pod out), new work gets 503, and every accepted request is answered,
    each answer with `Connection: close` (app/http/transport/protocol.py): a kept-alive connection would
    be closed under the next request its client writes when the process exits.
    A second signal exits at once. SIGHUP reads the config file again (`capture_signals`).
    `on_started` is called once the sockets accept connections.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        engine: ServingEngine,
        on_started: Callable[[], None] | None = None,
        grpc_server: GrpcServer | None = None,
        tls: Rotation | None = None,
        tls_on_hang_up: bool = True,
    ) -> None:
        """`grpc_server`: the gRPC door, started once the app has (warm, in a worker) and stopped after the drain.
        `tls`: the pair both doors serve, its files watched while serving; `tls_on_hang_up`: SIGHUP reads them
        again too (a worker's come as TLS_RELOAD from the supervisor instead)."""
        super().__init__(config)
        self._tls = tls
        self._tls_on_hang_up = tls_on_hang_up
        self._engine = engine
        self._on_started = on_started
        self._grpc = grpc_server
        self._drain_task: asyncio.Task[None] | None = None
        self._stopping_start = False  # a signal came before it served
        self.exit_code = EXIT_OK
        self._serving_loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # The engine's warm-up has ended once (a worker only starts serving then; a single process
        # listens while it warms up). Before, a signal stops the start; after, it drains.
        self._warm = False

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """uvicorn's SIGTERM and SIGINT, and SIGHUP: read the config file again, while serving."""
        if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
            with super().capture_signals():
                yield
            return
        previous = signal.signal(signal.SIGHUP, self._hang_up)
        try:
            with super().capture_signals():
                yield
        finally:
            signal.signal(signal.SIGHUP, previous)

    def _hang_up(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler runs between two bytecodes of the loop's thread: hand the work to the loop,
        # in a context of its own (the interrupted code's may be a request's, whose id its lines would carry).
        loop = self._serving_loop
        if loop is not None and not self.should_exit:
            if self._tls is not None and self._tls_on_hang_up:
                loop.call_soon_threadsafe(self._tls.reload, "SIGHUP", context=contextvars.Context())
            loop.call_soon_threadsafe(self._apply_config_file, context=contextvars.Context())

    def _apply_config_file(self) -> None:
        task = asyncio.get_running_loop().create_task(self._engine.apply_config_file(), name="sighup")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._serving_loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if not self.started or self.should_exit:
            return
        if self._grpc is not None:
            try:
                await self._grpc.start()
            except RuntimeError as exc:  # grpc's way of saying it could not bind
                log.error("cannot serve gRPC: %s", exc)
                self.exit_code = EXIT_CANNOT_BIND
                self.should_exit = True
                return
        if self._tls is not None:
            self._tls.start_watching()
        warmed = asyncio.get_running_loop().create_task(self._until_warm(), name="until-warm")
        self._tasks.add(warmed)
        warmed.add_done_callback(self._tasks.discard)
        if self._on_started is not None:
            self._on_started()

    async def _until_warm(self) -> None:
        try:
            await self._engine.until_warm()
        except Exception as exc:  # the server goes on, not ready: a signal from now on drains what it holds
            log.error("the warm-up failed: %s: %s", type(exc).__name__, exc)
        self._warm = not self._stopping_start

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # The handler runs in the context of the Python code it interrupted, often a request's: its
        # lines, and the drain it starts, belong to no request.
        contextvars.Context().run(self._handle_exit, sig, frame)

    def _handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or self._stopping_start:
            super().handle_exit(sig, frame)  # a second signal: uvicorn's own way
            return
        if not self.started or not self._warm:
            # Still starting: a worker warming up before it accepts anything, or a single process that
            # listens while it warms up (it has answered probes, never a request): stop the start.
            log.info("received %s while starting: stopped before serving", signal.Signals(sig).name)
            self._stopping_start = True
            self.should_exit = True
            if self._serving_loop is not None:
                self._serving_loop.call_soon_threadsafe(self._engine.stop_starting)
            return
        log.info(
            "received %s: draining (up to %.1f s)", signal.Signals(sig).name, self._engine.settings.drain_timeout_s
        )
        self._drain_task = asyncio.get_event_loop().create_task(self._drain_then_exit())

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Stop the gRPC door, then uvicorn's shutdown, after taking in the connections waiting in the
        listening sockets' backlog.

        Closing a listening socket resets the connections the kernel completed but nobody accepted
        yet, and their clients may have written a request already. Accepted here, in the same step
        as the close, they are answered (503, `Connection: close`) like any other.
        """
        waiting = [connection for sock in sockets or [] for connection in _accept_waiting(sock)]
        for server in self.servers:
            server.close()  # at once: from here a connect is refused, and nothing is written
        loop = asyncio.get_running_loop()
        protocol = functools.partial(
            self._protocol_class(),
            config=self.config,
            server_state=self.server_state,
            app_state=self.lifespan.state,
        )
        for connection in waiting:
            await loop.connect_accepted_socket(protocol, connection)
        # The drain has finished the accepted work: gRPC calls still open (streams, health watches) get the
        # same grace as HTTP connections, and new calls are refused.
        if self._grpc is not None:
            await self._grpc.stop(0 if self.force_exit else CONNECTION_CLOSE_GRACE_S)
        if self._tls is not None:
            await self._tls.stop_watching()
        await super().shutdown(sockets)

    def _protocol_class(self) -> type[LimitedHttpToolsProtocol]:
        protocol = self.config.http_protocol_class
        assert issubclass(protocol, LimitedHttpToolsProtocol), "uvicorn_options sets the protocol. This is a bug."
        return protocol

    async def _drain_then_exit(self) -> None:
        self._protocol_class().close_connections(self.server_state.connections)
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
    starting: Starting | None = None,
    engine_sockets: Sequence[Path] = (),
) -> int:
    """Load the models and serve on `listeners` until drained; the process's exit code.

    `engine_sockets`: serve as a front of the engine processes listening there (`shared_engine`): no
    models here, no torch; the doors reach the engines through the hand-off (app/handoff/remote.py).

    Alone (`on_ready` None): listen once loaded, and warm up while live but not yet ready.
    As a worker: accept nothing until warm (the port already serves through the other workers),
    then call `on_ready`. `control`: the worker's link to the others (app/control.py).
    `starting`: the caller's SIGTERM/SIGINT guard of the start, if it began one (app/process/starting.py);
    a signal before the server serves stops the start, exit 0.
    """
    guard = starting or Starting()
    try:
        with guard:  # until uvicorn's handlers take over
            prepared = _prepare(settings, listeners, metrics, on_ready, control, engine_sockets)
    except StartStopped as stopped:
        log.info("%s: stopped before serving", stopped)
        return EXIT_OK
    if isinstance(prepared, int):
        if guard.stopped_the(prepared):
            log.info("%s: stopped before serving (what failed above, failed as the signal came)", guard.stopped)
            return EXIT_OK
        return prepared
    server = prepared
    try:
        server.run(sockets=listeners.all())
    except SystemExit as exc:  # uvicorn's way out when the app's start-up (its lifespan) failed
        if exc.code:
            return EXIT_START_FAILED
    if server.exit_code != EXIT_OK:
        return server.exit_code
    return EXIT_OK if server.started else EXIT_START_FAILED


def _prepare(
    settings: Settings,
    listeners: Listeners,
    metrics: Metrics,
    on_ready: Callable[[], None] | None,
    control: Control | None,
    engine_sockets: Sequence[Path],
) -> DrainingServer | int:
    """The models loaded and the server built around them, ready to run; or the exit code of a failed start."""
    # Until the server runs (and reads the config file again on SIGHUP), a SIGHUP must not end the start.
    signal.signal(signal.SIGHUP, _hang_up_unless_serving)
    files = tls_files(settings)
    try:
        # Checked at start by the command (app/cli.py); read here again, in each worker, as they are now.
        tls = Rotation(files) if files is not None else None
    except TlsError as exc:
        log.error("%s", exc)
        return EXIT_BAD_SETTINGS
    registry = None
    if not engine_sockets:
        # torch and the models: only in a process that computes (a front of an engine process never imports them).
        from app.engine.registry import ModelLoadError, Registry

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
    remote = None
    if engine_sockets:
        from app.handoff.front import EngineClient
        from app.handoff.memory import NoRoom
        from app.handoff.remote import RemoteEngine

        # A request larger than a slot takes one of its own size from the large area, whose pages are taken
        # only while it is in flight: room for the front's whole budget, twice (an answer may be twice its
        # rows: float16 in, float32 out).
        large = 2 * settings.held_bytes_per_process
        clients = [EngineClient(path, settings.handoff_slots, large_bytes=large) for path in engine_sockets]
        try:  # the hand-off's memory now, or one line and the start stopped: never a front that cannot get ready
            for k, client in enumerate(clients):
                client.reserve(
                    f"the hand-off's {settings.handoff_slots:,} slots" + (f" to engine process {k}" if k else "")
                )
        except NoRoom as exc:
            log.error("%s", exc)
            return EXIT_START_FAILED
        beat = control.heartbeat if control is not None else None
        remote = (RemoteEngine(clients, settings, beat), metrics)
    # One service, handed to both doors: the HTTP app and the gRPC server each get the same state.
    state = build_service(settings, registry, control=control, engine=remote)
    app = http_app(state, warm_before_serving=on_ready is not None)
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
    credentials = None
    if tls is not None:
        from app.grpc.tls import server_credentials

        # uvicorn builds its context in load(): loaded here, and its context replaced by the rotation's
        # first, whose SNI callback moves each new handshake on every HTTP socket onto the latest pair's.
        config.load()
        config.ssl = tls.context
        credentials = server_credentials(tls) if settings.grpc else None
        state.control.register(TLS_RELOAD, _reload_command(tls))
    grpc_server = GrpcServer(state, settings.host, settings.grpc_port, credentials) if settings.grpc else None
    server = DrainingServer(
        config, state.engine, on_started=on_ready, grpc_server=grpc_server, tls=tls, tls_on_hang_up=control is None
    )
    # Everything loaded so far (torch, the app, the weights: some 200,000 objects) lives as long
    # as the process. Frozen, the garbage collector's full passes skip it: unfrozen, each one
    # paused the event loop for over 100 ms every second or two under load (docs/benchmarks.md).
    gc.collect()
    gc.freeze()
    set_switch_interval(settings.gil_switch_interval_us)
    return server


def set_switch_interval(microseconds: int) -> None:
    """Let a thread that waits for the GIL ask for it after `microseconds` (Python's default: 5,000).

    The model thread needs the GIL for a moment between each of the forward pass's operators. A
    thread that waits asks the holder to let go only after a whole interval in which the GIL did
    not change hands, and its wait starts again each time the event loop lets go of it for a
    system call and takes it straight back, which a busy loop does every few microseconds (each
    socket read and write). With 5 ms, a loop kept busy (a pipelined flood of health probes, many
    clients) held a 1-row forward pass of 0.2 ms for 100 ms to 2 s; at 50 µs the model's requests
    kept their quiet latency (docs/operations.md, bench/hostile.py). Only threads that wait pay the
    interval: with the model thread idle, nothing changes.
    """
    sys.setswitchinterval(microseconds / 1e6)


def _reload_command(tls: Rotation) -> Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]:
    """TLS_RELOAD's handler: the files read again in this process; whether the new pair is served."""

    async def reload(args: dict[str, Any]) -> dict[str, Any]:
        return {"served": tls.reload(str(args.get("why", "SIGHUP")))}

    return reload


def _hang_up_unless_serving(sig: int, frame: FrameType | None) -> None:
    log.warning("SIGHUP ignored: the config file is read again only while serving")


def _accept_waiting(sock: socket.socket) -> list[socket.socket]:
    """Every connection waiting in a listening socket's backlog (it is non-blocking under asyncio)."""
    accepted: list[socket.socket] = []
    while True:
        try:
            connection, _ = sock.accept()
        except ConnectionAbortedError:  # reset by its client while it waited: nothing to answer
            continue
        except OSError:  # none waiting (EAGAIN), or the socket is closed already
            return accepted
        connection.setblocking(False)
        accepted.append(connection)
