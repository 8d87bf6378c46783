"""The edge of every HTTP request, in front of the routes: its id, its time, and the guard's checks (pure ASGI, cheap).

**Edge**, the outermost layer (wrapped around Starlette's own error middleware, so that even an
unexpected 500 carries what it adds), does two things with one wrapper of `send`:

- The request's id: its RequestContext goes in the context variable that the error body, the
  access log and the tracing read (app/observe/identity.py), and `X-Request-Id` on the answer's
  head. A client's id is kept when it follows the protocol core's rule, else replaced by a fresh
  one: never an id that could forge a log line, and never a request refused for an optional header.
- The request's whole time in ffn_http_request_seconds{protocol, route, status}: what a client
  waits for, from the ASGI call (uvicorn has parsed the head) until the app has sent the last byte
  of the answer, the body read, decoding, queueing, compute, encoding and the guard's refusals
  included. Labels stay bounded whatever clients send: `route` is the matched endpoint's template
  (`/v2/models/{name}/infer`, never the raw path), or `unmatched`; `protocol` is `kserve_v1`
  (`/`, `/v1/models/{name}[:predict]`), `native` (the rest of /v1), `v2` (/v2, health included)
  or `http` (metrics, the API pages); `status` is the class, `2xx`,
  `4xx` or `5xx`. Answers that uvicorn's protocol gives before the app is called (a malformed or
  too slow head, too many connections) are not in it.

**GuardMiddleware**, checks that need no route, done before any route runs:
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
import time
from collections.abc import Iterable

from prometheus_client import Histogram
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.http.errors import error_response
from app.http.ops import HEALTH_PREFIX, METRICS_PATH
from app.observe.identity import CURRENT, REQUEST_ID_HEADER, RequestContext, bearer_matches, request_id_from
from app.protocol.errors import HeaderTooLarge, InvalidInput, NotFound, Unauthorized, UnsupportedTransferEncoding

UNMATCHED = "unmatched"
_PROTOCOLS = (("/v1/", "native"), ("/v2", "v2"))
# KServe V1's liveness (/), readiness and predict (`{name}:predict`); the native routes go deeper.
_KSERVE_V1 = re.compile(r"/|/v1/models/[^/]+")


def protocol_of(path: str) -> str:
    """The protocol a path belongs to: kserve_v1 (/, /v1/models/{name}[:predict]), native (/v1), v2 (/v2), or http."""
    if _KSERVE_V1.fullmatch(path):
        return "kserve_v1"
    return next((name for prefix, name in _PROTOCOLS if path.startswith(prefix)), "http")


def route_templates(routes: Iterable[BaseRoute], first: Iterable[str] = ()) -> list[tuple[re.Pattern[str], str]]:
    """(pattern, template) for every route of the app, in routing order, the templates in `first` ahead.

    `first`: the hot routes (the tensor routes), tried before the rest so that they cost one or
    two matches. Putting them first changes no answer: no other template matches their paths.
    """
    found: list[tuple[re.Pattern[str], str]] = []
    for route in routes:
        pattern = getattr(route, "path_regex", None)
        path = getattr(route, "path", None)
        if pattern is None or path is None:
            continue
        found.append((pattern, f"{path}/{{path}}" if isinstance(route, Mount) else path))
    hot = set(first)
    return [entry for entry in found if entry[1] in hot] + [entry for entry in found if entry[1] not in hot]


class Edge:
    """Gives each HTTP request its RequestContext and X-Request-Id, and times it (see the module's docstring)."""

    def __init__(self, app: ASGIApp, *, histogram: Histogram, routes: list[tuple[re.Pattern[str], str]]) -> None:
        self.app = app
        self._histogram = histogram
        self._routes = routes
        self._children: dict[tuple[str, str, int], Histogram] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        header, _ = request_id_from([value for name, value in scope["headers"] if name == REQUEST_ID_HEADER])
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), (REQUEST_ID_HEADER, header)]
            await send(message)

        token = CURRENT.set(RequestContext(header.decode("ascii")))
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            status = status or 500  # Starlette's outermost layer answers 500 for what escapes
            raise
        finally:
            CURRENT.reset(token)
            if status:  # nothing sent and cancelled: the client left before any answer, nothing to time
                self._child(scope["path"], status).observe(time.perf_counter() - started)

    def _child(self, path: str, status: int) -> Histogram:
        template = next((template for pattern, template in self._routes if pattern.match(path)), UNMATCHED)
        # An unmatched path's protocol comes from the path itself; a template's is fixed.
        protocol = protocol_of(path if template == UNMATCHED else template)
        key = (protocol, template, status // 100)  # bounded: the routes (and unmatched) x 3 protocols x 5 classes
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._histogram.labels(
                protocol=protocol, route=template, status=f"{status // 100}xx"
            )
        return child


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
