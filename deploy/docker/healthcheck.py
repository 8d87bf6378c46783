#!/usr/bin/env python3
"""Container health check: exit 0 when the ffn-serve in this container reports ready.

Standard library only, so that it costs little every interval. The port is found as ffn-serve
finds it: FFN_PORT, else `port` in the config file the entry script would use, else 8000.
A server started with `--port` on its command line is not seen: set FFN_PORT instead.
"""

from __future__ import annotations

import os
import sys
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

READY_PATH = "/v2/health/ready"
DEFAULT_PORT = 8000
TIMEOUT_S = 4.0  # under the Dockerfile's HEALTHCHECK --timeout


def config_file() -> Path | None:
    """The config file ffn-serve reads: FFN_CONFIG, or the one the entry script picks up."""
    if os.environ.get("FFN_CONFIG"):
        return Path(os.environ["FFN_CONFIG"])
    mounted = Path(os.environ.get("MODELS_DIR", "/models")) / "config.toml"
    return mounted if mounted.is_file() else None


def server_port() -> int:
    """The TCP port the server listens on."""
    if os.environ.get("FFN_PORT"):
        return int(os.environ["FFN_PORT"])
    path = config_file()
    if path is not None:
        try:
            with path.open("rb") as f:
                return int(tomllib.load(f).get("port", DEFAULT_PORT))
        except (OSError, ValueError, TypeError, tomllib.TOMLDecodeError):
            pass  # the server itself reports a bad config file; here it only costs the default
    return DEFAULT_PORT


def main() -> int:
    url = f"http://127.0.0.1:{server_port()}{READY_PATH}"
    # No proxies: an HTTP_PROXY meant for the outside world must not carry a loopback probe.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=TIMEOUT_S) as response:
            return 0 if response.status == 200 else 1
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"not ready: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
