"""An engine process: the configured models, served to fronts through the hand-off's Unix socket.

    python -m app.handoff.engine_process SOCKET     # settings as the server reads them (FFN_*, --config)

It loads and warms the models, then listens on SOCKET, removing a socket file a dead engine left
there. "engine ready" on stderr says it listens; SIGTERM or SIGINT drains the models (what was
accepted is answered) and stops it; SIGHUP reads the config file's [[models]] again and applies
what changed (the fronts get the new table). Metrics go where PROMETHEUS_MULTIPROC_DIR says, as a
worker's do, so that the fronts' /metrics and statistics read the engine's model series. This is
the process issue 30's supervisor will start once per device; until then tests and benchmarks
start it (`launch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from app.engine.registry import Registry
from app.engine.service import Engine
from app.handoff.engine import EngineServer
from app.handoff.loop import run_on_served_loop
from app.logs import configure_logging
from app.metrics import Metrics
from app.settings import load_settings

READY_LINE = b"engine ready"


def launch(path: Path, env: dict[str, str], prefix: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    """Start an engine process listening on `path` with environment `env` (its FFN_* settings), and
    return once it listens; RuntimeError with what it said if it exits first. `prefix`: a command
    to run it under (taskset)."""
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "app.handoff.engine_process", str(path)], env=env, stderr=subprocess.PIPE
    )
    assert proc.stderr is not None
    said = []
    for line in proc.stderr:  # the models load first: its line says it listens
        if READY_LINE in line:
            # What it logs from now on goes on to this process's stderr: a pipe nobody read would
            # fill and stop the engine at its next log line.
            threading.Thread(target=_pass_on, args=(proc.stderr,), name="engine-stderr", daemon=True).start()
            return proc
        said.append(line.decode(errors="replace"))
    raise RuntimeError(f"the engine process exited ({proc.wait(30)}) before it was ready: {''.join(said)[-2000:]}")


def _pass_on(stream: IO[bytes]) -> None:
    for line in stream:
        sys.stderr.write(line.decode(errors="replace"))
        sys.stderr.flush()


async def serve(path: Path) -> None:
    settings = load_settings()
    configure_logging(settings.log_level, settings.log_format)
    engine = Engine(settings, Registry(settings, Metrics()))
    await engine.start()
    await engine.until_warm()
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a dead engine's socket: nobody listens on it any more
    server = EngineServer(engine, path)
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
    print(READY_LINE.decode(), file=sys.stderr, flush=True)
    await stop.wait()
    await engine.drain()
    await server.close()
    await engine.stop()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m app.handoff.engine_process SOCKET", file=sys.stderr)
        return 2
    run_on_served_loop(serve(Path(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
