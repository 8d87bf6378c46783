"""The gRPC server of one serving process: grpc.aio on uvicorn's event loop, beside the HTTP server.

It runs in the same process and event loop as uvicorn (app/server.py starts it once the app has
started, and stops it after the drain), so its calls reach the same engine, the same batchers
and the same metrics as HTTP requests: gRPC and HTTP rows share batches. It serves Triton's
inference.GRPCInferenceService (app/grpc/service.py), grpc.health.v1.Health (health.py) and
server reflection, v1 and v1alpha (reflection.py), so grpcurl, Postman and grpc_health_probe work
without .proto files.

Budgets, from the HTTP settings: a message is at most `max_body_bytes` (RESOURCE_EXHAUSTED,
before it is parsed; a compressed one is inflated no further), metadata at most
`max_header_bytes`, connections and calls in flight at most `max_connections` each per process;
an infer request's non-tensor fields are bounded before parsing and its bytes held count against
`max_held_bytes` (wire.py); any other method's message is at most its HTTP twin's body limit. A
request that does not parse is refused INVALID_ARGUMENT, never INTERNAL.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2_grpc
from tritonclient.grpc.service_pb2_grpc import add_GRPCInferenceServiceServicer_to_server

from app.errors import ServiceError
from app.grpc import reflection, wire
from app.grpc.auth import ApiKeyInterceptor
from app.grpc.health import HEALTH_SERVICE, INFERENCE_SERVICE, Health
from app.grpc.malformed import Malformed
from app.grpc.ports import target
from app.grpc.service import InferenceServicer
from app.protocol.admission import HeldBytes
from app.protocol.errors import InvalidInput
from app.protocol.limits import control_message_bytes
from app.protocol.state import ServiceState

log = logging.getLogger("ffn_serve")

# The methods whose requests carry tensors: their wire bytes are checked against wire.py's budget first.
_TENSOR_METHODS = {"ModelInfer", "ModelStreamInfer"}


class GrpcServer:
    """Start and stop the gRPC door of one serving process on host:port."""

    def __init__(self, state: ServiceState, host: str, port: int) -> None:
        self._state = state
        self._address = target(host, port)
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        """Bind (with SO_REUSEPORT, beside the other workers) and serve; RuntimeError if the address cannot be bound."""
        settings = self._state.settings
        key = settings.api_key.get_secret_value() if settings.api_key else None
        server = grpc.aio.server(
            interceptors=[ApiKeyInterceptor(key)] if key else [],
            options=[
                ("grpc.so_reuseport", 1),
                # Also the bound on a compressed message's inflated size: grpc core stops inflating
                # past it ("Decompressed message larger than max", RESOURCE_EXHAUSTED), so a gRPC
                # decompression bomb costs no memory (tests/test_compression.py).
                ("grpc.max_receive_message_length", settings.max_body_bytes),
                ("grpc.max_send_message_length", -1),  # an answer is as large as its request's rows make it
                ("grpc.max_metadata_size", settings.max_header_bytes),
                ("grpc.max_allowed_incoming_connections", settings.max_connections),
            ],
            maximum_concurrent_rpcs=settings.max_connections,
        )
        services = (
            (INFERENCE_SERVICE, add_GRPCInferenceServiceServicer_to_server, InferenceServicer(self._state)),
            (HEALTH_SERVICE, health_pb2_grpc.add_HealthServicer_to_server, Health(self._state.engine)),
        )
        for name, register, servicer in services:
            handlers = _tolerant_handlers(register, servicer, self._state.held)
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
            server.add_registered_method_handlers(name, handlers)
        reflection.enable(server, (INFERENCE_SERVICE, HEALTH_SERVICE))
        server.add_insecure_port(self._address)  # RuntimeError when it cannot bind
        await server.start()
        self._server = server

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls (UNAVAILABLE) and give the ones in flight `grace_s` seconds to finish."""
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None


class _Capture:
    """Stands in for a server to catch the generated registration's method handlers."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.handlers = handlers


def _tolerant_handlers(
    register: Callable[[Any, Any], None], servicer: Any, held: HeldBytes
) -> dict[str, grpc.RpcMethodHandler]:
    """The method handlers that the generated `register` gives `servicer`, each parsing its requests within budget.

    A tensor method's message is read by wire.py within its budgets (non-tensor bytes, and its
    bytes held against `held`); any other method's message is refused unparsed past its HTTP
    twin's body limit (limits.control_message_bytes). A request that does not parse or is over a
    budget becomes a Malformed, which its method answers through the error table naming what was
    wrong (INVALID_ARGUMENT, RESOURCE_EXHAUSTED): grpc's own handling would answer UNKNOWN.
    """
    capture = _Capture()
    register(servicer, capture)
    return {
        name: handler._replace(request_deserializer=_tolerant(name, handler.request_deserializer, held))
        for name, handler in capture.handlers.items()
    }


def _tolerant(method: str, parse: Callable[[bytes], Any], held: HeldBytes) -> Callable[[bytes], Any]:
    limit = control_message_bytes(method)

    def read(data: bytes) -> Any:
        if method in _TENSOR_METHODS:
            return wire.read_infer_request(data, held)
        wire.check_message_size(data, limit, method)
        return parse(data)

    def deserialize(data: bytes) -> Any:
        try:
            return read(data)
        except ServiceError as exc:
            return Malformed(exc)
        except DecodeError as exc:
            return Malformed(InvalidInput(f"malformed protobuf: {exc}"))

    return deserialize
