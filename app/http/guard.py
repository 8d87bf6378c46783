"""GuardMiddleware: checks that need no route, done before any route runs (pure ASGI, cheap).

- A request head over `max_header_bytes` is refused with 431 (the protocol layer cuts off one
  still arriving; this catches a whole head that arrived at once).
- A Transfer-Encoding other than plain `chunked` (`gzip, chunked`, ...) is refused with 501:
  the body would otherwise be read with the coding silently ignored.
- With an API key configured, every path but the probes needs `Authorization: Bearer <key>`,
  compared in constant time. The probes are server health (`/v2/health/*`, and KServe V1's `/`)
  and model readiness (`GET /v2/models/{name}[/versions/{v}]/ready`, KServe V1's
  `GET /v1/models/{name}`): what Kubernetes, load balancers, KServe's SDK and tritonclient's
  `is_server_live` / `is_server_ready` / `is_model_ready` send, often with no key. They tell whether the server, or a model of that name, is ready, and nothing more.
- On the metrics port (`metrics_port`), only `/metrics` is served, and without the key: what a
  Prometheus scrape needs and nothing else (Triton's metrics port, TEI's Prometheus port).

- Only HTTP requests (and the server's lifespan events) reach the app: a WebSocket or any other
  kind of connection is refused here, whatever a later route would do with it (the server runs
  without a WebSocket implementation, so none arrives today).

CORS, when configured, sits outside the guard: browsers' preflights carry no key and are
answered before it, and the guard's 401 carries the CORS headers a browser needs to read it.
"""

from __future__ import annotations

import re

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from app.http.errors import error_response
from app.http.ops import HEALTH_PREFIX, METRICS_PATH
from app.protocol.errors import HeaderTooLarge, InvalidInput, NotFound, Unauthorized, UnsupportedTransferEncoding
from app.protocol.identity import bearer_matches

# Model readiness, the probes outside /v2/health/: V2's and KServe V1's. `[^/]+` as the routes' own
# {name}: a path they match can only reach a model-ready route (Starlette does not resolve dot
# segments), and `GET /v1/models` itself, the list, is not one of them.
_MODEL_READY = re.compile(r"/v2/models/[^/]+(?:/versions/[^/]+)?/ready|/v1/models/[^/]+")


def is_probe(scope: Scope) -> bool:
    """Whether a request is a health or readiness probe, which needs no API key."""
    path: str = scope["path"]
    if path.startswith(HEALTH_PREFIX) or path == "/":  # "/": KServe V1's liveness
        return True
    return scope["method"] in ("GET", "HEAD") and _MODEL_READY.fullmatch(path) is not None


def transfer_codings(headers: list[tuple[bytes, bytes]]) -> list[bytes]:
    """Every Transfer-Encoding coding of the request, lower-case, in order."""
    return [
        coding.strip().lower()
        for name, value in headers
        if name == b"transfer-encoding"
        for coding in value.split(b",")
    ]


class GuardMiddleware:
    def __init__(
        self, app: ASGIApp, *, api_key: str | None, max_header_bytes: int, metrics_port: int | None = None
    ) -> None:
        """`metrics_port`: the port number the metrics socket is bound to (not 0), or None."""
        self.app = app
        self._key = api_key.encode() if api_key else None
        self._max_header_bytes = max_header_bytes
        self._metrics_port = metrics_port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                await self.app(scope, receive, send)
            elif scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})  # policy violation, before any handshake
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await error_response(refusal)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> Exception | None:
        headers = scope["headers"]
        # One pass over the headers: the head's size as sent (request line and header lines, close
        # to the wire size), and whether any Transfer-Encoding came; its codings are read only then.
        size = len(scope["method"]) + len(scope.get("raw_path", b"")) + len(scope.get("query_string", b"")) + 12
        coded = False
        for name, value in headers:
            size += len(name) + len(value) + 4
            coded = coded or name == b"transfer-encoding"
        if size > self._max_header_bytes:
            return HeaderTooLarge(f"request head exceeds {self._max_header_bytes} bytes")
        codings = transfer_codings(headers) if coded else []
        if codings and codings != [b"chunked"]:
            shown = b", ".join(codings).decode("latin-1")[:64]
            return UnsupportedTransferEncoding(
                f"Transfer-Encoding {shown!r} is not supported; send chunked or Content-Length"
            )
        server = scope.get("server")
        if self._metrics_port is not None and server is not None and server[1] == self._metrics_port:
            if scope["path"] == METRICS_PATH:
                return None
            return NotFound(f"only {METRICS_PATH} is served on the metrics port")
        if self._key is not None and not is_probe(scope):
            given = next((v for k, v in headers if k == b"authorization"), b"")
            if not bearer_matches(given, self._key):
                reason = "missing" if not given else "wrong"
                return Unauthorized(f"{reason} API key: send 'Authorization: Bearer <key>'")
        return None


class JsonCORSMiddleware(CORSMiddleware):
    """Starlette's CORS, with a refused preflight answered in the service's JSON error shape."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code == 200:
            return response
        reason = bytes(response.body).decode("latin-1")  # "Disallowed CORS origin, method"
        return error_response(InvalidInput(f"{reason}: this origin, method or header is not allowed"))
