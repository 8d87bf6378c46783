"""ffn-serve: read the settings, bind the address, load the models, then serve until SIGTERM drains it.

Exit codes: 0 stopped cleanly (drained); 1 a model could not be loaded, or the server failed
while starting; 2 invalid settings or command line; 3 the address cannot be bound (the port is
in use, or not allowed).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from types import FrameType

import torch
import uvicorn
from pydantic import ValidationError

from app import __version__
from app.engine.registry import ModelLoadError, Registry
from app.engine.service import Engine
from app.logs import configure_logging
from app.main import create_app
from app.metrics import Metrics
from app.settings import ConfigFileError, Settings, command_line, load_settings, misspelt_variables
from app.web.protocol import uvicorn_options

log = logging.getLogger("ffn_serve")

EXIT_OK, EXIT_START_FAILED, EXIT_BAD_SETTINGS, EXIT_CANNOT_BIND = 0, 1, 2, 3
# uvicorn waits this long for open connections once the batchers have drained.
CONNECTION_CLOSE_GRACE_S = 3
BACKLOG = 2048  # uvicorn's default


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains the batchers before shutting down.

    While draining the socket stays open: readiness answers 503 (so load balancers and
    Kubernetes take the pod out), new work gets 503, and every accepted request is answered.
    A second signal exits at once.
    """

    def __init__(self, config: uvicorn.Config, engine: Engine) -> None:
        super().__init__(config)
        self._engine = engine
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or not self.started:
            super().handle_exit(sig, frame)  # second signal, or still starting: uvicorn's own way
            return
        log.info("received %s: draining (up to %.1f s)", signal.Signals(sig).name, self._engine.settings.drain_timeout_s)
        self._drain_task = asyncio.get_event_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        finished = await self._engine.drain()
        if not finished:
            log.warning("drain timeout reached with work still queued; answering it 503")
        await asyncio.sleep(0.05)  # let the last answers reach their sockets
        self.should_exit = True


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = load_settings(**command_line(sys.argv[1:] if argv is None else argv))
    except (ConfigFileError, ValidationError) as exc:
        print(f"ffn-serve: invalid settings: {exc}", file=sys.stderr)
        return EXIT_BAD_SETTINGS
    configure_logging(settings.log_level, settings.log_format)
    for warning in misspelt_variables():
        log.warning(warning)
    return serve(settings)


def serve(settings: Settings) -> int:
    log.info("ffn-serve %s, torch %s, CUDA %s, %s", __version__, torch.__version__,
             torch.version.cuda or "none", _devices())
    try:
        # Bound before the models load: a port in use is reported at once, not after a long load.
        sock = bind(settings.host, settings.port)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc.strerror or exc)
        return EXIT_CANNOT_BIND
    registry = Registry(settings, Metrics())
    try:
        registry.load()
    except ModelLoadError as exc:
        log.error("%s", exc)
        sock.close()
        return EXIT_START_FAILED
    try:
        sock.listen(BACKLOG)  # only now: a client that came early was refused, not left hanging
    except OSError as exc:  # another process bound the same port meanwhile and listens first
        log.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc.strerror or exc)
        return EXIT_CANNOT_BIND
    _log_settings(settings, sock)
    app = create_app(settings, registry)
    config = uvicorn.Config(
        app, log_config=None, log_level=settings.log_level, access_log=settings.access_log,
        timeout_graceful_shutdown=CONNECTION_CLOSE_GRACE_S, loop="auto",
        server_header=False, proxy_headers=False, **uvicorn_options(settings),
    )
    server = DrainingServer(config, app.state.service.engine)
    server.run(sockets=[sock])
    return EXIT_OK if server.started else EXIT_START_FAILED


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, not yet listening; uvicorn listens on it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _devices() -> str:
    if not torch.cuda.is_available():
        return f"CPU only ({torch.get_num_threads()} torch threads)"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return "GPUs: " + ", ".join(f"cuda:{i} {name}" for i, name in enumerate(names))


def _log_settings(settings: Settings, sock: socket.socket) -> None:
    changed = {
        name: ("***" if name == "api_key" else value)
        for name, value in settings.model_dump(exclude={"models"}).items()
        if name in settings.model_fields_set and value != Settings.model_fields[name].get_default(call_default_factory=True)
    }
    log.info("settings changed from defaults: %s", ", ".join(f"{k}={v}" for k, v in changed.items()) or "none")
    log.info("auth %s", "on (Bearer API key)" if settings.api_key else "off: no API key set")
    host, port = sock.getsockname()[:2]
    log.info("listening on http://%s:%d", f"[{host}]" if ":" in host else host, port)


if __name__ == "__main__":
    sys.exit(main())
