"""What ffn-serve checks before it imports torch: its ports can be bound, its weights files read, and
with shared_engine, the host has the memory the hand-off's slots reserve.

torch alone takes seconds to import (a minute on a loaded machine), and the models longer to
load: a port in use or a weights file that is missing was reported only after both. Checked
here first, each is one line in a fraction of a second, with the exit code it always had (3 for
a port, 1 for a model). What needs torch (a file's contents, a device) is checked as the models
load (app/engine/registry.py).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat

from app.grpc.ports import reserve
from app.listeners import Listeners
from app.settings import GRPC_PORT_FIX, Settings

log = logging.getLogger("ffn_serve")

ANOTHER_SERVER = "another ffn-serve may be running there"
# A file that is not a regular one, as ffn_core/readers.py names it (it imports torch: not here).
_FILE_TYPES = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


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


def listeners(settings: Settings) -> Listeners | None:
    """Every port of the service bound (the gRPC port held), or None with one error line saying which and why."""
    main = _bind_or_none(settings.host, settings.port, "--port N (FFN_PORT)")
    if main is None:
        return None
    bound = Listeners(main)
    if settings.metrics_port is not None:
        metrics = _bind_or_none(settings.host, settings.metrics_port, "--metrics-port N (FFN_METRICS_PORT)")
        if metrics is None:
            bound.close()
            return None
        bound.metrics = metrics
    if settings.grpc:
        try:
            bound.grpc = reserve(settings.host, settings.grpc_port)
        except OSError as exc:
            way_out = f": {ANOTHER_SERVER}; {GRPC_PORT_FIX}" if exc.errno == errno.EADDRINUSE else ""
            log.error("cannot listen on %s:%d (gRPC): %s%s", settings.host, settings.grpc_port, _reason(exc), way_out)
            bound.close()
            return None
    return bound


def unreadable_weights(settings: Settings) -> list[str]:
    """One line per configured model whose weights file is missing, not a regular file, or not readable."""
    problems = []
    for spec in settings.served_models():
        if spec.weights is not None and (why := _unreadable(str(spec.weights))) is not None:
            problems.append(f"model {spec.name!r}: cannot load {spec.weights}: {why}")
    return problems


def _bind_or_none(host: str, port: int, flag: str) -> socket.socket | None:
    try:
        return bind(host, port)
    except OSError as exc:
        way_out = f": {ANOTHER_SERVER}; stop it, or choose another port with {flag}"
        log.error(
            "cannot listen on %s:%d: %s%s", host, port, _reason(exc), way_out if exc.errno == errno.EADDRINUSE else ""
        )
        return None


def _unreadable(path: str) -> str | None:
    """Why the file at `path` cannot be read as weights, or None. Never opens what is not a regular file
    (a FIFO would block the start)."""
    try:
        info = os.stat(path)
    except OSError as exc:
        return _reason(exc)
    if not stat.S_ISREG(info.st_mode):
        kind = next((name for is_type, name in _FILE_TYPES if is_type(info.st_mode)), "a special file")
        return f"it is {kind}, not a regular file"
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
    except OSError as exc:
        return _reason(exc)
    return None


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def handoff_shortage(settings: Settings) -> str | None:
    """shared_engine: why the memory every front reserves for its slots in every engine is not there
    (one line naming the size and how to raise it), or None. Each front reserves its own at its start too."""
    if not settings.shared_engine:
        return None
    from app.handoff.arena import Arena
    from app.handoff.front import SLOT_BYTES
    from app.handoff.memory import shortage

    engines = max(1, len(settings.devices))
    block = Arena.size_of(settings.handoff_slots, SLOT_BYTES)
    what = (
        f"the hand-off's slots ({settings.workers} front{'s' if settings.workers > 1 else ''} x {engines} engine process{'es' if engines > 1 else ''} x "
        f"{settings.handoff_slots:,} slots of {SLOT_BYTES >> 20} MiB)"
    )
    return shortage(settings.workers * engines * block, what)
