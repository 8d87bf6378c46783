"""ffn-serve: load the configured models, then serve them with uvicorn until SIGTERM drains it."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path
from types import FrameType

import uvicorn
from pydantic import ValidationError

from app.engine.registry import ModelLoadError, Registry
from app.engine.service import Engine
from app.main import create_app
from app.metrics import Metrics
from app.settings import ConfigFileError, Settings, load_settings

log = logging.getLogger("ffn_serve")
# uvicorn waits this long for open connections once the batchers have drained.
CONNECTION_CLOSE_GRACE_S = 3


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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="ffn-serve",
        description="Serve position-wise FFN models over HTTP. Every setting can also be set as FFN_<NAME>.",
    )
    parser.add_argument("--config", type=Path, help="TOML config with settings and [[models]] (FFN_CONFIG)")
    parser.add_argument("--host", help="address to bind (FFN_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (FFN_PORT, default 8000)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = load_settings(config=args.config, host=args.host, port=args.port)
    except (ConfigFileError, ValidationError) as exc:
        print(f"ffn-serve: invalid settings: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(settings)


def serve(settings: Settings) -> int:
    registry = Registry(settings, Metrics())
    try:
        registry.load()  # before binding: a model that cannot load stops the start here
    except ModelLoadError as exc:
        print(f"ffn-serve: {exc}", file=sys.stderr)
        return 1
    app = create_app(settings, registry)
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level,
        timeout_graceful_shutdown=CONNECTION_CLOSE_GRACE_S, access_log=False,
        loop="auto", http="auto", server_header=False, proxy_headers=False,
    )
    server = DrainingServer(config, app.state.service.engine)
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
