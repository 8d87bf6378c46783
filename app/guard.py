"""GuardMiddleware: checks that need no route, done before any route runs (pure ASGI, cheap).

- Oversized header blocks are refused with 431 (httptools itself sets no limit).
- With an API key configured, every path but /v2/health/* needs `Authorization: Bearer <key>`,
  compared in constant time.
"""

from __future__ import annotations

import hmac

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

MAX_HEADER_BYTES = 16 * 1024
OPEN_PREFIX = "/v2/health/"


class GuardMiddleware:
    def __init__(self, app: ASGIApp, *, api_key: str | None) -> None:
        self.app = app
        self._key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        if sum(len(k) + len(v) for k, v in headers) > MAX_HEADER_BYTES:
            await _refuse(send, 431, "header_too_large", f"request headers exceed {MAX_HEADER_BYTES} bytes")
            return
        if self._key is not None and not scope["path"].startswith(OPEN_PREFIX):
            given = next((v for k, v in headers if k == b"authorization"), b"")
            scheme, _, token = given.partition(b" ")
            # The scheme is case-insensitive (RFC 7235); the token is compared in constant time.
            if not (hmac.compare_digest(token, self._key) and scheme.lower() == b"bearer"):
                reason = "missing" if not given else "wrong"
                await _refuse(send, 401, "unauthorized", f"{reason} API key: send 'Authorization: Bearer <key>'",
                              [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


async def _refuse(send: Send, status: int, kind: str, message: str,
                  extra: list[tuple[bytes, bytes]] | None = None) -> None:
    body = orjson.dumps({"error": message, "error_type": kind})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body})
