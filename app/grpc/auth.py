"""The API key over gRPC: the `authorization: Bearer <key>` metadata, read as the HTTP guard reads the header.

Installed only when a key is set (no cost otherwise). Every method but the probes needs the key,
compared in constant time (app/observe/identity.py: bearer_matches); a call without it ends
UNAUTHENTICATED before its handler runs, with the same message as HTTP's 401. The probes are the
same on both doors: the health service, ServerLive, ServerReady and ModelReady, as
/v2/health/* and /v2/models/{name}/ready over HTTP (docs/api.md: the probe rule).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from app.grpc.health import HEALTH_SERVICE
from app.grpc.status import refuse
from app.observe.identity import bearer_matches
from app.protocol.errors import Unauthorized

OPEN_PREFIX = f"/{HEALTH_SERVICE}/"  # probes carry no key, as /v2/health/* over HTTP
_INFERENCE = "/inference.GRPCInferenceService/"
OPEN_NAMES = frozenset({"ServerLive", "ServerReady", "ModelReady"})  # the inference service's probes
OPEN_METHODS = frozenset(_INFERENCE + name for name in OPEN_NAMES)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, key: str) -> None:
        self._key = key.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or details.method in OPEN_METHODS or details.method.startswith(OPEN_PREFIX):
            return handler
        given = next((value for key, value in details.invocation_metadata or () if key == "authorization"), "")
        given_bytes = given if isinstance(given, bytes) else given.encode("latin-1", "replace")
        if bearer_matches(given_bytes, self._key):
            return handler
        reason = "missing" if not given else "wrong"
        return _refusal(handler, Unauthorized(f"{reason} API key: send the metadata 'authorization: Bearer <key>'"))


def _refusal(handler: grpc.RpcMethodHandler, error: Exception) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with `error`."""

    async def refused(request: Any, context: grpc.aio.ServicerContext) -> Any:
        refuse(context, error)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refused)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refused)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refused)
    return grpc.unary_unary_rpc_method_handler(refused)
