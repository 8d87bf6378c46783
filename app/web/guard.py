"""GuardMiddleware: checks that need no route, done before any route runs (pure ASGI, cheap).

- Oversized header blocks are refused with 431.
- With an API key configured, every path but the health probes needs
  `Authorization: Bearer <key>`, compared in constant time.
- On the metrics port (`metrics_port`), only `/metrics` is served, and without the key: what a
  Prometheus scrape needs and nothing else (Triton's metrics port, TEI's Prometheus port).
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from app.web.errors import HeaderTooLarge, Unauthorized, error_response, raw_error_response
from app.web.ops import HEALTH_PREFIX, METRICS_PATH

MAX_HEADER_BYTES = 16 * 1024


class GuardMiddleware:
    def __init__(self, app: ASGIApp, *, api_key: str | None, metrics_port: int | None = None) -> None:
        """`metrics_port`: the port number the metrics socket is bound to (not 0), or None."""
        self.app = app
        self._key = api_key.encode() if api_key else None
        self._metrics_port = metrics_port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        if sum(len(k) + len(v) for k, v in headers) > MAX_HEADER_BYTES:
            await error_response(HeaderTooLarge(f"request headers exceed {MAX_HEADER_BYTES} bytes"))(scope, receive, send)
            return
        server = scope.get("server")
        if self._metrics_port is not None and server is not None and server[1] == self._metrics_port:
            if scope["path"] == METRICS_PATH:
                await self.app(scope, receive, send)
            else:
                not_here = raw_error_response(404, "not_found", f"only {METRICS_PATH} is served on the metrics port")
                await not_here(scope, receive, send)
            return
        if self._key is not None and not scope["path"].startswith(HEALTH_PREFIX):
            given = next((v for k, v in headers if k == b"authorization"), b"")
            scheme, _, token = given.partition(b" ")
            # The scheme is case-insensitive (RFC 7235); the token is compared in constant time.
            if not (hmac.compare_digest(token, self._key) and scheme.lower() == b"bearer"):
                reason = "missing" if not given else "wrong"
                refusal = Unauthorized(f"{reason} API key: send 'Authorization: Bearer <key>'")
                await error_response(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)
