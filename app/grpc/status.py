"""gRPC statuses from the one error table (app/protocol/errors.py): the code, the message, the trailing metadata.

Every failure of the gRPC door goes through `grpc_error`, so a request refused over HTTP with a
status and an error_type is refused over gRPC with the table's gRPC code, the same message, and
the error_type in the trailing metadata (`ffn-error-type`). A retry hint travels the way gRPC
clients read one (gRFC A6, `grpc-retry-pushback-ms`), beside HTTP's `retry-after` in seconds.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from app.errors import drop_frames
from app.protocol.errors import INTERNAL, kind_of, message_of

log = logging.getLogger("ffn_serve")

ERROR_TYPE_KEY = "ffn-error-type"  # the error_type an HTTP answer carries in its JSON body
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"  # wait this long before retrying; negative: do not retry
RETRY_AFTER_KEY = "retry-after"  # seconds, as HTTP's Retry-After


@dataclass(frozen=True)
class GrpcError:
    """How one failure is answered over gRPC."""

    code: grpc.StatusCode
    details: str
    trailers: tuple[tuple[str, str], ...]
    error_type: str


def grpc_error(exc: BaseException) -> GrpcError:
    """The table's answer to `exc`: its gRPC code and message; anything unlisted is INTERNAL, with no detail."""
    kind = kind_of(exc) if isinstance(exc, Exception) else INTERNAL
    if kind is INTERNAL:
        return GrpcError(
            grpc.StatusCode.INTERNAL, "internal server error", ((ERROR_TYPE_KEY, INTERNAL.error_type),), "internal"
        )
    code = grpc.StatusCode[kind.grpc]
    message = message_of(exc, "grpc") if isinstance(exc, Exception) else str(exc)
    trailers = [(ERROR_TYPE_KEY, kind.error_type)]
    retry_after = kind.headers(exc).get("Retry-After") if isinstance(exc, Exception) else None
    if retry_after is not None:
        trailers += [(RETRY_AFTER_KEY, retry_after), (RETRY_PUSHBACK_KEY, str(int(retry_after) * 1000))]
    elif code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        # Too large ever to fit (the queue, the message limit, the device): the same request cannot succeed.
        trailers.append((RETRY_PUSHBACK_KEY, "-1"))
    return GrpcError(code, message, tuple(trailers), kind.error_type)


def log_if_internal(exc: BaseException) -> None:
    """A bug (an error the table does not list) is logged with its traceback; the client learns nothing of it."""
    if grpc_error(exc).error_type == INTERNAL.error_type:
        log.error("unhandled error in a gRPC call", exc_info=exc)


def set_status(context: grpc.aio.ServicerContext, error: GrpcError, trailers: Sequence[tuple[str, str]] = ()) -> None:
    """End the call (once its method returns) with `error`'s code, message and trailers, and `trailers` after them."""
    context.set_code(error.code)
    context.set_details(error.details)
    context.set_trailing_metadata((*error.trailers, *trailers))


def refuse(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Set the call's status to the table's for `exc` (a bug is logged, and answered INTERNAL); the method then returns.

    Not context.abort: its AbortError would hold the call's frames (and its request, 31 MiB for
    a large ModelInfer) in a reference cycle through grpc's call state, freed only when the
    garbage collector next ran, which on a quiet server can be never.
    """
    log_if_internal(exc)
    error = grpc_error(exc)
    drop_frames(exc)
    set_status(context, error)
