"""The sockets a serving process is given, and the start-up lines that say where it listens.

Apart from app/process/server.py, which imports torch and the web stack, so that the supervisor of worker
processes (app/process/supervisor.py), which only holds the sockets and watches the workers, never loads
them: it starts a second sooner and holds some 40 MiB instead of 250.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

from app.config.settings import Settings

log = logging.getLogger("ffn_serve")

# uvicorn waits this long for open connections once the batchers have drained.
CONNECTION_CLOSE_GRACE_S = 3


@dataclass
class Listeners:
    """The bound sockets: the service's port, the metrics port when one is set, the gRPC port's hold.

    `all()` are uvicorn's. `grpc` never listens: it holds the gRPC port for the grpc servers of
    the serving processes, which bind it themselves (app/grpc/ports.py).
    """

    main: socket.socket
    metrics: socket.socket | None = None
    grpc: socket.socket | None = None

    def all(self) -> list[socket.socket]:
        return [self.main] if self.metrics is None else [self.main, self.metrics]

    def close(self) -> None:
        for sock in self.all():
            sock.close()
        if self.grpc is not None:
            self.grpc.close()

    def metrics_port(self) -> int | None:
        """The metrics socket's port number (the one the system picked, when 0 was asked for)."""
        return None if self.metrics is None else int(self.metrics.getsockname()[1])


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
    if settings.shared_engine:  # one budget for the whole tree: the engine holds only the slots the fronts hand it
        log.info(
            "each front holds at most %s, and as much in its hand-off memory (max_held_bytes %s split between %d front%s)",
            _mib(settings.held_bytes_per_process),
            _mib(settings.max_held_bytes),
            settings.workers,
            "" if settings.workers == 1 else "s",
        )
    tls = settings.tls_cert_file is not None
    if tls:
        mutual = "mutual TLS: client certificates signed by " + str(settings.tls_client_ca_file)
        log.info(
            "TLS on both doors (%s)", mutual if settings.tls_client_ca_file is not None else "no client certificates"
        )
    http = "https" if tls else "http"
    log.info("listening on %s", _address(listeners.main, http))
    if listeners.grpc is not None:
        log.info(
            "gRPC (inference.GRPCInferenceService, grpc.health.v1, reflection) on %s%s",
            _address(listeners.grpc, "grpc"),
            " over TLS" if tls else "",
        )
    if listeners.metrics is not None:
        log.info("metrics on %s/metrics, without the API key", _address(listeners.metrics, http))


def _address(sock: socket.socket, scheme: str = "http") -> str:
    host, port = sock.getsockname()[:2]
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"


def _mib(size: int) -> str:
    return f"{size / 2**20:,.0f} MiB" if size >= 2**20 else f"{size:,} bytes"
