"""An engine process: the configured models, served to fronts through the hand-off's Unix socket.

    python -m app.handoff.engine_process SOCKET     # settings as the server reads them (FFN_*, --config)

It loads and warms the models, then listens on SOCKET, removing a socket file a dead engine left
there. "engine ready" on stderr says it listens; SIGTERM or SIGINT drains the models (what was
accepted is answered) and stops it. This is the process issue 30's supervisor will start once
per device; until then it runs under tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from pathlib import Path

from app.engine.registry import Registry
from app.engine.service import Engine
from app.handoff.engine import EngineServer
from app.handoff.loop import run_on_served_loop
from app.logs import configure_logging
from app.metrics import Metrics
from app.settings import load_settings


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
    print("engine ready", file=sys.stderr, flush=True)
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
