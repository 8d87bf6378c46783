"""RequestTimer: every HTTP request's whole time in ffn_http_request_seconds{protocol, route, status}.

The service's other histograms start at the batcher; this one covers what a client waits for:
from the ASGI call (uvicorn has parsed the head) until the app has sent the last byte of the
answer, the body read, decoding, queueing, compute, encoding and the guard's refusals included.
Pure ASGI and cheap (a few route patterns tried in order, one observe): it is the outermost
layer of every request, the hot ones included.

Labels stay bounded whatever clients send: `route` is the matched endpoint's template
(`/v2/models/{name}/infer`, never the raw path), or `unmatched`; `protocol` is `kserve_v1`
(`/`, `/v1/models/{name}[:predict]`), `native` (the rest of /v1), `v2` (/v2, health included) or
`http` (metrics, the API pages); `status` is the class, `2xx`,
`4xx` or `5xx`. Answers that uvicorn's protocol gives before the app is called (a malformed or
too slow head, too many connections) are not in it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable

from prometheus_client import Histogram
from starlette.routing import BaseRoute, Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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


class RequestTimer:
    """Pure ASGI: times each HTTP request and observes it under its protocol, route and status class."""

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
        status = 0

        async def send_timed(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_timed)
        except Exception:
            status = status or 500  # Starlette's outermost layer answers 500 for what escapes
            raise
        finally:
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
