#!/usr/bin/env python3
"""Container health check: exit 0 when the ffn-serve in this container reports ready.

Standard library only, so that it costs little every interval. The port is found as ffn-serve
finds it: FFN_PORT, else `port` in the config file the entry script would use, else 8000.
A server started with `--port` on its command line is not seen: set FFN_PORT instead.

With TLS (FFN_TLS_CERT_FILE and FFN_TLS_KEY_FILE, as the server reads them) it asks over HTTPS and
takes the answer only from a server that shows exactly the certificate in FFN_TLS_CERT_FILE: the
probe needs no CA, and no name, on loopback. With mutual TLS (FFN_TLS_CLIENT_CA_FILE) it presents
HEALTHCHECK_CERT_FILE and HEALTHCHECK_KEY_FILE, by default the server's own pair, which serves when
the client CA also signed the server's certificate for client use (no extended key usage, or
clientAuth among them).
"""

from __future__ import annotations

import http.client
import os
import ssl
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


class PinnedHTTPSHandler(urllib.request.HTTPSHandler):
    """HTTPS to a server that must show exactly `cert_file`'s certificate (its first, the leaf)."""

    def __init__(self, cert_file: str, client: tuple[str, str] | None) -> None:
        with open(cert_file) as f:
            text = f.read()
        end = "-----END CERTIFICATE-----"
        pinned = ssl.PEM_cert_to_DER_cert(text[: text.index(end) + len(end)])
        # The pin is the check: the chain and the name are not (the server's CA need not be at hand here).
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        if client is not None:
            context.load_cert_chain(*client)

        class Pinned(http.client.HTTPSConnection):
            def connect(self) -> None:
                super().connect()
                assert isinstance(self.sock, ssl.SSLSocket)
                if self.sock.getpeercert(binary_form=True) != pinned:
                    self.close()
                    raise ssl.SSLError("the server shows another certificate than FFN_TLS_CERT_FILE's")

        self._connection = Pinned
        super().__init__(context=context)

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(self._connection, req, context=self._context)  # type: ignore[attr-defined]


def opener() -> tuple[str, urllib.request.OpenerDirector]:
    """The scheme and an opener for the server's port: HTTPS, pinned, when the server serves TLS."""
    # No proxies: an HTTP_PROXY meant for the outside world must not carry a loopback probe.
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    cert, key = os.environ.get("FFN_TLS_CERT_FILE"), os.environ.get("FFN_TLS_KEY_FILE")
    if not (cert and key):
        return "http", urllib.request.build_opener(*handlers)
    client = None
    if os.environ.get("FFN_TLS_CLIENT_CA_FILE"):
        client = (os.environ.get("HEALTHCHECK_CERT_FILE") or cert, os.environ.get("HEALTHCHECK_KEY_FILE") or key)
    return "https", urllib.request.build_opener(*handlers, PinnedHTTPSHandler(cert, client))


def main() -> int:
    url = f"http://127.0.0.1:{server_port()}{READY_PATH}"
    try:
        scheme, probe = opener()
        url = f"{scheme}://127.0.0.1:{server_port()}{READY_PATH}"
        with probe.open(url, timeout=TIMEOUT_S) as response:
            return 0 if response.status == 200 else 1
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"not ready: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
