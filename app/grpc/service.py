"""inference.GRPCInferenceService on the engine facade: Triton's gRPC methods, each the twin of an HTTP route.

The servicer is tritonclient's generated base class (tritonclient.grpc.service_pb2_grpc), so the
method paths and messages are Triton's own. Every answer is read from the same places as its
HTTP twin: metadata (app/http/v2/routes.py), model configuration, statistics and the repository
index (app/protocol/v2/extensions.py), load and unload (app/protocol/v2/model_control.py's parameter checks,
then Engine.load / Engine.unload), and every failure goes through the one error table
(app/grpc/status.py). The methods of extensions this server does not implement answer
UNIMPLEMENTED with the message their HTTP routes give; each is one method below, so serving
one later (registering CUDA shared memory) means replacing that method.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message
from grpc.aio import ServicerContext as Context
from tritonclient.grpc import model_config_pb2
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc.service_pb2_grpc import GRPCInferenceServiceServicer

from app.engine.facade import ModelFacade
from app.errors import drop_frames
from app.grpc import codec, wire
from app.grpc.auth import OPEN_NAMES as OPEN_METHODS
from app.grpc.calls import Call
from app.grpc.malformed import Malformed
from app.grpc.receive import Rooms
from app.grpc.status import grpc_error, log_if_internal, refuse, set_status
from app.grpc.stream import StreamInfer
from app.grpc.wire import InferMessage
from app.observe import identity
from app.protocol import mc_parameters
from app.protocol.admission import CallsInFlight, deadline_from
from app.protocol.errors import TooManyCalls
from app.protocol.state import ServiceState
from app.protocol.v2 import (
    extensions,
    log_settings,
    metadata,
    model_control,
    statistics,
    system_shared_memory,
    trace_extension,
)
from app.protocol.v2.codec import OUTPUT_NAME, STD_OUTPUT_NAME

PROTOCOL = "grpc"  # the protocol label of ffn_requests_total

Request = TypeVar("Request")
Response = TypeVar("Response", bound=Message)


def answered(
    method: Callable[[Any, Any, Context], Awaitable[Response]],
) -> Callable[[Any, Any, Context], Awaitable[Response | None]]:
    """A unary method whose request may be Malformed and whose errors are answered from the error table."""

    name = method.__name__
    open_to_all = name in OPEN_METHODS  # the probes: no key needed, so a budget of their own

    async def wrapper(self: InferenceServicer, request: Any, context: Context) -> Response | None:
        with Call(context, self._state.tracing, name) as call:
            if isinstance(request, InferMessage):
                call.trace(request.request.model_name)
            try:
                if isinstance(request, Malformed):
                    raise request.error
                with (self._probes if open_to_all else self._calls).call():
                    response = await method(self, request, context)
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as exc:  # answered inside the block, whose end drops `exc`: no frame outlives the call
                log_if_internal(exc)
                error = grpc_error(exc)
                drop_frames(exc)
                set_status(context, error, call.answered(error))
                return None
            context.set_trailing_metadata(call.answered(None, response.ByteSize() if call.traced else 0))
            return response

    wrapper.__name__ = method.__name__
    wrapper.__doc__ = method.__doc__
    return wrapper


def _repository_parameters(parameters: Mapping[str, pb.ModelRepositoryParameter]) -> dict[str, Any]:
    """A ModelRepositoryParameter map as the HTTP body's `parameters` would hold it: key -> the value
    set (None where none is), so that app/protocol/v2/model_control.py checks both doors' alike."""
    values: dict[str, Any] = {}
    for key, parameter in parameters.items():
        kind = parameter.WhichOneof("parameter_choice")
        values[key] = None if kind is None else getattr(parameter, kind)
    return values


def _version(version: str) -> str | None:
    """The version a request names; the empty string (the protobuf default) names none."""
    return version or None


class InferenceServicer(GRPCInferenceServiceServicer):
    """Triton's GRPCInferenceService, answered from the engine facade and the service state."""

    def __init__(self, state: ServiceState, calls: CallsInFlight, probes: CallsInFlight, rooms: Rooms) -> None:
        """`calls`: the budget of the calls in flight; `probes`: that of the probes, which need no key; `rooms`:
        those a ModelStreamInfer message is read with, ModelInfer's (receive.py)."""
        self._state = state
        self._engine = state.engine
        self._calls, self._probes = calls, probes
        settings = state.settings
        # A stream's messages come raw (server.py): parsed here, as grpc would have, once each has its room.
        parse = wire.tolerant("ModelStreamInfer", pb.ModelInferRequest.FromString, state.held)
        self._stream = StreamInfer(
            self._infer,
            rooms,
            parse,
            max_rows=settings.max_batch_rows,
            send_timeout_s=settings.send_timeout_s,
            tracing=state.tracing,
        )

    # ----- health and metadata --------------------------------------------------------------

    @answered
    async def ServerLive(self, request: pb.ServerLiveRequest, context: Context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    @answered
    async def ServerReady(self, request: pb.ServerReadyRequest, context: Context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self._engine.ready)

    @answered
    async def ModelReady(self, request: pb.ModelReadyRequest, context: Context) -> pb.ModelReadyResponse:
        # As Triton's gRPC door: an unknown model is not ready (HTTP answers it 404, which clients read as false).
        served = next((m for m in self._engine.models() if m.name == request.name), None)
        version = _version(request.version)
        ready = served is not None and (version is None or version == str(served.version)) and served.status.ready
        return pb.ModelReadyResponse(ready=ready)

    @answered
    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Context) -> pb.ServerMetadataResponse:
        server = metadata.server_metadata(self._state)
        return pb.ServerMetadataResponse(name=server.name, version=server.version, extensions=server.extensions)

    @answered
    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Context) -> pb.ModelMetadataResponse:
        answer = metadata.model_metadata(self._state, request.name, _version(request.version))
        # Triton's ModelMetadataResponse has no parameters: the digest is in the model configuration's.
        return json_format.ParseDict(answer.model_dump(exclude={"parameters"}), pb.ModelMetadataResponse())

    @answered
    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Context) -> pb.ModelConfigResponse:
        served = self._engine.model(request.name, _version(request.version))
        config = extensions.model_configuration(served, self._state.settings)
        return pb.ModelConfigResponse(config=json_format.ParseDict(config, model_config_pb2.ModelConfig()))

    @answered
    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Context) -> pb.ModelStatisticsResponse:
        # As Triton: no name asks for every model.
        models: Sequence[ModelFacade] = (
            [self._engine.model(request.name, _version(request.version))] if request.name else self._engine.models()
        )
        stats = statistics.model_stats(self._state.metrics.merged, models)
        return json_format.ParseDict(stats, pb.ModelStatisticsResponse(), ignore_unknown_fields=True)  # the digest

    @answered
    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: Context) -> pb.RepositoryIndexResponse:
        entries = extensions.repository_models(self._engine.listed(), request.ready)
        return pb.RepositoryIndexResponse(
            models=[pb.RepositoryIndexResponse.ModelIndex(**entry.model_dump(exclude={"digest"})) for entry in entries]
        )

    # ----- inference ------------------------------------------------------------------------

    @answered
    async def ModelInfer(self, request: InferMessage, context: Context) -> pb.ModelInferResponse:
        return await self._infer(request, context)

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[Any], context: Context) -> None:
        try:
            with self._calls.call():  # a stream is one call in flight for its whole life
                await self._stream.serve(context)
        except TooManyCalls as exc:
            refuse(context, exc)

    async def _infer(self, message: InferMessage, context: Context) -> pb.ModelInferResponse:
        """One infer request, unary or from a stream: decoded, queued in the model's batcher, encoded.

        Its bytes are held against max_held_bytes (taken when it was read, wire.py), then its answer's
        in their place, until whoever writes the answer has written it and releases the message.
        """
        response = await self._compute(message, context)
        message.hold_answer(sum(len(raw) for raw in response.raw_output_contents))
        return response

    async def _compute(self, message: InferMessage, context: Context) -> pb.ModelInferResponse:
        request = message.request
        served = self._engine.model(request.model_name, _version(request.model_version))
        with self._state.outcomes.count(served.name, PROTOCOL), _counted_if_cancelled(self._state, served, context):
            served.check_serving()
            settings = self._state.settings
            decoded = codec.decode(
                message, served.d_model, self._state.shared_memory, settings.max_queue_rows, settings.max_body_bytes
            )
            identity.decoded(decoded.shape, decoded.dtype.name)
            deadline = self._deadline(decoded.timeout_us, context)
            # Most requests carry no parameters: then none asks for Monte Carlo dropout.
            asked = (
                mc_parameters.from_json(decoded.parameters, served, self._state.settings.max_mc_passes)
                if decoded.parameters
                else None
            )
            if asked is None:
                output = await served.infer(decoded.rows, decoded.dtype, deadline=deadline)
                identity.resumed()  # a traced request's encode stage starts here
                return codec.encode(served, decoded, {OUTPUT_NAME: output})
            result = await served.infer_monte_carlo(decoded.rows, asked, decoded.dtype, deadline=deadline)
            identity.resumed()
            answers = {OUTPUT_NAME: result.mean, STD_OUTPUT_NAME: result.std}
            return codec.encode(served, decoded, answers, mc_parameters.echoed(asked))

    def _deadline(self, timeout_us: float | None, context: Context) -> float:
        """The sooner of the call's gRPC deadline and the `timeout` parameter (else the default timeout)."""
        timeout_ms = None if timeout_us is None else timeout_us / 1000.0
        deadline = deadline_from(timeout_ms, self._state.settings.default_timeout_ms)
        remaining = context.time_remaining()
        if remaining is None:
            return deadline
        return min(deadline, asyncio.get_running_loop().time() + remaining)

    # ----- the extensions: each the twin of its HTTP routes, through the same functions ----------

    @answered
    async def SystemSharedMemoryStatus(
        self, request: pb.SystemSharedMemoryStatusRequest, context: Context
    ) -> pb.SystemSharedMemoryStatusResponse:
        answer = pb.SystemSharedMemoryStatusResponse()
        for region in system_shared_memory.status(self._state, request.name or None):
            answer.regions[region["name"]].CopyFrom(
                pb.SystemSharedMemoryStatusResponse.RegionStatus(
                    name=region["name"], key=region["key"], offset=region["offset"], byte_size=region["byte_size"]
                )
            )
        return answer

    @answered
    async def SystemSharedMemoryRegister(
        self, request: pb.SystemSharedMemoryRegisterRequest, context: Context
    ) -> pb.SystemSharedMemoryRegisterResponse:
        system_shared_memory.regions_of(self._state)  # off: the same refusal as over HTTP
        document = {"key": request.key, "offset": request.offset, "byte_size": request.byte_size}
        await system_shared_memory.register_document(self._state, request.name, document)
        return pb.SystemSharedMemoryRegisterResponse()

    @answered
    async def SystemSharedMemoryUnregister(
        self, request: pb.SystemSharedMemoryUnregisterRequest, context: Context
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        await system_shared_memory.unregister(self._state, request.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    @answered
    async def CudaSharedMemoryStatus(
        self, request: pb.CudaSharedMemoryStatusRequest, context: Context
    ) -> pb.CudaSharedMemoryStatusResponse:
        system_shared_memory.cuda_status(self._state, request.name or None)  # none registered: empty, or NOT_FOUND
        return pb.CudaSharedMemoryStatusResponse()

    @answered
    async def CudaSharedMemoryRegister(self, request: Any, context: Context) -> Any:
        await system_shared_memory.cuda_register(self._state)

    @answered
    async def CudaSharedMemoryUnregister(
        self, request: pb.CudaSharedMemoryUnregisterRequest, context: Context
    ) -> pb.CudaSharedMemoryUnregisterResponse:
        system_shared_memory.cuda_unregister(request.name or None)
        return pb.CudaSharedMemoryUnregisterResponse()

    @answered
    async def TraceSetting(self, request: pb.TraceSettingRequest, context: Context) -> pb.TraceSettingResponse:
        """The twin of GET and POST /v2[/models/{name}]/trace/setting: no settings in the request reads them."""
        name = request.model_name or None
        if request.settings:
            # Triton's gRPC shape: each setting a list of strings; an empty list puts it back (JSON null).
            document = {
                key: (
                    (list(value.value) or None) if key == "trace_level" else (value.value[0] if value.value else None)
                )
                for key, value in request.settings.items()
            }
            settings = await trace_extension.update_settings(self._state, name, document)
        else:
            settings = await trace_extension.settings_of(self._state, name)
        answer = pb.TraceSettingResponse()
        for key, value in settings.items():
            answer.settings[key].value.extend(value if isinstance(value, list) else [str(value)])
        return answer

    @answered
    async def LogSettings(self, request: pb.LogSettingsRequest, context: Context) -> pb.LogSettingsResponse:
        """The twin of GET and POST /v2/logging: no settings in the request reads them."""
        update = {
            key: getattr(value, value.WhichOneof("parameter_choice") or "string_param")
            for key, value in request.settings.items()
        }
        settings = await log_settings.log_settings(self._state, update)
        answer = pb.LogSettingsResponse()
        for key, value in settings.items():
            kind = (
                "bool_param"
                if isinstance(value, bool)
                else "uint32_param"
                if isinstance(value, int)
                else "string_param"
            )
            setattr(answer.settings[key], kind, value)
        return answer

    @answered
    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Context
    ) -> pb.RepositoryModelLoadResponse:
        # The HTTP route's parameters and the engine's load: the same checks, errors, broadcast and counts.
        async def parameters() -> dict[str, Any]:
            return _repository_parameters(request.parameters)

        await model_control.load(self._engine, request.model_name, parameters())
        return pb.RepositoryModelLoadResponse()  # Triton's answer is empty; the version is in the index

    @answered
    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Context
    ) -> pb.RepositoryModelUnloadResponse:
        model_control.check_unload(_repository_parameters(request.parameters))
        await self._engine.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()


DEADLINE_SKEW_S = 0.5  # how much earlier than the server's the client's copy of a deadline may end


@contextmanager
def _counted_if_cancelled(state: ServiceState, served: ModelFacade, context: Context) -> Iterator[None]:
    """Count a call cancelled while it waits: by its client (client_closed_request) or by its deadline.

    ServiceState.count sees exceptions; a cancelled call ends with CancelledError instead.
    """
    try:
        yield
    except asyncio.CancelledError:
        remaining = context.time_remaining()
        # The client ends the call at its own deadline, which is earlier than the server's copy by the
        # time the call took to arrive: a cancellation that close to the deadline is the deadline.
        near = remaining is not None and remaining <= DEADLINE_SKEW_S
        outcome = "deadline_exceeded" if near else "client_closed_request"
        state.outcomes.counter(served.name, outcome, PROTOCOL).inc()
        raise
