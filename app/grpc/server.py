"""The gRPC server of one serving process: grpc.aio on uvicorn's event loop, beside the HTTP server.

It runs in the same process and event loop as uvicorn (app/process/server.py starts it once the app has
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
from grpc_health.v1 import health_pb2_grpc
from tritonclient.grpc.service_pb2_grpc import add_GRPCInferenceServiceServicer_to_server

from app.engine.linger import Arrivals
from app.grpc import reflection, wire
from app.grpc.auth import ApiKeyInterceptor
from app.grpc.health import HEALTH_SERVICE, INFERENCE_SERVICE, Health
from app.grpc.ports import target
from app.grpc.receive import STREAM_ROOMS_SHARE, Rooms, read_with_room
from app.grpc.service import InferenceServicer
from app.grpc.writes import answered_within
from app.protocol.admission import CallsInFlight, HeldBytes
from app.protocol.limits import GRPC_STREAMS_PER_CONNECTION
from app.protocol.state import ServiceState

log = logging.getLogger("ffn_serve")


class GrpcServer:
    """Start and stop the gRPC door of one serving process on host:port."""

    def __init__(
        self, state: ServiceState, host: str, port: int, credentials: grpc.ServerCredentials | None = None
    ) -> None:
        """`credentials`: serve TLS only (app/grpc/tls.py); None, cleartext."""
        self._state = state
        self._credentials = credentials
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
                ("grpc.absolute_max_metadata_size", settings.max_header_bytes),
                ("grpc.max_allowed_incoming_connections", settings.max_connections),
                # Per connection: a bounded number of streams at once, advertised (SETTINGS_MAX_CONCURRENT_STREAMS;
                # grpc core counts a stream until it is freed, so streams reset at once count too: rapid reset).
                ("grpc.max_concurrent_streams", GRPC_STREAMS_PER_CONNECTION),
                # A stream's window stays at HTTP/2's 64 KiB until its handler reads (receive.py): without
                # BDP probing grpc core does not grow it by the link's throughput, so a call refused before
                # its message is read has cost at most that much. A read opens the window to the message's
                # size (grpc core does so for a pending read), so one large message still arrives at speed.
                ("grpc.http2.bdp_probe", 0),
                # A connection that has not sent its preface and SETTINGS within header_timeout_s is closed,
                # and so is one with nothing in flight for as long (grpc clients reconnect by themselves).
                ("grpc.server_handshake_timeout_ms", _milliseconds(settings.header_timeout_s)),
                ("grpc.max_connection_idle_ms", _milliseconds(settings.header_timeout_s)),
            ],
        )
        # Two budgets of calls in flight, so that probes anyone may open (a health Watch stream needs no
        # key) can never take the slots of the calls that need one.
        calls = CallsInFlight(settings.max_connections, "calls")
        probes = CallsInFlight(settings.max_connections, "probes (health checks and streams)")
        # Room for ModelInfer and ModelStreamInfer messages on their way, from the same budget (receive.py),
        # each method its own rooms: streams left open and quiet hold theirs while they wait, and must
        # not take those of unary calls. One message is at most max_body_bytes, grpc's
        # max_receive_message_length above.
        rooms = Rooms(self._state.held, settings.max_body_bytes, settings.read_timeout_s)
        stream_rooms = Rooms(self._state.held, settings.max_body_bytes, settings.read_timeout_s, STREAM_ROOMS_SHARE)
        services = (
            (
                INFERENCE_SERVICE,
                add_GRPCInferenceServiceServicer_to_server,
                InferenceServicer(self._state, calls, probes, stream_rooms),
            ),
            (HEALTH_SERVICE, health_pb2_grpc.add_HealthServicer_to_server, Health(self._state.engine, probes)),
        )
        for name, register, servicer in services:
            handlers = _tolerant_handlers(
                register, servicer, self._state.held, settings.send_timeout_s, rooms, self._state.arrivals
            )
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
            server.add_registered_method_handlers(name, handlers)
        reflection.enable(server, (INFERENCE_SERVICE, HEALTH_SERVICE))
        # RuntimeError when it cannot bind. With credentials the port speaks TLS only: a cleartext
        # client's preface fails the handshake and the connection closes unanswered.
        if self._credentials is not None:
            server.add_secure_port(self._address, self._credentials)
        else:
            server.add_insecure_port(self._address)
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
    register: Callable[[Any, Any], None],
    servicer: Any,
    held: HeldBytes,
    send_timeout_s: float,
    rooms: Rooms,
    arrivals: Arrivals | None = None,
) -> dict[str, grpc.RpcMethodHandler]:
    """The method handlers that the generated `register` gives `servicer`, each parsing its requests within budget.

    A tensor method's message is read by wire.py within its budgets (non-tensor bytes, and its
    bytes held against `held`); any other method's message is refused unparsed past its HTTP
    twin's body limit (limits.control_message_bytes). A request that does not parse or is over a
    budget becomes a Malformed, which its method answers through the error table naming what was
    wrong (INVALID_ARGUMENT, RESOURCE_EXHAUSTED): grpc's own handling would answer UNKNOWN.

    ModelInfer's message is read only with one of `rooms` (receive.py: served stream-unary, so
    that grpc core holds no message the budget has not admitted), and its answer is watched (writes.answered_within): one not taken within
    `send_timeout_s` ends the client's connection (connections.py), as the HTTP door drops it, and
    the request's and answer's bytes are held until the call is done. A ModelInfer call is announced
    to `arrivals` (the process's batchers, which linger for it) from its room until its message is read.
    ModelStreamInfer's messages come raw: the servicer reads each with a room and parses it once it
    has arrived (stream.py).
    """
    capture = _Capture()
    register(servicer, capture)
    handlers = {
        name: handler._replace(request_deserializer=wire.tolerant(name, handler.request_deserializer, held))
        for name, handler in capture.handlers.items()
    }
    stream = handlers.get("ModelStreamInfer")
    if stream is not None:  # parsed by the servicer once the room is traded for the message (stream.py)
        handlers["ModelStreamInfer"] = stream._replace(request_deserializer=None)
    infer = handlers.get("ModelInfer")
    if infer is not None:
        watched = answered_within(infer.unary_unary, send_timeout_s)
        handlers["ModelInfer"] = grpc.stream_unary_rpc_method_handler(
            read_with_room(watched, infer.request_deserializer, rooms, arrivals),
            request_deserializer=None,  # the raw bytes: parsed (and held) once the room is traded for them
            response_serializer=infer.response_serializer,
        )
    return handlers


def _milliseconds(seconds: float) -> int:
    """A duration as grpc's channel arguments take it: whole milliseconds, within a C int."""
    return min(int(seconds * 1000), 2**31 - 1)
