"""Who a request is, whichever door it came through: its API key, and its request id.

- The key: `Authorization: Bearer <key>` over HTTP, the `authorization` metadata over gRPC; the
  scheme is case-insensitive (RFC 7235), the token compared in constant time.
- The request id: a client's `X-Request-Id` (header or metadata) is kept when it is 1 to 200
  characters among letters, digits and `-_.:+/=@` (a UUID, nginx's $request_id, Heroku's ids all
  fit), since it lands in log lines and spans. Anything else, or the header twice, is replaced by
  an id of the server's, as Envoy and nginx do: an optional tracing header never costs a request.
  The replacement is logged, at most once a minute (with how many were replaced since), so that
  a client sending bad ids cannot fill the log either.
"""

from __future__ import annotations

import hmac
import logging
import re
import time

from app.protocol.limits import MAX_REQUEST_ID_LENGTH
from app.request_context import new_request_id

log = logging.getLogger("ffn_serve")

REQUEST_ID_HEADER = b"x-request-id"  # HTTP's header and gRPC's metadata key alike
_VALID_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:+/=@-]{1,%d}" % MAX_REQUEST_ID_LENGTH)


def bearer_matches(given: bytes, key: bytes) -> bool:
    """Whether an Authorization value (HTTP header or gRPC metadata) is `Bearer <key>`."""
    scheme, _, token = given.partition(b" ")
    return hmac.compare_digest(token, key) and scheme.lower() == b"bearer"


def request_id_problem(values: list[bytes]) -> str | None:
    """Why the X-Request-Id values given cannot be the request's id; None if they can (or there are none)."""
    if len(values) > 1:
        return f"send at most one X-Request-Id header, not {len(values)}"
    if values and _VALID_REQUEST_ID.fullmatch(values[0]) is None:
        return (
            f"X-Request-Id must be 1 to {MAX_REQUEST_ID_LENGTH} characters among letters, digits and -_.:+/=@ "
            f"(got {len(values[0])} bytes)"
        )
    return None


def request_id_from(values: list[bytes]) -> tuple[bytes, bool]:
    """The request's id (ASCII): the client's when it follows the rule, else a fresh one; and whether it was replaced."""
    problem = request_id_problem(values) if values else None
    if values and problem is None:
        return values[0], False
    if problem is not None:
        _REPLACED.note(problem)
    return new_request_id().encode("ascii"), problem is not None


class _Replacements:
    """Logs replaced request ids: the first at once, then at most one line per `every_s` with the count since."""

    def __init__(self, every_s: float = 60.0) -> None:
        self._every_s = every_s
        self._next_log = 0.0
        self._since = 0

    def note(self, problem: str) -> None:
        self._since += 1
        now = time.monotonic()
        if now >= self._next_log:
            log.warning(
                "replaced a client's X-Request-Id with one of the server's (%d since the last line): %s",
                self._since,
                problem,
            )
            self._since = 0
            self._next_log = now + self._every_s


_REPLACED = _Replacements()
