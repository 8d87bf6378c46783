"""An engine process: the configured models, served to fronts through the hand-off's Unix socket.

    python -m app.process.engine_process SOCKET [READY_FD]  # settings as the server reads them (FFN_*)

It loads and warms the models, then listens on SOCKET, removing a socket file a dead engine left
there. Its log line "engine ready" (in the log format) says it listens, and so does a byte written
to READY_FD (a pipe of the process that started it: `launch`) before that descriptor is closed; SIGTERM or SIGINT drains the models (what was
accepted is answered) and stops it; SIGHUP reads the config file's [[models]] again and applies
what changed (the fronts get the new table). Metrics go where PROMETHEUS_MULTIPROC_DIR says, as a
worker's do, so that the fronts' /metrics and statistics read the engine's model series. This is
the process issue 30's supervisor will start once per device; until then tests and benchmarks
start it (`launch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO

from app.config.settings import Settings, load_settings
from app.config.tracing import traces_export
from app.control import Control
from app.engine.registry import ModelLoadError, Registry
from app.engine.service import Engine
from app.handoff.engine import EngineServer
from app.handoff.loop import run_on_served_loop
from app.observe.logs import configure_logging
from app.observe.metrics import Metrics
from app.process.exits import EXIT_OK, EXIT_START_FAILED
from app.process.starting import Starting, StartStopped
from app.process.supervisor import beat_until
from app.protocol.v2 import log_settings
from app.tracing import TraceSettings, start_tracing

log = logging.getLogger("ffn_serve.engine")


def launch(path: Path, env: dict[str, str], prefix: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    """Start an engine process listening on `path` with environment `env` (its FFN_* settings), and
    return once it listens; RuntimeError with what it said if it exits first. `prefix`: a command
    to run it under (taskset)."""
    ready_read, ready_write = os.pipe()
    try:
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "app.process.engine_process", str(path), str(ready_write)],
            env=env,
            stderr=subprocess.PIPE,
            pass_fds=[ready_write],
        )
    finally:
        os.close(ready_write)
    assert proc.stderr is not None
    said = bytearray()
    try:
        while True:  # the models load first; what it logs meanwhile is kept, to tell why if it exits
            readable, _, _ = select.select([ready_read, proc.stderr.fileno()], [], [])
            if ready_read in readable:
                if os.read(ready_read, 1):
                    break
                raise RuntimeError(
                    f"the engine process exited ({proc.wait(30)}) before it was ready: "
                    f"{said.decode(errors='replace')[-2000:]}"
                )
            said += os.read(proc.stderr.fileno(), 65536)
    finally:
        os.close(ready_read)
    sys.stderr.write(said.decode(errors="replace"))
    # What it logs from now on goes on to this process's stderr: a pipe nobody read would fill and stop
    # the engine at its next log line.
    threading.Thread(target=_pass_on, args=(proc.stderr,), name="engine-stderr", daemon=True).start()
    return proc


def _pass_on(stream: IO[bytes]) -> None:
    for line in stream:
        sys.stderr.write(line.decode(errors="replace"))
        sys.stderr.flush()


async def serve(
    path: Path,
    settings: Settings | None = None,
    beat: Callable[[], None] | None = None,
    on_ready: Callable[[], None] | None = None,
    control: Control | None = None,
    device: str | None = None,
) -> None:
    """Load and warm the models, listen on `path`, serve until SIGTERM or SIGINT, then drain.

    `settings`: by default as the server reads them. `beat`: each tick of the engine's loop watch
    (the supervisor's heartbeat). `on_ready`: called once it listens. `control`: the supervisor's
    pipe, whose log-settings changes (POST /v2/logging in any front) it applies too. `device`: where
    every model is computed, whatever its table says (one engine per entry of `devices`).
    """
    if settings is None:
        settings = load_settings()
        configure_logging(settings.log_level, settings.log_format)
    yield_to_fronts()
    # With the supervisor's pipe, a load or unload reaches every engine process (and is replayed to one
    # that restarts), as it reaches every worker of the plain layout.
    engine = Engine(settings, Registry(settings, Metrics(), device=device), control, beat=beat)
    # The batches' spans are the engine's: the fronts trace the requests, and send each traced
    # one's span context along (app/handoff/engine.py).
    tracing = start_tracing(traces_export(settings.otlp_endpoint, os.environ), TraceSettings(tracing=True))
    await engine.start()
    if tracing is not None:
        engine.on_serving(tracing.observe)
    if control is not None:
        control.register(log_settings.COMMAND, log_settings.apply_command)
        await control.open()  # what was replayed to a restarted engine (a load too) applies before it serves
    await engine.until_warm()
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a dead engine's socket: nobody listens on it any more
    server = EngineServer(engine, path, tracing)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    rereads: set[asyncio.Task[None]] = set()

    def reread() -> None:  # SIGHUP: the config file's [[models]] again, as a served process does
        task = loop.create_task(engine.apply_config_file(), name="sighup")
        rereads.add(task)
        task.add_done_callback(rereads.discard)

    loop.add_signal_handler(signal.SIGHUP, reread)
    log.info("engine ready: listening on %s", path)
    if on_ready is not None:
        on_ready()
    await stop.wait()
    log.info("stopping: draining the models")
    await engine.drain()
    await server.close()
    await engine.stop()
    if tracing is not None:
        await tracing.shutdown()  # what is still collected is sent now
    log.info("stopped")


def yield_to_fronts() -> None:
    """Schedule this thread, and every thread it starts from now on (the model's, torch's), as SCHED_BATCH.

    A front's frame to the engine wakes it; where they share a core (a container given one CPU,
    bench.transport's server core), the woken engine preempted the front at once, computed the
    one or two requests the frame held, and the front resumed to read the next. As SCHED_BATCH
    the engine is woken without preempting: it runs once the front waits for its clients, with
    what the front read meanwhile. At r=1, C=16 on one core its batches held 14.8 rows against
    10.6, and the tree spent some 9 % less CPU a request (docs/benchmarks.md). SCHED_BATCH takes
    no privilege and keeps the engine's fair share; where it has a core of its own, nothing
    changes. Where the platform has no such policy, the engine is scheduled as any process.
    """
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None:
        return
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError as exc:  # a sandbox that refuses it: scheduled as any process
        log.info("the engine runs with the default scheduling policy: SCHED_BATCH refused (%s)", exc.strerror or exc)


def engine_main(
    settings: Settings, conn: Connection, path: Path, replacement: bool, index: int = 0, device: str | None = None
) -> None:
    """One of the supervisor's engine processes (`shared_engine`): load, warm up, listen on `path`, say
    ready, serve until drained. Its heartbeats and readiness reach the supervisor as a worker's do.
    `index`: its slot's number, which its log lines carry; `device`: serve's."""
    os.setpgid(0, 0)  # a terminal's Ctrl-C reaches the supervisor alone, which passes one SIGTERM on
    configure_logging(settings.log_level, settings.log_format, worker=index)
    control = Control(worker=index, conn=conn)
    control.serve_pipe()  # also: when the supervisor is gone, this process drains and exits
    started = threading.Event()

    def ready() -> None:
        started.set()  # from now on the event loop beats
        control.send_ready()

    threading.Thread(target=beat_until, args=(control, started), name="starting-heartbeat", daemon=True).start()
    if replacement:
        log.warning("engine process restarted: the fronts link to it again")
    with Starting():
        try:
            run_on_served_loop(
                serve(path, settings, beat=control.heartbeat, on_ready=ready, control=control, device=device)
            )
        except StartStopped as stopped:
            log.info("%s: stopped before serving", stopped)
        except ModelLoadError as exc:
            log.error("%s", exc)
            sys.exit(EXIT_START_FAILED)
    sys.exit(EXIT_OK)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2) or not all(arg.isdigit() for arg in args[1:]):
        print("usage: python -m app.process.engine_process SOCKET [READY_FD]", file=sys.stderr)
        return 2
    ready_fd = int(args[1]) if len(args) == 2 else None

    def ready() -> None:
        if ready_fd is not None:
            os.write(ready_fd, b"1")
            os.close(ready_fd)

    run_on_served_loop(serve(Path(args[0]), on_ready=ready))
    return 0


if __name__ == "__main__":
    sys.exit(main())
