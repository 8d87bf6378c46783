"""Who a request is, whichever door it came through: its API key, and its request id.

- The key: `Authorization: Bearer <key>` over HTTP, the `authorization` metadata over gRPC; the
  scheme is case-insensitive (RFC 7235), the token compared in constant time.
- The request id: a client's `X-Request-Id` (header or metadata) is kept when it is 1 to 200
  characters among letters, digits and `-_.:+/=@` (a UUID, nginx's $request_id, Heroku's ids all
  fit), since it lands in log lines and spans; anything else is the client's mistake, and is
  reported as such by the door.
"""

from __future__ import annotations

import hmac
import re

from app.protocol.limits import MAX_REQUEST_ID_LENGTH

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
