"""The echo baseline under ffn-serve's own HTTP protocol: what the hardening costs, apart from the service.

    python -m bench.protocol_echo --host 127.0.0.1 --port 8002

bench/gpu/echo.py's app (each body answered with itself), served by uvicorn with uvloop as the
plain echo is, but through app/http/transport/protocol.py's LimitedHttpToolsProtocol with the default
settings' limits (the head counted and timed, the body timeout, the send timeout, the connection
cap): the service's transport without the service. bench.transport sets it beside the plain
echo, so that the protocol's cost and the service's own cost show apart in one table.
"""

from __future__ import annotations

import argparse
import sys

import uvicorn

from app.config.settings import Settings
from app.http.transport.protocol import uvicorn_options
from bench.gpu.echo import app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8002)
    args = parser.parse_args(argv)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        loop="auto",
        log_level="warning",
        access_log=False,
        server_header=False,
        proxy_headers=False,  # as ffn-serve runs
        **uvicorn_options(Settings()),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
